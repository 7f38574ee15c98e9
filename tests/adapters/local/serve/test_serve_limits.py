"""``spec-tot serve`` bounded under hostile load (issue 22), fast versions of
``benchmarks/serve_limits.py``: every request, connection and stream has a limit, refused
with a 4xx naming it (429 with ``Retry-After`` past an in-flight cap); half-open and idle
connections are closed on time and cannot lock out real clients; a client that never
reads its stream has it aborted and its KV freed; text that cannot be encoded and empty
text follow one rule on all four routes; load reports are the engine's truth right after
mid-request disconnects; and the API key rule."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import torch
from engine_fixtures import tiny_llama, tiny_prm
from serve_helpers import served, settle

from spec_tot.adapters.local import LocalBackend, create_local
from spec_tot.adapters.local.serve import ServeLimits, create_server_app
from spec_tot.adapters.local.serve.connections import KERNEL_BACKLOG
from spec_tot.errors import ConfigError

__all__ = ["tiny_llama", "tiny_prm"]

torch.set_num_threads(1)
pytestmark = pytest.mark.asyncio(loop_scope="module")

LIMITS = ServeLimits(
    max_samples_per_request=64,
    max_inflight_samples=160,
    max_inflight_tokens=30_000,
    max_body_bytes=1 << 20,
    max_buffered_body_bytes=4 << 20,
    max_header_bytes=4096,
    max_header_count=40,
    max_connections=40,
    header_timeout_s=0.5,
    keep_alive_s=0.3,
    body_timeout_s=0.5,
    stream_buffer_bytes=4096,
    stream_stall_s=0.6,
    retry_after_s=2,
)


JSON_TYPE = {"content-type": "application/json"}  # JSON routes require it


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama: Path, tiny_prm: Path) -> AsyncIterator[tuple[LocalBackend, str, Any]]:
    backend = create_local(
        policy_path=str(tiny_llama), prm_path=str(tiny_prm), saturation_batch=8, max_model_len=256
    )
    app_box: dict[str, Any] = {}
    try:
        async with served(backend, served_model_name="tiny", limits=LIMITS, box=app_box) as url:
            yield backend, url, app_box["app"]
    finally:
        await backend.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def clean(
    server: tuple[LocalBackend, str, Any],
) -> AsyncIterator[tuple[LocalBackend, str, Any]]:
    yield server
    await settle(server[0])
    ctx = server[2].state.serve
    assert (ctx.admission.samples, ctx.admission.tokens, ctx.admission.body_bytes) == (0, 0, 0)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection (fails past ``seconds``)."""
    got = b""
    async with asyncio.timeout(seconds):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionResetError:
                return got
            if not chunk:
                return got
            got += chunk


# -- per-request limits ----------------------------------------------------------------------
async def test_samples_over_the_cap_are_a_fast_400_naming_the_limit(
    clean: tuple[LocalBackend, str, Any],
) -> None:
    """The issue's body: 20,000 prompts x n=128 on /v1/completions (once 10 GB of RSS)."""
    backend, url, _ = clean
    await settle(backend)
    before = backend.stats()
    cases = [
        ("/v1/completions", {"model": "tiny", "prompt": ["1 2"] * 20_000, "n": 128}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": [[5, 6]] * 65}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": ["1"] * 8, "n": 9}, "prompt"),
        ("/v1/chat/completions",
         {"model": "tiny", "messages": [{"role": "user", "content": "1"}], "n": 65}, "n"),
        ("/generate", {"text": ["1 2"] * 20_000}, "text"),
        ("/generate", {"text": ["1"] * 8, "sampling_params": {"n": 9}}, "sampling_params.n"),
        ("/generate", {"input_ids": [[5]] * 65}, "input_ids"),
        ("/classify", {"text": ["q\n1+2=3"] * 65}, "text"),
    ]  # fmt: skip
    async with httpx.AsyncClient(timeout=30) as client:
        for path, body, field in cases:
            started = time.perf_counter()
            reply = await client.post(url + path, json=body)
            elapsed = time.perf_counter() - started
            assert reply.status_code == 400, (path, reply.text)
            error = reply.json()["error"]
            assert error["param"] == field and "max_samples_per_request is 64" in error["message"]
            # refused before any work: behaviour here, speed in benchmarks/serve_limits.py
            # (100 ms target); the bound only catches the old minutes-long, 10 GB case and
            # holds at load average 10 on 2 cores
            assert elapsed < 20.0, (path, elapsed)
        await settle(backend)
        after = backend.stats()
        for key in ("num_requests", "num_prompt_tokens", "prm_calls"):  # nothing reached a model
            assert after.get(key, 0.0) == before.get(key, 0.0), key
        # at the cap it runs
        ok = await client.post(url + "/generate", json={
            "text": ["1 2"] * 8, "sampling_params": {"n": 8, "max_new_tokens": 2}})  # fmt: skip
        assert ok.status_code == 200 and len(ok.json()) == 64


async def test_past_the_in_flight_caps_is_a_429_with_retry_after(
    clean: tuple[LocalBackend, str, Any],
) -> None:
    _, url, app = clean
    admission = app.state.serve.admission
    long = {"text": "1 2 3", "rid": "hog", "sampling_params": {
        "n": 64, "max_new_tokens": 200, "ignore_eos": True}}  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as client:
        hog = asyncio.create_task(client.post(url + "/generate", json=long))
        for _ in range(500):
            if admission.samples:
                break
            await asyncio.sleep(0.01)
        assert admission.samples == 64
        # 96 samples are free: one request may take at most half of them (48)
        for path, body in (
            ("/generate", {"text": "1", "sampling_params": {"n": 49, "max_new_tokens": 2}}),
            ("/v1/completions", {"model": "tiny", "prompt": ["1"] * 49, "max_tokens": 2}),
            ("/classify", {"text": ["q\n1+2=3"] * 49}),
        ):
            reply = await client.post(url + path, json=body)
            assert reply.status_code == 429, (path, reply.text)
            assert reply.headers["retry-after"] == "2"
            assert reply.json()["error"]["param"] == "max_inflight_samples", reply.text
        small = await client.post(url + "/generate", json={"text": "1", "sampling_params": {
            "n": 48, "max_new_tokens": 2}})  # fmt: skip
        assert small.status_code == 200  # what fits beside the hog still runs
        # one request that reserves more tokens than the server ever holds: a 400, not a 429
        huge = await client.post(url + "/generate", json={"text": ["1"] * 64, "sampling_params":
                                                          {"max_new_tokens": 500}})  # fmt: skip
        assert huge.status_code == 400 and "max_inflight_tokens" in huge.text
        await client.post(url + "/abort_request", json={"rid": "hog"})
        assert (await hog).status_code == 200
    assert admission.samples == 0


async def test_body_and_header_limits_name_the_limit(clean: tuple[LocalBackend, str, Any]) -> None:
    _, url, app = clean
    port = _port(url)
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(
            url + "/generate", content=b" " * (LIMITS.max_body_bytes + 1), headers=JSON_TYPE
        )
        assert reply.status_code == 413 and "max_body_bytes" in reply.text
        many = {f"x-h{i}": "1" for i in range(LIMITS.max_header_count + 1)}
        reply = await client.get(url + "/health", headers=many)
        assert reply.status_code == 431 and reply.json()["error"]["param"] == "max_header_count"
        long = {"x-long": "a" * (LIMITS.max_header_bytes + 10)}
        reply = await client.get(url + "/health", headers=long)
        assert reply.status_code == 431 and "max_header_bytes" in reply.text
    # a body that never arrives: a 408 once body_timeout_s has passed, then closed
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 100\r\n\r\n{"te'
    )
    await writer.drain()
    started = time.monotonic()
    got = await _closed_within(reader, LIMITS.body_timeout_s + 3)
    assert got.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in got, got[:200]
    assert time.monotonic() - started >= LIMITS.body_timeout_s * 0.9
    writer.close()
    assert app.state.serve.admission.body_bytes == 0


# -- connections -----------------------------------------------------------------------------
async def test_half_open_and_idle_connections_are_closed_on_time(
    clean: tuple[LocalBackend, str, Any],
) -> None:
    _, url, app = clean
    guard = app.state.connections
    before = guard.counts["timed_out"]
    streams = []
    for i in range(10):
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        if i % 2:  # half a request head, then nothing
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ")
            await writer.drain()
        streams.append((reader, writer))
    started = time.monotonic()
    for reader, _ in streams:
        await _closed_within(reader, LIMITS.header_timeout_s + 2)
    elapsed = time.monotonic() - started
    assert LIMITS.header_timeout_s * 0.8 <= elapsed < LIMITS.header_timeout_s + 2
    assert guard.counts["timed_out"] - before >= 10
    # an idle keep-alive connection is closed after keep_alive_s
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    await writer.drain()
    got = await _closed_within(reader, LIMITS.keep_alive_s + 2)
    assert got.startswith(b"HTTP/1.1 200")
    for _, w in [*streams, (reader, writer)]:
        w.close()


async def test_a_flood_of_half_open_connections_cannot_lock_out_a_real_client(
    clean: tuple[LocalBackend, str, Any],
) -> None:
    """Three times the connection cap in half-open sockets: each new one evicts the one
    that has waited longest, so /health (which sends its request at once) always gets in
    (within the client's timeout). On a loaded machine some half-open sockets time out
    before a newer one evicts them: either way they are ended, and the guard never holds
    more than its cap (a count of evictions alone failed on a busy machine: 41 >= 79)."""
    _, url, app = clean
    guard = app.state.connections
    flood = []
    ended = ("evicted", "timed_out")
    before = sum(guard.counts[k] for k in ended)
    async with httpx.AsyncClient(timeout=5, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        for i in range(3 * guard.cap):
            _, writer = await asyncio.open_connection("127.0.0.1", _port(url))
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ")
            flood.append(writer)
            if i % guard.cap == guard.cap - 1:
                assert (await c.get(url + "/health")).status_code == 200
        assert guard.open <= guard.cap
        assert sum(guard.counts[k] for k in ended) - before >= 2 * guard.cap - 1
    for writer in flood:
        writer.close()


async def test_the_kernel_queue_holds_more_than_an_accept_burst(
    clean: tuple[LocalBackend, str, Any],
) -> None:
    """Handshakes that arrive while the loop is busy wait in the kernel's queue, deeper than
    one accept burst (a queue as deep as the burst dropped SYNs past it, and each of those
    clients waited out a 1 s retransmit); the guard then accepts them all (each is evicted
    or times out) without meeting the open-file limit."""
    _, url, app = clean
    guard = app.state.connections
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    count = min(guard.burst + 200, min(KERNEL_BACKLOG, somaxconn) - 8)
    if count <= guard.burst:
        pytest.skip(f"net.core.somaxconn ({somaxconn}) caps the queue at one accept burst")
    ended = ("evicted", "timed_out")
    before = sum(guard.counts[k] for k in ended)
    # blocking connects in the server's own loop: it accepts none until all are in
    socks = [socket.create_connection(("127.0.0.1", _port(url)), timeout=0.5) for _ in range(count)]
    deadline = time.monotonic() + LIMITS.header_timeout_s + 3
    while sum(guard.counts[k] for k in ended) - before < count and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert sum(guard.counts[k] for k in ended) - before >= count
    assert guard.counts["accept_out_of_files"] == 0
    async with httpx.AsyncClient(timeout=1) as c:
        assert (await c.get(url + "/health")).status_code == 200
    for sock in socks:
        sock.close()


async def test_a_stream_whose_client_never_reads_is_aborted_and_its_kv_freed(
    clean: tuple[LocalBackend, str, Any],
) -> None:
    backend, url, app = clean
    admission = app.state.serve.admission
    body = json.dumps({"text": "1 2 3 4", "stream": True, "sampling_params": {
        "n": 48, "max_new_tokens": 240, "ignore_eos": True}}).encode()  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", _port(url)))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
    await writer.drain()
    for _ in range(500):
        if admission.samples:
            break
        await asyncio.sleep(0.01)
    assert admission.samples == 48
    started = time.monotonic()
    while admission.samples:  # paused, then aborted after stream_stall_s
        assert time.monotonic() - started < 30, "the stalled stream was never aborted"
        await asyncio.sleep(0.05)
    await backend.flush()
    assert backend.num_inflight == 0
    report = await backend.pool_report()  # the engine's own figures, in its process
    assert report.requests == report.running == report.waiting == 0
    assert report.free_blocks == report.total_blocks, report
    got = await _closed_within(reader, 5)  # dropped, with whatever it never read
    assert got.startswith(b"HTTP/1.1 200")
    writer.close()
    stats = app.state.serve.stream_stats
    assert stats["stalled"] >= 1
    assert LIMITS.stream_stall_s <= stats["max_stall_to_abort_s"] < LIMITS.stream_stall_s + 1


# -- text rule -------------------------------------------------------------------------------
def _chat(content: str) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}]}


# JSON joins an escaped surrogate pair into one code point (a valid emoji); a pair in the
# wrong order stays two lone surrogates.
@pytest.mark.parametrize("text", ["", "1 2 \udcff", "\ude00\ud83d reversed pair"])
async def test_lone_surrogates_and_empty_text_are_a_400_naming_the_field_on_every_route(
    clean: tuple[LocalBackend, str, Any], text: str
) -> None:
    _, url, _ = clean
    # an empty stop string or message means "none" (SGLang's and OpenAI's rule): those
    # fields get a lone surrogate instead
    bad = text or "\udcff"
    said = "is empty" if not text else "lone surrogate"
    cases = [
        ("/generate", {"text": text}, "text", said),
        ("/generate", {"text": ["1", text]}, "text[1]", said),
        ("/generate", {"text": "1", "sampling_params": {"stop": [bad]}}, "sampling_params.stop[0]",
         "lone surrogate"),
        ("/classify", {"text": text}, "text", said),
        ("/classify", {"text": ["q\nstep", text]}, "text[1]", said),
        ("/v1/completions", {"model": "tiny", "prompt": text}, "prompt", said),
        ("/v1/completions", {"model": "tiny", "prompt": ["1", text]}, "prompt[1]", said),
        ("/v1/completions", {"model": "tiny", "prompt": "1", "stop": bad}, "stop[0]",
         "lone surrogate"),
        ("/v1/chat/completions", _chat(bad), "messages[0].content", "lone surrogate"),
        ("/generate", {"text": "1", "rid": bad}, "rid", "lone surrogate"),  # echoed back
        ("/generate", {"text": ["1", "2"], "rid": ["a", bad]}, "rid[1]", "lone surrogate"),
    ]  # fmt: skip
    async with httpx.AsyncClient(timeout=30) as client:
        for path, body, field, words in cases:
            raw = json.dumps(body)  # escapes the surrogate as \\udcff, as a client would
            reply = await client.post(url + path, content=raw, headers=JSON_TYPE)
            assert reply.status_code == 400, (path, field, reply.text)
            message = reply.json()["error"]["message"]
            assert message.startswith(field + ": ") and words in message, (path, message)
        # the client's text quoted in an error (an unknown key) is escaped, never a 500
        for path, body, _, _ in cases:
            reply = await client.post(
                url + path, content=json.dumps({**body, bad + "k": 1}), headers=JSON_TYPE
            )
            assert reply.status_code == 400, (path, reply.text)
            assert reply.json()["error"]["type"] == "invalid_request_error", reply.text
        # raw bytes that are not UTF-8 at all: the body is not JSON
        reply = await client.post(
            url + "/generate", content=b'{"text": "\xff\xfe"}', headers=JSON_TYPE
        )
        assert reply.status_code == 400 and "body" in reply.text


async def test_web_pages_cannot_drive_a_local_server(
    clean: tuple[LocalBackend, str, Any],
) -> None:
    """On 2f33153 a text/plain POST (a "simple" cross-origin request a page may send
    unasked) ran on an unauthenticated loopback server."""
    backend, url, _ = clean
    body = json.dumps({"text": "1 2 3 4", "sampling_params": {"max_new_tokens": 2}})
    async with httpx.AsyncClient(timeout=30) as client:
        plain = {"content-type": "text/plain"}
        reply = await client.post(url + "/generate", content=body, headers=plain)
        assert reply.status_code == 415 and "application/json" in reply.text
        page = {**JSON_TYPE, "origin": "https://evil.example"}
        reply = await client.post(url + "/generate", content=body, headers=page)
        assert reply.status_code == 403 and "evil.example" in reply.text
        assert (await client.get(url + "/get_server_info", headers=page)).status_code == 403
        ok = await client.post(url + "/generate", content=body, headers=JSON_TYPE)
        assert ok.status_code == 200  # no Origin, JSON: every non-browser client
        assert (await client.post(url + "/flush_cache")).status_code == 200  # posted empty
    async with (
        served(backend, allowed_origins=["http://localhost:8888"]) as url2,
        httpx.AsyncClient(timeout=30) as client,
    ):
        mine = {"origin": "http://localhost:8888"}
        pre = await client.options(url2 + "/generate", headers=mine)
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == "http://localhost:8888"
        reply = await client.post(url2 + "/generate", content=body, headers={**JSON_TYPE, **mine})
        assert reply.status_code == 200
        assert reply.headers["access-control-allow-origin"] == "http://localhost:8888"
    for bad in ("*", "localhost:8888", "http://h/path"):
        with pytest.raises(ConfigError, match="allowed_origins"):
            create_server_app(backend, allowed_origins=[bad])


async def test_a_client_that_leaves_mid_generate_is_logged_once_at_info(
    clean: tuple[LocalBackend, str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """On 2f33153 every such client logged "Exception in ASGI application" at ERROR with a
    CancelledError traceback: a normal event reported as a server error."""
    _, url, _ = clean
    body = {"text": "1 2 3 4", "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
    fresh = httpx.Limits(max_keepalive_connections=0)
    with caplog.at_level(logging.INFO):
        async with httpx.AsyncClient(timeout=60, limits=fresh) as client:
            tasks = [
                asyncio.create_task(client.post(url + "/generate", json=body)) for _ in range(4)
            ]
            for _ in range(500):
                info = (await client.get(url + "/get_server_info")).json()
                if info["num_running_reqs"] + info["num_waiting_reqs"] >= 4:
                    break
                await asyncio.sleep(0.01)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(200):  # the server sees each disconnect on its own schedule
            gone = [r for r in caplog.records if "client disconnected during" in r.getMessage()]
            if len(gone) == 4:
                break
            await asyncio.sleep(0.01)
    assert len(gone) == 4 and all(r.levelno == logging.INFO for r in gone)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# -- load reports ----------------------------------------------------------------------------
async def test_load_reports_are_the_engine_s_truth_right_after_disconnects(
    clean: tuple[LocalBackend, str, Any],
) -> None:
    """32 clients go away mid-request: /get_server_info, /metrics and /v1/loads say so at
    once (they once kept reporting 20-23 running requests until the next request)."""
    backend, url, _ = clean
    body = {"text": "1 2 3 4", "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
    fresh = httpx.Limits(max_keepalive_connections=0)  # keep_alive_s is short here
    async with httpx.AsyncClient(timeout=60, limits=fresh) as client:
        tasks = [asyncio.create_task(client.post(url + "/generate", json=body)) for _ in range(32)]
        for _ in range(500):
            info = (await client.get(url + "/get_server_info")).json()
            if info["num_running_reqs"] + info["num_waiting_reqs"] >= 16:
                break
            await asyncio.sleep(0.01)
        assert info["kv_blocks_used"] > 0
        for task in tasks:
            task.cancel()  # the clients go away mid-request
        await asyncio.gather(*tasks, return_exceptions=True)
    async with httpx.AsyncClient(timeout=10, limits=fresh) as client:
        deadline = time.monotonic() + 1.0
        while True:
            info = (await client.get(url + "/get_server_info")).json()
            idle = info["num_running_reqs"] == info["num_waiting_reqs"] == 0
            if (idle and info["kv_blocks_used"] == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        assert idle and info["kv_blocks_used"] == 0, info
        report = await backend.pool_report()  # the engine's own figures, in its process
        assert report.requests == 0 and report.free_blocks == report.total_blocks, report
        loads = (await client.get(url + "/v1/loads")).json()["loads"][0]
        assert loads["num_running_reqs"] == 0 and loads["num_used_tokens"] == 0
        metrics = (await client.get(url + "/metrics")).text
        assert 'sglang:num_running_reqs{model_name="tiny"} 0' in metrics


# -- auth ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "key", ["", " ", "\t", " s3cret", "s3cret\n", "k\udcffy", 5, "abc\ndef", "a b", "clé-\u263a"]
)
async def test_an_empty_padded_or_unsendable_key_never_turns_auth_off(
    clean: tuple[LocalBackend, str, Any], key: Any
) -> None:
    with pytest.raises(ConfigError) as info:
        create_server_app(clean[0], api_key=key)
    assert info.value.field == "api_key"


async def test_every_visible_ascii_key_is_sendable_and_checked(
    clean: tuple[LocalBackend, str, Any],
) -> None:
    """Keys are visible ASCII (a header value every client sends unchanged): one with every
    punctuation mark works, a near miss is a 401."""
    backend, _, _ = clean
    key = "k3y-!\"#$%&'()*+,./:;<=>?@[\\]^_`{|}~"
    async with (
        served(backend, api_key=key) as url,
        httpx.AsyncClient(timeout=30) as client,
    ):
        good = {"authorization": "Bearer " + key}
        near = {"authorization": "Bearer " + key[:-1]}
        assert (await client.get(url + "/get_server_info", headers=good)).status_code == 200
        assert (await client.get(url + "/get_server_info", headers=near)).status_code == 401
        assert (await client.get(url + "/get_server_info")).status_code == 401
