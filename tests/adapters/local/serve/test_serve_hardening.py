"""``spec-tot serve`` under hostile or careless input: a bad request among good ones fails
alone with a 4xx naming the field (the poison test), a hypothesis fuzz suite over
``/generate``, ``/classify``, ``/v1/completions``, ``/v1/chat/completions`` and
``/abort_request`` bodies whose text holds arbitrary code points, lone surrogates included
(no 5xx, ``/health`` after every case, no KV block leaked), and ``--api-key`` on every
route."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import torch
from engine_fixtures import assert_backend_free, tiny_llama, tiny_prm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import served, settle

from spec_tot.adapters.local import LocalBackend, create_local

__all__ = ["tiny_llama", "tiny_prm"]

torch.set_num_threads(1)


JSON_TYPE = {"content-type": "application/json"}  # JSON routes require it


# One engine for the module's async tests (the fuzz suite has its own server in a thread);
# every test still ends with nothing running and every KV block free (``clean``).
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama: Path, tiny_prm: Path) -> AsyncIterator[tuple[LocalBackend, str]]:
    backend = create_local(
        policy_path=str(tiny_llama), prm_path=str(tiny_prm), saturation_batch=8, max_model_len=256
    )
    try:
        async with served(backend, model_path=str(tiny_llama), served_model_name="tiny") as url:
            yield backend, url
    finally:
        await backend.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def clean(server: tuple[LocalBackend, str]) -> AsyncIterator[tuple[LocalBackend, str]]:
    yield server
    await settle(server[0])


def good(i: int) -> dict[str, Any]:
    # Greedy: a sample must not depend on which other requests share its batch, so any
    # difference is the bad request's doing, not float noise from another batch shape.
    return {
        "text": f"{i} 2 {i % 7} 4\n",
        "rid": f"good-{i}",
        "sampling_params": {"temperature": 0, "max_new_tokens": 24},
    }


# Each bad kind of issue 13, and the field its 400 must name.
BAD: list[tuple[str, Any, str]] = [
    ("token id outside the vocabulary", {"input_ids": [5, 999_999]}, "input_ids[1]"),
    ("empty input_ids", {"input_ids": []}, "input_ids"),
    ("1 MB prompt", {"text": "x" * 1_000_000}, "text"),
    ("non-string stop", {"text": "1 2", "sampling_params": {"stop": [1]}}, "stop[0]"),
    ("huge max_new_tokens", {"text": "1", "sampling_params": {"max_new_tokens": 1e999}},
     "max_new_tokens"),
    ("float max_new_tokens", {"text": "1", "sampling_params": {"max_new_tokens": 1.5}},
     "max_new_tokens"),
    ("unknown sampling key", {"text": "1", "sampling_params": {"temprature": 0}}, "temprature"),
    ("unimplemented regex", {"text": "1", "sampling_params": {"regex": "a+"}}, "regex"),
    ("bad top_p", {"text": "1", "sampling_params": {"top_p": 2}}, "top_p"),
    ("string seed", {"text": "1", "sampling_params": {"sampling_seed": "x"}}, "sampling_seed"),
    ("stop token outside the vocabulary", {"text": "1", "sampling_params":
                                           {"stop_token_ids": [10**9]}}, "stop_token_ids[0]"),
    ("a JSON list body", [1, 2], "body"),
]  # fmt: skip


@pytest.mark.asyncio(loop_scope="module")
async def test_poison_one_bad_request_fails_alone(clean: tuple[LocalBackend, str]) -> None:
    backend, url = clean
    async with httpx.AsyncClient(timeout=120) as client:
        alone = [(await client.post(f"{url}/generate", json=good(i))).json() for i in range(16)]
        for name, bad, field in BAD:
            replies = await asyncio.gather(
                *(client.post(f"{url}/generate", json=good(i)) for i in range(8)),
                client.post(f"{url}/generate", content=_raw(bad), headers=JSON_TYPE),
                *(client.post(f"{url}/generate", json=good(i)) for i in range(8, 16)),
            )
            bad_reply = replies[8]
            assert bad_reply.status_code == 400, (name, bad_reply.text)
            assert field in bad_reply.json()["error"]["message"], (name, bad_reply.text)
            together = [r.json() for r in replies[:8] + replies[9:]]
            assert [r["text"] for r in together] == [r["text"] for r in alone], name
            assert [r["output_ids"] for r in together] == [r["output_ids"] for r in alone], name
        for raw in (b"{not json", b"", b"[1,"):  # malformed bodies on every POST route
            for path in ("/generate", "/abort_request", "/classify", "/v1/completions"):
                reply = await client.post(f"{url}{path}", content=raw, headers=JSON_TYPE)
                assert reply.status_code == 400 and "body" in reply.text, (path, raw)
    await assert_backend_free(backend)


@pytest.mark.asyncio(loop_scope="module")
async def test_classify_refuses_what_the_prm_cannot_hold(
    clean: tuple[LocalBackend, str],
) -> None:
    """Every length is checked before tokenising or allocating (a 1 MB text once tried to
    allocate ~1 TB for an attention mask); each refusal is a 400 naming the field."""
    backend, url = clean
    assert backend.reward is not None
    fits = backend.reward.max_len - len(backend.reward.tag_ids)
    async with httpx.AsyncClient(timeout=60) as client:
        for body, field in (
            ({"text": "q\n" + "1+2=3\n" * 200_000}, "text"),  # over the character cap
            ({"text": "q\n" + "1+2=3 (left: 3 3 4)\n" * 40}, "text"),  # > 512 PRM positions
            ({"text": ["ok", "q\n" + "1+2=3 (left: 3 3 4)\n" * 40]}, "text[1]"),
            ({"text": "x" * 600}, "text"),  # one line: fits the character cap, not the model
            ({"text": ["q\nstep", 3]}, "text[1]"),
            ({"text": [["query", "doc"]]}, "text[0]"),  # cross-encoder pairs: not served
            ({"text": ""}, "text"),
            ({"text": []}, "text"),
            ({"text": ["a"] * 5000}, "text"),
            ({"text": "a", "input_ids": [5]}, "text"),
            ({"input_ids": [5] * (fits + 1)}, "input_ids"),
            ({"input_ids": [[5], [5] * (fits + 1)]}, "input_ids[1]"),
            ({"input_ids": [5, 999_999]}, "input_ids[1]"),
            ({"input_ids": [[5], [-1]]}, "input_ids[1][0]"),
            ({"input_ids": []}, "input_ids"),
            ({"input_ids": "5 6"}, "input_ids"),
            ({"input_ids": 1}, "input_ids"),  # found by the fuzz suite: was a 500
            ({"input_ids": {"0": [5]}}, "input_ids"),
            ({"text": "a", "sampling_params": 3}, "sampling_params"),
            ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
            ({"text": ["a", "b"], "rid": ["r", "r"]}, "rid"),
            ({"text": "a", "image_data": "x.png"}, "image_data"),
            ({"text": "a", "priority": "high"}, "priority"),
            ({"txt": "q\nstep"}, "txt"),
        ):
            reply = await client.post(f"{url}/classify", json=body)
            assert reply.status_code == 400, (field, reply.text)
            assert field in reply.json()["error"]["message"], (field, reply.text)
        ok = await client.post(f"{url}/classify", json={"input_ids": [5] * fits})
        assert ok.status_code == 200, ok.text  # the longest that fits is scored


@pytest.mark.asyncio(loop_scope="module")
async def test_api_key_on_every_route(clean: tuple[LocalBackend, str]) -> None:
    backend, _open_url = clean  # the same engine behind a second server that has a key
    routes = [
        ("GET", "/health", None),
        ("GET", "/health_generate", None),
        ("POST", "/generate", {"text": "1", "sampling_params": {"max_new_tokens": 2}}),
        ("PUT", "/generate", {"text": "1", "sampling_params": {"max_new_tokens": 2}}),
        ("POST", "/abort_request", {"abort_all": True}),
        ("POST", "/abort_request", {"rid": "x"}),
        ("POST", "/classify", {"text": "1 2 3 4\n1+2=3"}),
        ("GET", "/model_info", None),
        ("GET", "/get_model_info", None),
        ("GET", "/server_info", None),
        ("GET", "/get_server_info", None),
        ("POST", "/flush_cache", None),
        ("GET", "/flush_cache", None),
        ("GET", "/v1/loads", None),
        ("GET", "/metrics", None),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/tiny", None),
        ("POST", "/v1/completions", {"model": "tiny", "prompt": "1", "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user",
                                                                         "content": "1"}]}),
        ("GET", "/no/such/route", None),
    ]  # fmt: skip
    async with (
        served(backend, served_model_name="tiny", api_key="s3cret") as url,
        httpx.AsyncClient(timeout=60) as client,
    ):
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                reply = await client.request(method, url + path, json=body, headers=headers)
                assert reply.status_code == 401, (method, path, headers)
                assert "Bearer" in reply.json()["error"]["message"]
            ok = await client.request(
                method, url + path, json=body, headers={"Authorization": "Bearer s3cret"}
            )
            assert ok.status_code == (404 if path == "/no/such/route" else 200), (path, ok.text)


def _raw(body: Any) -> str:
    """JSON as a careless client writes it: ``1e999`` stays a literal (httpx refuses inf)."""
    return json.dumps(body).replace("Infinity", "1e999")


# -- the fuzz suite ---------------------------------------------------------------------------
# Any code point: every category, and the surrogates (UTF-8 cannot encode them; a JSON
# "\\udcff" escape makes one) drawn as often as the rest.
_char = st.characters(categories=["L", "M", "N", "P", "S", "Z", "C"]) | st.characters(
    min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"]
)


def _text(max_size: int) -> st.SearchStrategy[str]:
    return st.text(_char, max_size=max_size) | st.text(max_size=max_size)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | _text(8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text(6), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
_value = st.one_of(
    _json,
    st.integers(-5, 200),
    st.sampled_from(
        [0, 1, -1, 0.5, 1e999, "", "a", [], {}, [1, 2], ["\n"], [[1, 2], [3]], "\udcff", ["\ud800"]]
    ),
)
_sampling = st.dictionaries(
    st.sampled_from(["max_new_tokens", "temperature", "top_p", "top_k", "stop", "n",
                     "stop_token_ids", "sampling_seed", "regex", "min_p", "ignore_eos", "bogus"]),
    _value,
    max_size=4,
)  # fmt: skip
_generate = st.fixed_dictionaries(
    {},
    optional={
        "text": st.one_of(_text(12), st.lists(_text(6), max_size=3), _value),
        "input_ids": st.one_of(st.lists(st.integers(-3, 140), max_size=6), _value),
        "sampling_params": st.one_of(_sampling, st.lists(_sampling, max_size=2), _value),
        "rid": st.one_of(_text(5), _value),
        "stream": _value,
        "priority": _value,
        "return_logprob": _value,
    },
)
_classify = st.fixed_dictionaries(
    {},
    optional={
        "text": st.one_of(_text(30), st.lists(_text(20), max_size=3), _value),
        "input_ids": st.one_of(st.lists(st.integers(-3, 140), max_size=6),
                               st.lists(st.lists(st.integers(-3, 140), max_size=4), max_size=3),
                               _value),
        "rid": st.one_of(_text(5), _value),
        "sampling_params": _value,
    },
)  # fmt: skip
_openai_common = {
    "n": _value,
    "max_tokens": st.one_of(st.integers(-1, 6), _value),
    "stop": st.one_of(_text(3), st.lists(_text(3), max_size=2), _value),
    "temperature": _value,
    "stream": _value,
    "seed": _value,
}
_completions = st.fixed_dictionaries(
    {"model": st.sampled_from(["default", "nope"]) | _value},
    optional={
        "prompt": st.one_of(_text(12), st.lists(_text(6), max_size=3),
                            st.lists(st.integers(-3, 140), max_size=6), _value),
        **_openai_common,
    },
)  # fmt: skip
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | _text(4)},
    optional={"content": st.one_of(_text(12), st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": _text(6)}), max_size=2), _value)},
)  # fmt: skip
_chat = st.fixed_dictionaries(
    {"model": st.just("default")},
    optional={"messages": st.one_of(st.lists(_message, max_size=3), _value), **_openai_common},
)
_abort = st.fixed_dictionaries({}, optional={"rid": _value, "abort_all": _value})
_bodies = st.one_of(
    st.tuples(st.just("/generate"), _generate),
    st.tuples(st.just("/classify"), _classify),
    st.tuples(st.just("/v1/completions"), _completions),
    st.tuples(st.just("/v1/chat/completions"), _chat),
    st.tuples(st.just("/abort_request"), _abort),
    st.tuples(st.sampled_from(["/generate", "/classify", "/abort_request", "/v1/completions",
                               "/v1/chat/completions"]), _json),
)  # fmt: skip


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=_bodies)
def test_fuzz_never_a_5xx_and_nothing_leaks(fuzz_server: tuple[Any, str], case: Any) -> None:
    loop, url = fuzz_server
    path, body = case

    async def one() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            raw = _raw(body)
            reply = await client.post(url + path, content=raw, headers=JSON_TYPE)
            assert reply.status_code < 500, (path, raw, reply.text)
            if reply.status_code >= 400:
                assert reply.json()["error"]["message"]
            assert (await client.get(url + "/health")).status_code == 200

    asyncio.run_coroutine_threadsafe(one(), loop).result(120)


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama: Path, tiny_prm: Path) -> Any:
    """One server for every fuzz case (its own loop in a thread); on exit no request is live
    and every KV block is free."""
    import threading

    loop = asyncio.new_event_loop()
    box: dict[str, Any] = {}
    started = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        backend = create_local(
            policy_path=str(tiny_llama), prm_path=str(tiny_prm), saturation_batch=8,
            max_model_len=256,
        )  # fmt: skip
        try:
            async with served(backend) as url:
                box["url"] = url
                started.set()
                await stop.wait()
        finally:
            await backend.aclose()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    started.wait(120)
    yield loop, box["url"]
    loop.call_soon_threadsafe(stop.set)
    thread.join(60)
