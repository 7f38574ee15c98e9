"""LocalBackend: async contract, abort via cancellation / prefix, non-blocking loop, PRM."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_fixtures import assert_backend_free, make_backend, tiny_llama, tiny_prm
from transformers import AutoModelForCausalLM

from spec_tot.backends import default_registry
from spec_tot.errors import BackendError
from spec_tot.requests import FinishReason, GenerateRequest, RewardItem, SamplingParams

__all__ = ["make_backend", "tiny_llama", "tiny_prm"]

torch.set_num_threads(1)

LONG = SamplingParams(temperature=1.0, seed=1, max_tokens=400)


async def _wait_steps(backend: Any, steps: int) -> None:
    start = backend.stats().get("num_steps", 0.0)
    while backend.stats().get("num_steps", 0.0) < start + steps:
        await asyncio.sleep(0.002)


async def test_generate_and_capabilities(make_backend: Any) -> None:
    backend = make_backend()
    caps = backend.capabilities
    assert caps.prefix_cache and caps.engine_dedup and caps.abort and caps.prefix_abort
    assert caps.saturation_batch == 8
    req = GenerateRequest("a", SamplingParams(temperature=0.0, max_tokens=10), prompt="hello", n=2)
    result = await backend.generate(req)
    assert len(result.completions) == 2 and result.prompt_tokens == 5
    assert result.completions[0] == result.completions[1]
    assert backend.count_tokens("hello") == 5
    stats = backend.stats()
    assert stats["peak_kv_blocks"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_cancelling_the_task_aborts_and_frees(make_backend: Any) -> None:
    backend = make_backend()
    task = asyncio.create_task(backend.generate(GenerateRequest("c", LONG, prompt="go", n=4)))
    await _wait_steps(backend, 3)
    assert backend.num_inflight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_backend_free(backend)  # freed at once, not at max_tokens


async def test_prefix_abort_mid_generation(make_backend: Any) -> None:
    backend = make_backend()
    tasks = [
        asyncio.create_task(backend.generate(GenerateRequest(rid, LONG, prompt="go")))
        for rid in ("t/1", "t/1/x", "u/1")
    ]
    await _wait_steps(backend, 3)
    assert await backend.abort("t") == 2
    for task in tasks[:2]:
        result = await task
        assert result.completions[0].finish_reason == FinishReason.ABORT
        assert 0 < result.completions[0].num_tokens < LONG.max_tokens
    assert await backend.abort("u/1") == 1
    assert (await tasks[2]).completions[0].finish_reason == FinishReason.ABORT


async def test_event_loop_not_blocked(make_backend: Any) -> None:
    backend = make_backend()
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.001)

    tick_task = asyncio.create_task(ticker())
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=64)
    start = time.perf_counter()
    await asyncio.gather(
        *(backend.generate(GenerateRequest(f"r{i}", params, prompt="abc" * 8)) for i in range(8))
    )
    elapsed = time.perf_counter() - start
    tick_task.cancel()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert len(ticks) > 10 and elapsed > 0
    assert max(gaps) < 0.25, f"event loop stalled {max(gaps):.3f}s"


async def test_registry_and_errors(make_backend: Any, tiny_llama: Path) -> None:
    backend = default_registry().create(
        "local",
        policy_path=str(tiny_llama),
        block_size=4,
        num_kv_blocks=64,
        max_model_len=128,
        max_num_batched_tokens=256,
        saturation_batch=4,
    )
    try:
        out = await backend.generate(
            GenerateRequest("x", SamplingParams(temperature=0.0, max_tokens=3), prompt="hi")
        )
        assert out.completions[0].num_tokens <= 3
        await assert_backend_free(backend)
        with pytest.raises(BackendError):
            await backend.score([RewardItem("r", "q", ("a",))])
    finally:
        await backend.aclose()
    with pytest.raises(BackendError):
        await backend.generate(GenerateRequest("y", SamplingParams(), prompt="hi"))


async def test_measured_saturation_batch(make_backend: Any) -> None:
    backend = make_backend(saturation_batch=None, max_num_seqs=8)
    assert 1 <= backend.capabilities.saturation_batch <= 8


async def test_prm_scores_match_transformers(make_backend: Any, tiny_prm: Path) -> None:
    backend = make_backend(policy_path=None, prm_path=str(tiny_prm))
    items = [
        RewardItem("a", "4 4 6 8", ("4+4=8 (left: 6 8 8)", "8/8=1 (left: 1 6)")),
        RewardItem("b", "1 2 3 4", ("1*2=2",)),
        RewardItem("c", "q", ()),
    ]
    scores = await backend.score(items)
    assert [len(s) for s in scores] == [2, 1, 0]
    assert all(0.0 <= x <= 1.0 for s in scores for x in s)
    assert backend.count_item_tokens(items[1]) == len("1 2 3 4\n1*2=2#\n")
    # reference: a plain transformers forward per item, logits at each '#'
    model = AutoModelForCausalLM.from_pretrained(tiny_prm).eval()
    tok = backend.reward_tokenizer
    good, bad = tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")
    for item, got in zip(items[:2], scores[:2], strict=True):
        text = item.question + "\n" + "".join(s + "#\n" for s in item.steps)
        ids = tok(text).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        tag = tok.convert_tokens_to_ids("#")
        want = [
            float(torch.sigmoid(logits[i, good] - logits[i, bad]))
            for i, t in enumerate(ids)
            if t == tag
        ]
        assert got == pytest.approx(want, abs=1e-5)


async def test_start_is_explicit_and_properties_are_cheap(make_backend: Any) -> None:
    """Before ``start()`` no core runs and the cheap properties say what to do; after it,
    they read what the core reported. ``start()`` twice starts one core."""
    backend = make_backend(process=False)
    assert not backend.running
    for read in (lambda: backend.policy, lambda: backend.tokenizer, lambda: backend.validator):
        with pytest.raises(BackendError, match=r"await backend\.start\(\)"):
            read()
    assert not backend.running  # reading a property started nothing
    await backend.start()
    engine = backend.engine
    await backend.start()
    assert backend.running and backend.engine is engine
    assert backend.policy is not None and backend.policy.vocab_size > 0
    assert backend.count_tokens("hello world") >= 1


async def test_capabilities_start_a_core_that_never_ran(make_backend: Any) -> None:
    """The contract reads ``capabilities`` synchronously, so it alone may start the core."""
    backend = make_backend(process=False)
    assert backend.capabilities.saturation_batch >= 1
    assert backend.running


async def test_a_chat_model_over_a_backend_starts_no_engine_until_used(make_backend: Any) -> None:
    """Building ``ChatSpecTot`` (its hub included) reads nothing from the engine; the
    first call starts it and sizes the speculation dispatcher from its calibration."""
    from spec_tot import ChatSpecTot
    from spec_tot.executor import hub_for

    backend = make_backend(process=False)
    llm = ChatSpecTot(backend=backend, max_tokens=4)
    assert not backend.running
    await llm.ainvoke("hi")
    assert backend.running
    assert hub_for(backend).dispatcher.capacity == backend.capabilities.saturation_batch
