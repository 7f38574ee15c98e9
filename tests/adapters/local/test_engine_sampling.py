"""Sampler and CD (computation dedup): same seeds, same outputs, right distribution."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fixtures import make_engine, run_all, tiny_llama
from scipy.stats import chisquare

from spec_tot.adapters.local.engine.sampler import Sampler
from spec_tot.adapters.local.engine.sequence import Member, RequestState, Sequence
from spec_tot.requests import GenerateRequest, Priority, SamplingParams
from spec_tot.seeds import seed_mix

__all__ = ["make_engine", "tiny_llama"]

torch.set_num_threads(1)

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def _generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed_mix(seed, i)) for i in range(n)]


def _seq(params: SamplingParams, generators: list[torch.Generator | None]) -> Sequence:
    """A one-token sequence whose members draw from ``generators``."""
    state = RequestState("r", params, (1,), Priority.COMMITTED, [None] * len(generators))
    members = [Member(state, i, g) for i, g in enumerate(generators)]
    return Sequence(1, [1], 1, params, Priority.COMMITTED, 1, members)


def _expected(params: SamplingParams) -> torch.Tensor:
    probs = torch.softmax(LOGITS / params.temperature, dim=-1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    order = probs.argsort(descending=True)
    k = len(probs) if params.top_k == -1 else params.top_k
    mass = 0.0
    for rank, tok in enumerate(order.tolist()):
        if rank >= k or mass >= params.top_p * float(probs[order[:k]].sum()):
            break
        keep[tok] = True
        mass += float(probs[tok])
    probs = probs * keep
    return probs / probs.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
)
def test_cd_draws_match_independent_sampling(params: SamplingParams) -> None:
    """m members sharing one row (CD) draw exactly what m independent rows draw, and their
    histogram fits the model distribution (chi-square)."""
    m, sampler = 6000, Sampler(frozenset())
    shared = sampler.sample(LOGITS[None].clone(), [_seq(params, _generators(5, m))])[0][0]
    gens = _generators(5, m)
    rows = LOGITS.expand(m, -1).clone()
    independent = sampler.sample(rows, [_seq(params, [g]) for g in gens])[0]
    assert shared == [r[0] for r in independent]
    expected = _expected(params)
    counts = torch.bincount(torch.tensor(shared), minlength=len(LOGITS)).float()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled outside the top-k/top-p support"
    stat = chisquare(counts[support].numpy(), (expected[support] * m).numpy())
    assert stat.pvalue > 1e-3


def test_greedy_is_argmax_and_draws_nothing() -> None:
    seq = _seq(SamplingParams(temperature=0.0), [None, None, None])
    out, logprobs = Sampler(frozenset()).sample(LOGITS[None].clone(), [seq])
    assert out == [[0, 0, 0]] and logprobs == [None]
    assert all(m.cursor == 0 and not m.uniforms for m in seq.members)


def test_block_draws_equal_one_draw_per_token() -> None:
    """A member's uniforms come in blocks from its generator: the very stream of one
    ``torch.rand(1)`` per token (so outputs match engines that drew one at a time)."""
    seq = _seq(SamplingParams(temperature=1.0), _generators(3, 1))
    drawn = [seq.members[0].next_uniform() for _ in range(70)]
    gen = _generators(3, 1)[0]
    assert drawn == [float(torch.rand(1, generator=gen)) for _ in range(70)]


def _run(engine: Any, requests: list[GenerateRequest]) -> dict[str, list[tuple[int, ...]]]:
    for request in requests:
        engine.add_request(request)
    return {k: [c.token_ids for c in v.completions] for k, v in run_all(engine).items()}


def test_cd_on_off_identical_outputs(make_engine: Any) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=123)
    reqs = [
        GenerateRequest("a", params, prompt="Solve 4 4 6 8:", n=8),
        GenerateRequest(
            "b", SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=9), prompt="Hi", n=5
        ),
    ]
    on, off = make_engine(enable_dedup=True), make_engine(enable_dedup=False)
    assert _run(on, reqs) == _run(off, reqs)
    assert on.num_forks > 0 and off.num_forks == 0
    # CD really saved forward rows: fewer rows computed than logical tokens produced
    assert on.counters.num_forward_rows < on.num_generated_tokens
    assert off.counters.num_forward_rows == off.num_generated_tokens


def test_identical_pending_requests_merge(make_engine: Any) -> None:
    """Requests with identical prompt and sampling except seed share one physical sequence."""
    reqs = [
        GenerateRequest(
            f"q{i}",
            SamplingParams(temperature=1.0, max_tokens=12, seed=i),
            prompt="Same prompt",
            n=2,
        )
        for i in range(3)
    ]
    on, off = make_engine(enable_dedup=True), make_engine(enable_dedup=False)
    assert _run(on, reqs) == _run(off, reqs)
    assert on.stats()["num_merged_requests"] == 2


def test_seeded_requests_reproduce(make_engine: Any) -> None:
    req = GenerateRequest(
        "a", SamplingParams(temperature=1.0, max_tokens=16, seed=4), prompt="x", n=3
    )
    assert _run(make_engine(), [req]) == _run(make_engine(), [req])
