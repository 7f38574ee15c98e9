"""CUDA-graph decode: the bucketing and the step buffer on CPU, the graphed forward (run
eagerly through the Triton interpreter) against the engine's own eager step, and on a GPU
greedy parity with and without graphs (skipped on CPU)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from attention_cases import attention_case, reference_attention
from engine_fixtures import make_engine, run_all, tiny_llama

from spec_tot.adapters.local.engine.sequence import ScheduledRow
from spec_tot.adapters.local.model.attention import GatherPagedKernel
from spec_tot.adapters.local.model.cuda_graphs import (
    GraphedDecode,
    StepBuffer,
    bucket_for,
    graph_buckets,
)
from spec_tot.adapters.local.model.triton_paged import load_triton_kernel
from spec_tot.requests import GenerateRequest, SamplingParams

__all__ = ["make_engine", "tiny_llama"]  # fixtures, imported for pytest

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_buckets_cover_every_count_up_to_the_largest() -> None:
    assert graph_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    assert graph_buckets(3) == (1, 2, 3)
    sizes = graph_buckets(512)
    assert sizes[-1] == 512 and len(sizes) == 4 + 32
    for n in range(1, 513):
        b = bucket_for(sizes, n)
        assert b is not None and n <= b and (b - n < 16)
    assert bucket_for(sizes, 513) is None
    with pytest.raises(ValueError, match="max_tokens"):
        graph_buckets(0)


@pytest.mark.parametrize(
    ("n", "heads", "kv_heads", "dim", "longest"), [(6, 4, 2, 32, 50), (3, 9, 3, 64, 20)]
)
def test_gather_kernel_matches_the_reference(
    n: int, heads: int, kv_heads: int, dim: int, longest: int
) -> None:
    """The compiler-free CUDA fallback (whole tables gathered, masked by length)."""
    q, k_pool, v_pool, tables, lengths = attention_case(n, heads, kv_heads, dim, longest, seed=n)
    got = GatherPagedKernel().attend(q, k_pool, v_pool, tables, lengths, 0.3)
    want = reference_attention(q, k_pool, v_pool, tables, lengths, 0.3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def _row(
    tokens: list[int], table: list[int], start: int, n: int, draft: tuple[int, ...] = ()
) -> Any:
    seq = SimpleNamespace(token_ids=tokens, block_table=table)
    return ScheduledRow(seq, start, n, draft)  # type: ignore[arg-type]


def test_step_buffer_packs_tokens_and_pads_onto_scratch() -> None:
    buf = StepBuffer(max_tokens=16, max_blocks=4, block_size=4, scratch_block=99, device="cpu")
    decode = _row(list(range(100, 106)), [7, 3], start=5, n=1)  # position 5: block 3, slot 13
    verify = _row(list(range(200, 203)), [9, 2, 5], start=2, n=3, draft=(301, 302))
    chunk = _row(list(range(400, 410)), [4, 8, 6], start=6, n=4)  # a prompt chunk 6..9
    buf.rows[:] = -1  # stale contents of an earlier step
    assert buf.fill([decode, verify, chunk], bucket=16) == 8
    buf.upload(16)
    d = buf.device
    assert d[:8, 0].tolist() == [105, 202, 301, 302, 406, 407, 408, 409]
    assert d[:8, 1].tolist() == [5, 2, 3, 4, 6, 7, 8, 9]
    assert d[:8, 2].tolist() == [13, 38, 39, 8, 34, 35, 24, 25]
    assert d[0, 3:5].tolist() == [7, 3] and d[1, 3:5].tolist() == [9, 2]
    assert d[3, 3:5].tolist() == [9, 2] and d[4, 3:6].tolist() == [4, 8, 6]
    # padding: token 0 at position 0, reading and writing only the scratch block
    assert d[8:, 0].eq(0).all() and d[8:, 1].eq(0).all()
    assert d[8:, 2].eq(99 * 4).all() and d[8:, 3].eq(99).all()
    with pytest.raises(ValueError, match="bucket"):
        buf.fill([verify, chunk], bucket=4)
    assert buf.fits([chunk]) and not buf.fits([_row([0] * 20, [1] * 5, start=17, n=1)])
    assert buf.fill([], bucket=4) == 0  # what capture_all records over: padding only
    assert buf.rows[:4, 2].tolist() == [99 * 4] * 4


def test_graphed_forward_matches_the_eager_step(make_engine: Any) -> None:
    """What a graph records (the forward from the step buffer, padding included) gives the
    logits the engine's eager step gives, at every step that would replay."""
    kernel, why = load_triton_kernel("cpu")  # TRITON_INTERPRET=1 (tests/conftest.py)
    assert kernel is not None, why
    engine = make_engine(token_speculation=False)
    runner = engine.runner
    graphs = GraphedDecode(runner.model, runner.cache, kernel, 24, 64)
    assert graphs.note == "" and graphs.enabled
    eager_run = runner.run
    checked: list[int] = []

    def run(rows: Any, num_decode: int, logit_tokens: Any, cow: Any) -> torch.Tensor:
        want = eager_run(rows, num_decode, logit_tokens, cow)
        bucket = graphs.bucket(rows)
        if runner._all_paged(rows, num_decode) and bucket is not None:
            tokens = graphs.buffer.fill(rows, bucket)
            graphs.buffer.upload(bucket)
            got = graphs.forward(bucket)[:tokens][list(logit_tokens)]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            checked.append(bucket - tokens)
        return want

    runner.run = run
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for i, prompt in enumerate(["hello", "abc", "a longer prompt, here", "x"]):
        engine.add_request(GenerateRequest(f"r{i}", params, prompt=prompt, n=1))
    run_all(engine)
    assert len(checked) >= 10 and any(pad > 0 for pad in checked)


def test_every_row_through_the_triton_kernel_keeps_outputs(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the Triton kernel (CUDA's), prompt chunks of any length attend through it too:
    same greedy texts and prompt logprobs as the CPU engine's own paths (C kernel for decode
    rows and short chunks, gather + SDPA for long prompts)."""
    from spec_tot.adapters.local.model import runner as runner_module

    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    prompts = ["hello there, a prompt longer than one 32-token chunk of the CPU path", "abc"]
    out = []
    for triton in (False, True):
        if triton:
            monkeypatch.setattr(
                runner_module, "load_paged_kernel", lambda: load_triton_kernel("cpu")
            )
        engine = make_engine()
        assert engine.runner._every_row_paged is triton
        for i, prompt in enumerate(prompts):
            request = GenerateRequest(f"r{i}", params, prompt=prompt, n=2, prompt_logprobs_from=1)
            engine.add_request(request)
        done = run_all(engine)
        out.append({k: r for k, r in done.items()})
    for rid, plain in out[0].items():
        other = out[1][rid]
        assert [c.text for c in plain.completions] == [c.text for c in other.completions]
        want = [lp for lp in plain.prompt_logprobs if lp is not None]
        got = [lp for lp in other.prompt_logprobs if lp is not None]
        assert len(want) == len(got) > 0
        for a, b in zip(want, got, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_drafts_keep_a_graphable_step_within_the_largest_graph(make_engine: Any) -> None:
    from spec_tot.adapters.local.engine.llm_engine import draft_budget
    from spec_tot.adapters.local.engine.scheduler import StepPlan

    engine = make_engine()
    seq = SimpleNamespace(token_ids=[0] * 64, block_table=[0] * 16)

    def plan(tokens: int) -> Any:
        return StepPlan([ScheduledRow(seq, 0, tokens)], 1)  # type: ignore[arg-type]

    cfg, full = engine.config, engine.config.max_num_batched_tokens
    assert engine.runner.graph_token_limit is None  # no graphs (CPU)
    assert draft_budget(plan(30), cfg, None) == full - 30
    assert draft_budget(plan(30), cfg, 40) == 10  # a graph of 40 tokens at most
    assert draft_budget(plan(50), cfg, 40) == full - 50  # eager anyway: the usual budget


@cuda
def test_graphs_keep_greedy_outputs(tiny_llama: Path) -> None:
    from spec_tot.adapters.local.config import EngineConfig
    from spec_tot.adapters.local.engine.llm_engine import LLMEngine

    texts = []
    for graphs in (False, True):
        engine = LLMEngine(
            EngineConfig(model=str(tiny_llama), device="cuda", dtype="float32", cuda_graphs=graphs)
        )
        params = SamplingParams(temperature=0.0, max_tokens=24)
        for i, prompt in enumerate(["hello", "abc", "a longer prompt, here", "x"]):
            engine.add_request(GenerateRequest(f"r{i}", params, prompt=prompt, n=2))
        out = run_all(engine)
        texts.append({k: [c.text for c in r.completions] for k, r in out.items()})
        if graphs:
            stats = engine.stats()
            assert stats["num_graph_steps"] > 0 and stats["num_eager_steps"] > 0  # prefills
            graphs_of = engine.runner.graphs
            assert stats["num_graphs_captured"] == len(graphs_of.buckets)  # all at start
    assert texts[0] == texts[1]
