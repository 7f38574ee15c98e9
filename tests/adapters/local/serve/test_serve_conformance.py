"""Each response field of ``spec-tot serve`` pinned against SGLang's API, read in SGLang
0.5.23's source (the ``sglang-0.5.23`` wheel on PyPI):

- ``srt/entrypoints/http_server.py``: routes and methods (``/generate`` POST+PUT, ``/classify``
  POST+PUT, ``/flush_cache`` GET+POST, ``/model_info`` + ``/get_model_info``, ``/server_info``
  + ``/get_server_info``, ``/abort_request`` answering an empty 200), ``/v1/models``.
- ``srt/managers/tokenizer_manager.py`` ``_handle_batch_output``: ``{"text", "output_ids",
  "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
  "weight_version"}}``; a batch answers a list in order, streamed events carry ``index``.
- ``srt/managers/schedule_batch.py`` ``FINISH_*``: ``{"type": "stop", "matched": ...}``,
  ``{"type": "length", "length": n}``, ``{"type": "abort", "message": ...}``.
- ``srt/managers/io_struct.py`` ``GenerateReqInput._normalize_rid``: a batch with one string
  rid expands it to ``f"{rid}_{i}"``.
- ``/classify`` (``http_server.py`` ``classify_request``): the body is ``io_struct.py``
  ``EmbeddingReqInput`` (``text`` one string or a list, ``input_ids`` one list or a list of
  lists, ``rid`` one or a list, dummy ``sampling_params``); ``tokenizer_manager.py``
  ``_handle_batch_output`` answers ``{"embedding", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "weight_version", "num_retractions"}}`` (no ``completion_tokens`` or
  ``cached_tokens`` for embeddings), a batch a list in order without ``index`` (only streamed
  batches carry it: ``_stream_batch_responses``); ``EmbeddingReqInput`` sets
  ``max_new_tokens`` 0, so ``finish_reason`` is ``FINISH_LENGTH(0)``: ``{"type": "length",
  "length": 0}``.
- ``srt/entrypoints/v1_loads.py`` / ``managers/load_snapshot.py``: ``/v1/loads`` ``{"loads":
  [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}]}``.
- OpenAI API reference (and ``srt/entrypoints/openai/protocol.py``): completion and chat
  objects, chunks, usage.
"""

from __future__ import annotations

import json
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
from spec_tot.adapters.local.serve import Limits, parse_generate
from spec_tot.adapters.local.serve.live import LiveRequests
from spec_tot.errors import ConfigError

__all__ = ["tiny_llama", "tiny_prm"]

torch.set_num_threads(1)

META = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
        "weight_version"}  # fmt: skip


# One engine and server for the module; every test still ends with nothing running and
# every KV block free (``clean``).
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama: Path, tiny_prm: Path) -> AsyncIterator[tuple[LocalBackend, str]]:
    backend = create_local(policy_path=str(tiny_llama), prm_path=str(tiny_prm), saturation_batch=8)
    try:
        async with served(backend, model_path=str(tiny_llama), served_model_name="tiny") as url:
            yield backend, url
    finally:
        await backend.aclose()


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def clean(server: tuple[LocalBackend, str]) -> AsyncIterator[None]:
    yield
    await settle(server[0])


def _sample(out: dict[str, Any], rid: str) -> None:
    assert set(out) >= {"text", "output_ids", "meta_info"}
    assert isinstance(out["text"], str) and all(isinstance(t, int) for t in out["output_ids"])
    meta = out["meta_info"]
    assert set(meta) >= META and meta["id"] == rid
    assert meta["completion_tokens"] == len(out["output_ids"]) and meta["prompt_tokens"] > 0
    reason = meta["finish_reason"]
    assert reason["type"] in ("stop", "length", "abort")
    if reason["type"] == "length":
        assert reason["length"] == meta["completion_tokens"]
    if reason["type"] == "stop":
        assert "matched" in reason


async def test_generate_single_batch_and_n(server: tuple[LocalBackend, str]) -> None:
    _backend, url = server
    async with httpx.AsyncClient(timeout=60) as c:
        one = (
            await c.post(
                f"{url}/generate",
                json={"text": "1 2 3 4\n", "rid": "a", "sampling_params": {"max_new_tokens": 3}},
            )
        ).json()
        assert isinstance(one, dict)
        _sample(one, "a")
        assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        put = await c.put(f"{url}/generate", json={"input_ids": [5, 6, 7], "rid": "p"})
        assert put.status_code == 200
        _sample(put.json(), "p")
        batch = (
            await c.post(
                f"{url}/generate",
                json={
                    "text": ["1 2\n", "3 4\n"],
                    "rid": "b",
                    "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}],
                },
            )
        ).json()
        assert [o["meta_info"]["id"] for o in batch] == ["b_0", "b_1"]
        assert [o["meta_info"]["completion_tokens"] for o in batch] == [2, 3]
        many = (
            await c.post(
                f"{url}/generate",
                json={
                    "input_ids": [[5, 6], [7, 8]],
                    "rid": ["x", "y"],
                    "sampling_params": {"n": 2, "max_new_tokens": 2, "sampling_seed": 3},
                },
            )
        ).json()
        assert [o["meta_info"]["id"] for o in many] == ["x_0", "x_1", "y_0", "y_1"]
        for out, rid in zip(many, ["x_0", "x_1", "y_0", "y_1"], strict=True):
            _sample(out, rid)
        stop = (await c.post(f"{url}/generate", json={
            "text": "1 2 3 4\n", "sampling_params": {"max_new_tokens": 40, "stop": ["\n"],
                                                     "temperature": 0}})).json()  # fmt: skip
        assert stop["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        assert "\n" not in stop["text"]  # the stop string is trimmed, as SGLang does


async def test_stream_events_are_cumulative_and_end_with_done(
    server: tuple[LocalBackend, str],
) -> None:
    _backend, url = server
    body = {"text": ["1 2\n", "3 4\n"], "rid": ["s0", "s1"], "stream": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as c, c.stream("POST", f"{url}/generate",
                                                            json=body) as reply:  # fmt: skip
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [x async for x in reply.aiter_lines() if x.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(x[5:]) for x in lines[:-1]]
    seen: dict[int, str] = {}
    for e in events:
        assert e["text"].startswith(seen.get(e["index"], ""))  # cumulative text
        seen[e["index"]] = e["text"]
        assert e["meta_info"]["id"] == ["s0", "s1"][e["index"]]
    finals = [e for e in events if e["meta_info"]["finish_reason"] is not None]
    assert sorted(e["index"] for e in finals) == [0, 1]


class _RecordingBackend:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, prefix: str) -> int:
        self.aborted.append(prefix)
        return 1


async def test_abort_rules_are_sglang_0_5_23() -> None:
    """Aborting one sample of n stops only that one (ids zero-padded: ``job2_03`` is no
    prefix of ``job2_030``); the request's rid stops all of its samples; an rid that is not
    live is ignored; a live rid aborts every live rid it is a raw prefix of; ``abort_all``
    stops everything. Engine ids are private, so the engine aborts exactly those samples."""
    limits = Limits(vocab_size=128, max_len=512, max_prompt_chars=8192)
    rec = _RecordingBackend()
    live = LiveRequests(rec)  # type: ignore[arg-type]
    job = parse_generate({"text": "1", "rid": "job2", "sampling_params": {"n": 40}}, limits)
    other = parse_generate({"text": "1", "rid": "job20"}, limits)
    engine_job = live.claim(job)
    engine_other = live.claim(other)
    every = [r.request_id for r in [*engine_job, *engine_other]]
    assert live.num_running == len(every) == 41

    def stopped() -> set[str]:
        """The engine ids the recorded prefix aborts stop (the engine's prefix rule)."""
        return {e for e in every for p in rec.aborted if e == p or e.startswith(p + "/")}

    assert [s.rid for s in job.samples][:3] == ["job2_00", "job2_01", "job2_02"]
    assert await live.abort("nope") == [] and await live.abort("job") == [] and not rec.aborted
    assert await live.abort("job2_03") == ["job2_03"]
    assert stopped() == {engine_job[3].request_id}
    rec.aborted.clear()
    hit = await live.abort("job2")
    assert hit == sorted(["job2", *(f"job2_{j:02d}" for j in range(40)), "job20"])
    assert stopped() == set(every)  # SGLang's raw prefix rule: job20 too
    assert len(rec.aborted) == 2  # one engine abort per HTTP request, not one per sample
    with pytest.raises(ConfigError, match="rid"):
        live.claim(parse_generate({"text": "1", "rid": "job2_07"}, limits))
    live.release(job)
    live.release(other)
    assert live.num_running == 0 and await live.abort_all() == []


async def test_abort_request_answers_an_empty_200(server: tuple[LocalBackend, str]) -> None:
    _backend, url = server
    async with httpx.AsyncClient(timeout=60) as c:
        for body in ({"rid": "not-live"}, {"abort_all": True}):
            reply = await c.post(f"{url}/abort_request", json=body)
            assert reply.status_code == 200 and reply.content == b""
        bad = await c.post(f"{url}/abort_request", json={"rid": 5})
        assert bad.status_code == 400 and "rid" in bad.json()["error"]["message"]


async def test_info_routes(server: tuple[LocalBackend, str]) -> None:
    _backend, url = server
    async with httpx.AsyncClient(timeout=60) as c:
        for path in ("/model_info", "/get_model_info"):
            info = (await c.get(url + path)).json()
            assert info["model_path"].endswith("tiny_llama") or info["model_path"]
            assert info["is_generation"] is True and info["served_model_name"] == "tiny"
        for path in ("/server_info", "/get_server_info"):
            info = (await c.get(url + path)).json()
            for key in ("max_running_requests", "max_total_num_tokens",
                        "enable_priority_scheduling", "schedule_low_priority_values_first",
                        "num_running_reqs", "num_waiting_reqs", "kv_blocks_total",
                        "kv_blocks_free", "internal_states", "version"):  # fmt: skip
                assert key in info, key
            assert info["kv_blocks_free"] == info["kv_blocks_total"]
        loads = (await c.get(f"{url}/v1/loads?include=core")).json()["loads"]
        assert loads[0]["dp_rank"] == 0 and loads[0]["num_running_reqs"] == 0
        metrics = (await c.get(f"{url}/metrics")).text
        assert "sglang:num_running_reqs" in metrics and "sglang:num_queue_reqs" in metrics
        for method in ("GET", "POST"):
            assert (await c.request(method, f"{url}/flush_cache")).status_code == 200
        assert (await c.get(f"{url}/health")).status_code == 200
        models = (await c.get(f"{url}/v1/models")).json()
        assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
        missing = await c.get(f"{url}/v1/models/other")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


async def test_openai_objects(server: tuple[LocalBackend, str]) -> None:
    _backend, url = server
    async with httpx.AsyncClient(timeout=60) as c:
        done = (
            await c.post(
                f"{url}/v1/completions",
                json={"model": "tiny", "prompt": ["1 2\n", "3 4\n"], "n": 2, "max_tokens": 3},
            )
        ).json()
        assert done["object"] == "text_completion" and done["id"].startswith("cmpl-")
        assert [ch["index"] for ch in done["choices"]] == [0, 1, 2, 3]
        assert all(ch["finish_reason"] == "length" for ch in done["choices"])
        usage = done["usage"]
        assert usage["completion_tokens"] == 12
        assert usage["total_tokens"] == usage["prompt_tokens"] + 12
        chat = (await c.post(f"{url}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 2})).json()  # fmt: skip
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"]["role"] == "assistant"
        body = {"model": "tiny", "prompt": "1 2\n", "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with c.stream("POST", f"{url}/v1/completions", json=body) as reply:
            lines = [x async for x in reply.aiter_lines() if x.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[5:]) for x in lines[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        text = "".join(ch["choices"][0]["text"] for ch in chunks[:-1])
        plain = (
            await c.post(
                f"{url}/v1/completions",
                json={"model": "tiny", "prompt": "1 2\n", "max_tokens": 3, "temperature": 0},
            )
        ).json()
        greedy = {**body, "temperature": 0}
        async with c.stream("POST", f"{url}/v1/completions", json=greedy) as reply:
            lines = [x async for x in reply.aiter_lines() if x.startswith("data:")]
        streamed = "".join(json.loads(x[5:])["choices"][0]["text"] for x in lines[:-2])
        assert streamed == plain["choices"][0]["text"] and isinstance(text, str)


async def test_logprobs_prefill_only_and_min_tokens(server: tuple[LocalBackend, str]) -> None:
    _backend, url = server
    async with httpx.AsyncClient(timeout=60) as c:
        out = (await c.post(f"{url}/generate", json={
            "input_ids": [5, 6, 7, 8], "return_logprob": True, "top_logprobs_num": 2,
            "token_ids_logprob": [9, 10], "logprob_start_len": 0, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 3, "min_new_tokens": 3, "ignore_eos": True,
                                "temperature": 0}})).json()  # fmt: skip
        meta = out["meta_info"]
        assert meta["completion_tokens"] == 3 and meta["output_token_logprobs_length"] == 3
        for lp, tok, text in meta["output_token_logprobs"]:
            assert lp <= 0 and isinstance(tok, int) and isinstance(text, str)
        assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])
        assert [[e[1] for e in g] for g in meta["output_token_ids_logprobs"]] == [[9, 10]] * 3
        assert len(meta["input_token_logprobs"]) == 4
        assert meta["input_token_logprobs"][0][0] is None  # the first prompt token has none
        prefill = (
            await c.post(
                f"{url}/generate",
                json={"text": "1 2 3 4\n", "sampling_params": {"max_new_tokens": 0}},
            )
        ).json()
        assert prefill["text"] == "" and prefill["output_ids"] == []
        assert prefill["meta_info"]["completion_tokens"] == 0


async def test_openai_completions_take_ignore_eos_and_min_tokens(
    server: tuple[LocalBackend, str],
) -> None:
    """vLLM's and SGLang's /v1/completions take both (serving benchmarks send them); ours
    refused them as not implemented (issue 48). With the prompt's own EOS id as a stop token,
    min_tokens holds it off, and ignore_eos runs to max_tokens."""
    _backend, url = server
    base = {"model": "tiny", "prompt": "1 2\n", "max_tokens": 5, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as c:
        body = {**base, "ignore_eos": True, "min_tokens": 5}
        both = (await c.post(f"{url}/v1/completions", json=body)).json()
        assert both["usage"]["completion_tokens"] == 5
        assert both["choices"][0]["finish_reason"] == "length"
        bad = await c.post(f"{url}/v1/completions", json={**base, "min_tokens": 9})
        assert bad.status_code == 400 and "min_tokens" in bad.text
        assert "max_new_tokens" not in bad.text  # OpenAI's names, not SGLang's
        bad = await c.post(f"{url}/v1/completions", json={**base, "ignore_eos": "yes"})
        assert bad.status_code == 400 and "ignore_eos" in bad.text


CLASSIFY_META = {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"}


async def test_classify_scores_any_text_or_token_ids(server: tuple[LocalBackend, str]) -> None:
    backend, url = server
    prm = backend.reward
    assert prm is not None
    raw = "Is 9 + 4 more than 12? Yes."  # one line, no step tag: scored with the tag appended
    tagged = "Q: 2 2 6 6#\n2*6=12 (left: 2 6 12)#"  # already tagged: scored as given
    ids = backend.reward_tokenizer(raw)["input_ids"]
    want = await backend.classify([raw, tagged])
    async with httpx.AsyncClient(timeout=60) as c:
        one = (await c.post(f"{url}/classify", json={"text": raw, "rid": "r1"})).json()
        assert set(one) == {"embedding", "meta_info"} and set(one["meta_info"]) == CLASSIFY_META
        assert one["meta_info"]["id"] == "r1"
        assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert one["meta_info"]["prompt_tokens"] == len(ids) + len(prm.tag_ids)
        assert one["embedding"] == [pytest.approx(want[0], abs=1e-6)]
        batch = (await c.put(f"{url}/classify", json={"text": [raw, tagged], "rid": "b",
                                                       "sampling_params": {}})).json()  # fmt: skip
        assert isinstance(batch, list)
        assert [set(r) for r in batch] == [{"embedding", "meta_info"}] * 2
        assert [r["meta_info"]["id"] for r in batch] == ["b_0", "b_1"]  # as /generate's rule
        assert [r["embedding"][0] for r in batch] == pytest.approx(want, abs=1e-6)
        # The same tokens as input_ids, with or without the tag's ids: the same reward.
        by_ids = (await c.post(f"{url}/classify", json={"input_ids": [ids, ids + list(prm.tag_ids)],
                                                         "rid": ["x", "y"]})).json()  # fmt: skip
        assert [r["meta_info"]["id"] for r in by_ids] == ["x", "y"]
        assert [r["embedding"][0] for r in by_ids] == pytest.approx([want[0]] * 2, abs=1e-6)
        single_ids = (await c.post(f"{url}/classify", json={"input_ids": ids})).json()
        assert isinstance(single_ids, dict)
        assert single_ids["meta_info"]["prompt_tokens"] == len(ids) + len(prm.tag_ids)
        assert single_ids["embedding"][0] == pytest.approx(want[0], abs=1e-6)
