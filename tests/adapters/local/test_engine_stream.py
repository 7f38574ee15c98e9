"""LocalBackend.stream: per-token updates, text that only grows, the final completion equal
to generate's; leaving early aborts the request and frees its blocks."""

from __future__ import annotations

import asyncio
import itertools
from contextlib import aclosing
from typing import Any

import pytest
import torch
from engine_fixtures import assert_backend_free, make_backend, tiny_llama

from spec_tot.errors import ConfigError
from spec_tot.requests import FinishReason, GenerateRequest, SamplingParams

__all__ = ["make_backend", "tiny_llama"]

torch.set_num_threads(1)


async def _collect(backend: Any, request: GenerateRequest) -> list[Any]:
    return [update async for update in backend.stream(request)]


async def test_stream_matches_generate(make_backend: Any) -> None:
    backend = make_backend()
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=24, stop=("e",), logprobs=0)
    request = GenerateRequest("s", params, prompt="Hello", n=3)
    updates = await _collect(backend, request)
    reference = await backend.generate(GenerateRequest("g", params, prompt="Hello", n=3))
    by_sample: dict[int, list[Any]] = {}
    for update in updates:
        assert update.request_id == "s"
        by_sample.setdefault(update.index, []).append(update)
    assert sorted(by_sample) == [0, 1, 2]
    for index, stream in by_sample.items():
        final = stream[-1].completion
        want = reference.completions[index]
        assert final.token_ids == want.token_ids and final.text == want.text
        assert (final.finish_reason, final.matched_stop) == (want.finish_reason, want.matched_stop)
        got_lp = [e.logprob for e in final.logprobs]  # prefix-cache hits shift the last bits
        assert got_lp == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
        assert all(not u.finished for u in stream[:-1])
        for before, after in itertools.pairwise(stream):
            assert after.text.startswith(before.text)  # text only grows
            assert len(after.token_ids) == len(before.token_ids) + 1
        assert stream[-1].text == final.text
        assert "e" not in "".join(u.text for u in stream)  # a stop string never leaks
        assert len(stream) == final.num_tokens


async def test_leaving_a_stream_aborts_it(make_backend: Any) -> None:
    backend = make_backend()
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=400, ignore_eos=True)
    seen = 0
    async with aclosing(backend.stream(GenerateRequest("long", params, prompt="go", n=2))) as s:
        async for update in s:
            seen += 1
            if seen == 5:
                assert not update.finished
                break
    await assert_backend_free(backend)


async def test_stream_of_an_aborted_request_ends_with_abort(make_backend: Any) -> None:
    backend = make_backend()
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=400, ignore_eos=True)
    updates: list[Any] = []

    async def consume() -> None:
        async for update in backend.stream(GenerateRequest("q/1", params, prompt="go")):
            updates.append(update)

    task = asyncio.create_task(consume())
    while len(updates) < 3:
        await asyncio.sleep(0.005)
    assert await backend.abort("q") == 1
    await task
    assert updates[-1].finished
    assert updates[-1].completion.finish_reason == FinishReason.ABORT


async def test_stream_rejects_bad_requests_at_once(make_backend: Any) -> None:
    backend = make_backend()
    try:
        await _collect(backend, GenerateRequest("x", SamplingParams(), prompt_ids=(10**6,)))
    except ConfigError as exc:
        assert exc.field == "prompt_ids"
    else:
        raise AssertionError("no error")
    assert backend.num_inflight == 0
