"""EndpointPool: bounded retries, failover, circuit breaker, routing, limits, per-request
deadlines, stopped workers, timed health probes, the API key (127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fake_sglang import FakeSGLang, Request

from spec_tot.adapters.http import CircuitBreaker, EndpointPool, HttpConfig, WireProtocol, query_key
from spec_tot.adapters.openai_compat import OPENAI_WIRE
from spec_tot.adapters.sglang import SGLANG_WIRE
from spec_tot.errors import BackendError, BackendTimeoutError, ConfigError


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def dead_url() -> str:
    """A 127.0.0.1 port with nothing listening: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
async def server() -> AsyncIterator[FakeSGLang]:
    srv = await FakeSGLang().start()
    yield srv
    await srv.stop()


def make_pool(urls: list[str], t: FakeTime, **kw: object) -> EndpointPool:
    """A pool on fake time; no timed health probe (it would run on the fake clock)."""
    defaults = {"max_retries": 2, "backoff_base_s": 0.1, "health_path": None}
    config = HttpConfig(**{**defaults, **kw})  # type: ignore[arg-type]
    return EndpointPool(
        urls, config, sleep=t.sleep, clock=t.clock, rng=random.Random(0), protocol=SGLANG_WIRE
    )


BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "rid": "q/1"}


async def test_retries_are_bounded_and_backoff_grows(server: FakeSGLang) -> None:
    t = FakeTime()
    server.faults = ["503"] * 10
    pool = make_pool([server.url], t, breaker_threshold=100)
    with pytest.raises(BackendError) as err:
        await pool.json("POST", "/generate", BODY, key="q")
    assert server.attempts["/generate"] == 3  # 1 + max_retries, no more
    assert server.url in str(err.value) and err.value.endpoint.startswith(server.url)
    assert len(t.sleeps) == 2 and t.sleeps[1] > t.sleeps[0] * 0.9
    assert all(0.05 <= s <= 0.2 for s in t.sleeps)  # jittered within [0.5, 1] x base * 2^k
    await pool.aclose()


async def test_refused_connection_is_retried_then_named() -> None:
    t = FakeTime()
    url = dead_url()
    pool = make_pool([url], t, breaker_threshold=100)
    with pytest.raises(BackendError) as err:
        await pool.json("GET", "/health")
    assert pool.endpoints[url].attempts == 3
    assert err.value.endpoint.startswith(url) and "cannot connect" in str(err.value)
    await pool.aclose()


async def test_500_is_not_retried(server: FakeSGLang) -> None:
    t = FakeTime()
    server.faults = ["500"]
    pool = make_pool([server.url], t)
    with pytest.raises(BackendError) as err:
        await pool.json("POST", "/generate", BODY)
    assert server.attempts["/generate"] == 1 and "500" in str(err.value)
    await pool.aclose()


async def test_lost_before_any_byte_is_retried(server: FakeSGLang) -> None:
    t = FakeTime()
    server.faults = ["refuse"]
    pool = make_pool([server.url], t)
    _, out = await pool.json("POST", "/generate", BODY)
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert server.attempts["/generate"] == 2 and server.live == {}
    await pool.aclose()


async def test_read_timeout_is_not_retried(server: FakeSGLang) -> None:
    server.faults, server.slow_s = ["slow"], 1.0
    pool = make_pool([server.url], FakeTime(), read_timeout_s=0.1)
    with pytest.raises(BackendTimeoutError) as err:
        await pool.json("POST", "/generate", BODY)
    assert server.attempts["/generate"] == 1 and server.url in err.value.endpoint
    await pool.aclose()


async def test_failover_and_sticky_routing(server: FakeSGLang) -> None:
    t = FakeTime()
    dead = dead_url()
    pool = make_pool([dead, server.url], t, breaker_threshold=1)
    pool.routes.settle("q", dead)  # the query's home is down
    url, _ = await pool.json("POST", "/generate", BODY, key="q")
    assert url == server.url and pool.home_of("q") == server.url
    assert pool.endpoints[dead].breaker.state == "open"
    url2, _ = await pool.json("POST", "/generate", BODY, key="q")
    assert url2 == server.url and pool.endpoints[dead].attempts == 1  # open: skipped
    await pool.aclose()


async def test_routing_keeps_each_query_on_one_worker() -> None:
    a, b = await FakeSGLang().start(), await FakeSGLang().start()
    pool = make_pool([a.url, b.url], FakeTime())
    seen: dict[str, set[str]] = {}
    for i in range(12):
        q = f"q{i % 4}"
        url, _ = await pool.json(
            "POST", "/generate", {**BODY, "rid": f"{q}/{i}"}, key=query_key(f"{q}/n{i}/x")
        )
        seen.setdefault(q, set()).add(url)
    assert all(len(urls) == 1 for urls in seen.values())
    assert {u for urls in seen.values() for u in urls} == {a.url, b.url}  # both used
    await pool.aclose()
    await a.stop()
    await b.stop()


async def test_circuit_breaker_opens_and_recovers(server: FakeSGLang) -> None:
    t = FakeTime()
    pool = make_pool([server.url], t, max_retries=0, breaker_threshold=2, breaker_cooldown_s=10.0)
    server.faults = ["503", "503"]
    for _ in range(2):
        with pytest.raises(BackendError):
            await pool.json("POST", "/generate", BODY)
    assert pool.endpoints[server.url].breaker.state == "open"
    with pytest.raises(BackendError, match="circuit open"):
        await pool.json("POST", "/generate", BODY)
    assert server.attempts["/generate"] == 2  # the open breaker sent nothing
    t.now += 10.0
    assert pool.endpoints[server.url].breaker.state == "half_open"
    await pool.json("POST", "/generate", BODY)  # the probe succeeds
    assert pool.endpoints[server.url].breaker.state == "closed"
    await pool.aclose()


def test_breaker_half_open_allows_one_probe_and_reopens() -> None:
    now = [0.0]
    b = CircuitBreaker(threshold=1, cooldown_s=5.0, clock=lambda: now[0])
    b.failure()
    assert b.state == "open" and not b.acquire()
    now[0] = 5.0
    assert b.acquire() and not b.acquire()  # one probe at a time
    b.failure()
    assert b.state == "open"
    now[0] = 10.0
    assert b.acquire()
    b.success()
    assert b.state == "closed" and b.acquire() and b.acquire()


async def test_concurrency_limit_per_worker(server: FakeSGLang) -> None:
    server.token_delay_s = 0.01
    pool = make_pool([server.url], FakeTime(), max_concurrency=2)
    await asyncio.gather(
        *(pool.json("POST", "/generate", {**BODY, "rid": f"r{i}"}) for i in range(6))
    )
    assert server.max_live == 2 and server.live == {}
    await pool.aclose()


def test_query_key() -> None:
    assert query_key("q7/n1/n3") == "q7" and query_key("solo") == "solo"


# -- deadlines, stopped workers, timed probes, API key --------------------------------------------
@dataclass
class Stoppable(FakeSGLang):
    """A FakeSGLang that can be stopped (SIGSTOP as a client sees it): connections are
    accepted, requests read, nothing answered, /health included, until it runs again."""

    running: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.running.set()

    async def handle(self, req: Request) -> bool:
        await self.running.wait()
        return await super().handle(req)


def live_pool(urls: list[str], **kw: object) -> EndpointPool:
    """Real time, small deadlines: floor 0.2 s, 10 ms per budget token before any sample."""
    defaults: dict[str, object] = {
        "max_retries": 3, "backoff_base_s": 0.01, "deadline_floor_s": 0.2,
        "deadline_slack": 1.0, "assumed_s_per_token": 0.01, "deadline_cap_s": 30.0,
        "breaker_threshold": 2, "breaker_cooldown_s": 0.3, "probe_timeout_s": 0.2,
    }  # fmt: skip
    config = HttpConfig(**{**defaults, **kw})  # type: ignore[arg-type]
    return EndpointPool(urls, config, protocol=SGLANG_WIRE)


def gen_body(rid: str, budget: int) -> dict[str, object]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": budget}, "rid": rid}


def test_deadline_from_budget_and_learned_speed() -> None:
    pool = make_pool(["http://w"], FakeTime(), deadline_floor_s=10.0, deadline_slack=4.0,
                     assumed_s_per_token=0.1, deadline_cap_s=100.0)  # fmt: skip
    w = pool.endpoints["http://w"]
    assert pool.deadline_s(w, None) == 10.0  # no budget (classify, abort): the floor
    assert pool.deadline_s(w, 50) == pytest.approx(10.0 + 4 * 50 * 0.1)  # the prior speed
    assert pool.deadline_s(w, 10_000) == 100.0  # the cap
    pool.observe("http://w", tokens=100, seconds=1.0)  # 10 ms per token
    assert pool.deadline_s(w, 50) == pytest.approx(10.0 + 4 * 50 * 0.01)
    pool.observe("http://w", tokens=100, seconds=11.0)  # a loaded worker: deadlines grow
    assert w.s_per_token == pytest.approx(0.01 + 0.2 * (0.11 - 0.01))


def test_budget_and_output_tokens_read_by_each_protocol() -> None:
    sglang_budget, openai_budget = SGLANG_WIRE.request_budget, OPENAI_WIRE.request_budget
    assert sglang_budget({"sampling_params": {"max_new_tokens": 64, "n": 8}}) == 64
    batch = {"text": ["a", "a"], "sampling_params": [{"max_new_tokens": 8}, {"max_new_tokens": 9}]}
    assert sglang_budget(batch) == 9  # a batch's prompts run side by side: the largest
    assert openai_budget({"prompt": "x", "max_tokens": 32, "n": 4}) == 32
    assert openai_budget({"prompt": "x", "max_completion_tokens": 16}) == 16
    assert sglang_budget({"text": ["a"]}) is None and sglang_budget([1]) is None
    assert openai_budget({"max_tokens": True}) is None and openai_budget([1]) is None
    assert WireProtocol().request_budget(batch) is None  # the default knows no protocol

    def reply(value: object) -> httpx.Response:
        response = httpx.Response(200, content=json.dumps(value).encode())
        response.read()
        return response

    sglang = [{"meta_info": {"completion_tokens": k}} for k in (3, 7)]
    assert SGLANG_WIRE.tokens_of(reply(sglang)) == 7  # samples side by side: the longest
    openai = {"choices": [{}, {}], "usage": {"completion_tokens": 10}}
    assert OPENAI_WIRE.tokens_of(reply(openai)) == 5
    assert OPENAI_WIRE.tokens_of(reply(sglang)) is None  # each reads only its own shape
    assert SGLANG_WIRE.tokens_of(reply(openai)) is None
    streamed = httpx.Response(200, stream=httpx.ByteStream(b"data: {}\n\n"))
    assert SGLANG_WIRE.tokens_of(streamed) is None


async def test_the_pool_learns_each_workers_speed(server: FakeSGLang) -> None:
    server.token_delay_s, server.tokens = 0.01, 4
    pool = live_pool([server.url])
    await pool.json("POST", "/generate", gen_body("a", 16))
    learned = pool.endpoints[server.url].s_per_token
    assert learned is not None and 0.005 < learned < 0.5  # ~4 tokens in ~40 ms
    await pool.json("POST", "/classify", {"text": ["x"]})  # no budget: teaches nothing
    assert pool.endpoints[server.url].s_per_token == learned
    await pool.aclose()


async def test_a_stopped_worker_releases_its_queries_to_a_healthy_one(
    server: FakeSGLang,
) -> None:
    stopped = await Stoppable().start()
    stopped.running.clear()
    pool = live_pool([stopped.url, server.url])
    for q in ("short0", "short1", "long0", "long1"):
        pool.routes.settle(q, stopped.url)  # every query's home is the stopped worker
    started = time.monotonic()
    budgets = {"short0": 2, "short1": 2, "long0": 2000, "long1": 2000}  # long: 20 s deadlines
    results = await asyncio.gather(
        *(pool.json("POST", "/generate", gen_body(f"{q}/n", b), key=q) for q, b in budgets.items())
    )
    elapsed = time.monotonic() - started
    assert [url for url, _ in results] == [server.url] * 4  # rerouted, all answered
    assert elapsed < 2.0, elapsed  # two 0.22 s misses opened the breaker; the rest released
    frozen = pool.endpoints[stopped.url]
    assert frozen.breaker.state in ("open", "half_open") and frozen.timeouts == 2
    assert frozen.inflight == 0 and not frozen.pending
    assert all(pool.home_of(q) == server.url for q in ("short0", "long0"))
    await pool.aclose()
    stopped.running.set()
    await stopped.stop()


async def test_one_stopped_worker_times_out_once_and_is_not_sent_it_again() -> None:
    stopped = await Stoppable().start()
    stopped.running.clear()
    pool = live_pool([stopped.url], breaker_threshold=5)
    started = time.monotonic()
    with pytest.raises(BackendTimeoutError, match="deadline") as err:
        await pool.json("POST", "/generate", gen_body("q/n", 5))
    assert time.monotonic() - started < 1.0 and stopped.url in err.value.endpoint
    assert stopped.attempts["/generate"] <= 1 and pool.endpoints[stopped.url].attempts == 1
    await pool.aclose()
    stopped.running.set()
    await stopped.stop()


async def test_a_worker_silent_past_stall_s_is_declared_stopped_naming_what_was_seen() -> None:
    """Issue 53: requests with long deadlines on a worker that stops (SIGSTOP as a client
    sees it, /health silent too) end within about ``stall_s`` plus a health check, not
    their deadlines, each naming the URL and that it stopped answering."""
    stopped = await Stoppable().start()
    stopped.running.clear()
    pool = live_pool([stopped.url], breaker_threshold=5, stall_s=0.45)
    started = time.monotonic()
    outs = await asyncio.gather(
        *(pool.json("POST", "/generate", gen_body(f"q{i}/n", 2000)) for i in range(4)),
        return_exceptions=True,
    )  # 2000 tokens: 20 s deadlines
    assert time.monotonic() - started < 1.5
    for out in outs:
        assert isinstance(out, BackendTimeoutError), out
        assert stopped.url in str(out) and "stopped answering" in str(out)
        assert "/health gave no answer" in str(out)
    endpoint = pool.endpoints[stopped.url]
    assert endpoint.breaker.state in ("open", "half_open") and endpoint.inflight == 0
    await asyncio.sleep(0.35)  # past the cooldown: still no request is sent as its probe
    later = time.monotonic()
    with pytest.raises(BackendError, match=r"circuit open \(the worker stopped answering"):
        await pool.json("POST", "/generate", gen_body("late/n", 2000))
    assert time.monotonic() - later < 0.5 and stopped.attempts["/generate"] == 4
    stopped.running.set()  # continued: the timed probe takes it back
    for _ in range(40):
        if endpoint.breaker.state == "closed":
            break
        await asyncio.sleep(0.05)
    assert endpoint.breaker.state == "closed" and endpoint.stopped_reason is None
    await pool.aclose()
    await stopped.stop()


async def test_a_pause_shorter_than_stall_s_loses_nothing() -> None:
    """Paused for less than ``stall_s`` and continued, a worker finishes every request:
    silence alone is not a failure, and a busy worker's answering /health is not either."""
    worker = await Stoppable().start()
    pool = live_pool([worker.url], stall_s=1.0)

    async def pause() -> None:
        await asyncio.sleep(0.6)
        worker.running.set()

    worker.running.clear()  # stopped as the requests arrive, continued 0.6 s later
    started = time.monotonic()
    outs = await asyncio.gather(
        pause(), *(pool.json("POST", "/generate", gen_body(f"q{i}/n", 2000)) for i in range(4))
    )
    assert all(url == worker.url for url, _ in outs[1:]) and time.monotonic() - started > 0.6
    assert pool.endpoints[worker.url].breaker.state == "closed"
    await pool.aclose()
    await worker.stop()


async def test_the_deadline_covers_a_stream_that_stalls(server: FakeSGLang) -> None:
    server.hang, server.token_delay_s = True, 0.05  # headers, then chunks forever
    pool = live_pool([server.url], deadline_floor_s=0.3)
    body = {**gen_body("q/n", 3), "stream": True}
    started = time.monotonic()
    with pytest.raises(BackendTimeoutError):
        async with pool.send("POST", "/generate", body) as (_, response):
            async for _line in response.aiter_lines():
                pass
    assert time.monotonic() - started < 1.5
    await asyncio.sleep(0.1)  # the server sees the disconnect and drops the request
    assert server.live == {}
    # its /health answered: a busy worker, not a failed one (issue 46)
    endpoint = pool.endpoints[server.url]
    assert endpoint.breaker.failures == 0 and endpoint.busy_misses == 1
    await pool.aclose()


async def test_an_open_breaker_is_probed_on_a_timer_without_traffic() -> None:
    worker = await Stoppable().start()
    worker.running.clear()
    pool = live_pool([worker.url], breaker_threshold=1, max_retries=0)
    with pytest.raises(BackendTimeoutError):
        await pool.json("POST", "/generate", gen_body("q/n", 1))
    breaker = pool.endpoints[worker.url].breaker
    await asyncio.sleep(0.25)  # the miss is judged by a health check (0.2 s): no answer
    assert breaker.state == "open"
    await asyncio.sleep(0.55)  # cooldown 0.3 s, probes time out at 0.2 s: still stopped
    assert breaker.opened_at is not None and worker.attempts["/health"] >= 1
    worker.running.set()  # SIGCONT
    for _ in range(40):
        if breaker.state == "closed":
            break
        await asyncio.sleep(0.05)
    assert breaker.state == "closed" and worker.attempts["/generate"] == 1  # no new traffic
    _, out = await pool.json("POST", "/generate", gen_body("q/n2", 1))
    assert out["meta_info"]["completion_tokens"] == 1
    await pool.aclose()
    await worker.stop()


async def test_a_sigstopped_process_is_routed_around_and_taken_back(
    server: FakeSGLang, tmp_path: Path
) -> None:
    """The real thing: a worker process stopped with SIGSTOP, then continued."""
    script = (
        "import asyncio\n"
        "from fake_sglang import FakeSGLang\n"
        "async def main():\n"
        "    srv = await FakeSGLang().start()\n"
        "    print(srv.url, flush=True)\n"
        "    await asyncio.Event().wait()\n"
        "asyncio.run(main())\n"
    )
    # the tests' folder on the child's path (where fake_sglang.py lives)
    path = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": path},
    )
    try:
        assert proc.stdout is not None
        url = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        pool = live_pool([url, server.url])
        assert (await pool.json("POST", "/generate", gen_body("a/n", 2), key="a"))[0] == url
        os.kill(proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        outs = await asyncio.gather(
            *(pool.json("POST", "/generate", gen_body(f"a{i}/n", 50), key="a") for i in range(4))
        )
        # deadlines count the 4 requests queued there; misses are confirmed by a failed
        # health check before the breaker opens and releases the rest (about 1.5 s)
        assert {u for u, _ in outs} == {server.url} and time.monotonic() - started < 4.0
        # Whether its breaker opened depends on whether a request reached it before the
        # deadlines routed the rest around it (a timing the test does not own); what must
        # hold is that, continued, it serves its key again.
        os.kill(proc.pid, signal.SIGCONT)
        served: set[str] = set()
        for i in range(60):  # taken back: continued, it serves again (keys spread the load)
            if pool.endpoints[url].breaker.state == "closed":
                body = gen_body(f"b{i}/m", 2)
                served.add((await pool.json("POST", "/generate", body, key=f"b{i}"))[0])
                if url in served:
                    break
            await asyncio.sleep(0.05)
        assert url in served
        await pool.aclose()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        await proc.wait()


async def test_the_api_key_goes_on_every_request() -> None:
    seen: list[tuple[str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.path == "/generate" and len(seen) == 1:
            return httpx.Response(503)  # opens the breaker: the timed probe must carry it too
        return httpx.Response(200, json={"meta_info": {"completion_tokens": 1}})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    config = HttpConfig(api_key="s3cret", breaker_threshold=1, breaker_cooldown_s=0.05,
                        backoff_base_s=0.001)  # fmt: skip
    pool = EndpointPool(["http://a", "http://b"], config, client=client, protocol=SGLANG_WIRE)
    await pool.json("POST", "/generate", gen_body("q/n", 1), key="q")
    await pool.json("GET", "/get_server_info")
    await pool.json("POST", "/abort_request", {"rid": "q"}, only="http://b")
    for _ in range(40):
        if any(path == "/health" for path, _ in seen):
            break
        await asyncio.sleep(0.02)
    assert {path for path, _ in seen} == {"/generate", "/get_server_info", "/abort_request",
                                          "/health"}  # fmt: skip
    assert all(auth == "Bearer s3cret" for _, auth in seen)
    assert "s3cret" not in repr(config)
    await pool.aclose()
    await client.aclose()


@pytest.mark.parametrize(
    ("field_name", "value"),
    [("api_key", ""), ("api_key", "a\nb"), ("deadline_floor_s", 0), ("deadline_cap_s", 0.5),
     ("deadline_slack", "2"), ("max_retries", 1.5), ("health_path", "health"),
     ("speed_weight", 2.0)],
)  # fmt: skip
def test_http_config_names_the_bad_field(field_name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field_name):
        HttpConfig(**{field_name: value})  # type: ignore[arg-type]


def test_the_factories_take_the_api_key_as_an_http_option() -> None:
    from spec_tot.adapters.openai_compat import create_openai
    from spec_tot.adapters.sglang import create_sglang

    assert create_sglang(urls=["http://a"], api_key="k1").pool.config.api_key == "k1"
    assert create_openai(urls=["http://a"], api_key="k2").pool.config.api_key == "k2"
