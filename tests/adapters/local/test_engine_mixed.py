"""Mixed prefill/decode steps, chunked prompts, the two attention paths, preemption and CD:
sampled outputs are identical in every combination."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fixtures import make_engine, run_all, tiny_llama

from spec_tot.requests import GenerateRequest, Priority, SamplingParams

__all__ = ["make_engine", "tiny_llama"]

torch.set_num_threads(1)


def _workload() -> list[GenerateRequest]:
    reqs = []
    for i in range(10):
        params = SamplingParams(
            temperature=0.7 + 0.1 * (i % 3),
            top_p=0.9 if i % 4 == 0 else 1.0,
            top_k=8 if i % 5 == 0 else -1,
            max_tokens=10 + 3 * (i % 4),
            seed=100 + i,
        )
        prompt = "shared stem of every prompt, " + "x" * (i * 3) + f"{i}: "
        priority = Priority.SPECULATIVE if i % 3 == 0 else Priority.COMMITTED
        reqs.append(GenerateRequest(f"r{i}", params, prompt=prompt, n=1 + i % 3, priority=priority))
    # identical prompt and sampling but the seed: engine-level CD merges them
    same = SamplingParams(temperature=1.0, max_tokens=12)
    for j in range(3):
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=900 + j)
        assert params != same
        reqs.append(GenerateRequest(f"m{j}", params, prompt="same prompt", n=2))
    return reqs


def _run(engine: Any, staggered: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, request in enumerate(_workload()):
        engine.add_request(request)
        if staggered and i % 2:  # requests arrive while others decode
            for _ in range(3):
                out.update({r.request_id: r for r in engine.step()})
    out.update(run_all(engine))
    return {k: [c.token_ids for c in v.completions] for k, v in out.items()}


@pytest.mark.parametrize(
    "options",
    [
        {"mixed_steps": False},
        {"enable_dedup": False},
        {"attention": "gather"},
        {"attention": "sparse"},  # the default is the paged kernel
        {"max_num_batched_tokens": 9},  # prompts chunked over several steps
        {"num_kv_blocks": 24},  # preemption: speculative work evicted, recomputed
        {"enable_prefix_caching": False},
    ],
)
def test_sampled_outputs_identical(make_engine: Any, options: dict[str, Any]) -> None:
    base = _run(make_engine())
    variant = make_engine(**options)
    assert _run(variant) == base
    if "num_kv_blocks" in options:
        assert variant.scheduler.num_preemptions > 0
    if "max_num_batched_tokens" in options:
        assert variant.counters.num_mixed_steps > 0


def test_staggered_arrivals_identical(make_engine: Any) -> None:
    base = _run(make_engine())
    mixed = make_engine()
    assert _run(mixed, staggered=True) == base
    assert mixed.counters.num_mixed_steps > 0
    legacy = make_engine(mixed_steps=False)
    assert _run(legacy, staggered=True) == base
    assert legacy.counters.num_mixed_steps == 0


def test_a_new_prompt_joins_the_running_batch(make_engine: Any) -> None:
    engine = make_engine()
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    for i in range(4):
        engine.add_request(GenerateRequest(f"d{i}", params, prompt=f"decode {i}"))
    for _ in range(3):
        engine.step()
    lengths = [len(s) for s in engine.scheduler.running]
    engine.add_request(GenerateRequest("new", params, prompt="a new speculative child"))
    engine.step()
    running = engine.scheduler.running
    assert engine.counters.num_mixed_steps == 1 and len(running) == 5
    # every decode row advanced in the very step that prefilled the new prompt
    assert [len(s) for s in running[:4]] == [n + 1 for n in lengths]
    assert running[4].num_output_tokens == 1
    engine.abort_all()


@pytest.mark.parametrize("ragged", [True, False])
def test_paged_sparse_and_gather_attention_agree(
    make_engine: Any, ragged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused paged kernel, the in-place sparse decode path (ragged rows, or rows padded
    to one width) and the gather + SDPA path compute the same logits."""
    from spec_tot.adapters.local.model import step_meta as runner

    monkeypatch.setattr(runner, "RAGGED_MIN_WASTE", 0)  # ragged as soon as lengths differ
    modes = ("sparse", "gather", "paged")
    engines = [make_engine(attention=a) for a in modes]
    logits = []
    for engine in engines:
        for i in range(6):
            params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
            prompt = "p" * (3 + 5 * i) if ragged else f"prompt {i}"
            engine.add_request(GenerateRequest(f"r{i}", params, prompt=prompt))
        for _ in range(4):
            engine.step()
        plan = engine.scheduler.schedule()
        assert plan.num_decode == 6
        if engine.runner.attention == "sparse":
            meta = engine.runner.prepare(plan.rows, plan.num_decode)[0].sparse
            assert meta is not None and (meta.flat is not None) == ragged
        for row in plan.rows:
            engine.block_manager.publish(row.seq, row.end)
        tokens = list(range(len(plan.rows)))
        logits.append(engine.runner.run(plan.rows, plan.num_decode, tokens, []))
        engine.abort_all()
    assert [e.runner.attention for e in engines] == list(modes)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[2], logits[1], atol=1e-4, rtol=1e-4)
