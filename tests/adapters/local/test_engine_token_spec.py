"""Token-level speculative decoding: outputs identical with and without it (greedy and
seeded sampling, dedup forks, preemption, chunked prompts, abort mid-draft, prefix caching,
logprobs), the sampled distribution kept, the same seed giving the same output, and KV
blocks all free afterwards."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from engine_fixtures import VOCAB_SIZE, make_backend, make_engine, run_all, tiny_llama
from scipy.stats import chi2_contingency, chisquare
from spec_drafters import OracleDrafter, WrongDrafter, use_drafters

from spec_tot.requests import FinishReason, GenerateRequest, Priority, SamplingParams

__all__ = ["make_backend", "make_engine", "tiny_llama"]

torch.set_num_threads(1)


def _workload(greedy: bool) -> list[GenerateRequest]:
    reqs = []
    for i in range(10):
        params = SamplingParams(
            temperature=0.0 if greedy else 0.7 + 0.1 * (i % 3),
            top_p=0.9 if i % 4 == 0 and not greedy else 1.0,
            top_k=8 if i % 5 == 0 and not greedy else -1,
            max_tokens=12 + 3 * (i % 4),
            min_tokens=2 if i == 7 else 0,
            stop=(" e",) if i == 4 else (),
            seed=100 + i,
        )
        prompt = "shared stem of every prompt, " + "x" * (i * 3) + f"{i}: "
        priority = Priority.SPECULATIVE if i % 3 == 0 else Priority.COMMITTED
        reqs.append(GenerateRequest(f"r{i}", params, prompt=prompt, n=1 + i % 3, priority=priority))
    for j in range(3):  # identical but the seed: merged (CD), members fork as they diverge
        params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=14, seed=900 + j)
        reqs.append(GenerateRequest(f"m{j}", params, prompt="same prompt", n=2))
    return reqs


def _outputs(results: dict[str, Any]) -> dict[str, Any]:
    return {
        k: [(c.token_ids, c.text, c.finish_reason) for c in v.completions]
        for k, v in results.items()
    }


def _run(engine: Any, reqs: list[GenerateRequest]) -> dict[str, Any]:
    for request in reqs:
        engine.add_request(request)
    return _outputs(run_all(engine))


def _references(engine: Any, reqs: list[GenerateRequest]) -> tuple[dict[str, Any], list[Any]]:
    """Outputs without token speculation, and every sample as prompt + output ids."""
    for request in reqs:
        engine.add_request(request)
    results = run_all(engine)
    refs = []
    for request in reqs:
        prompt = engine.encode(request.prompt)
        refs.extend(prompt + list(c.token_ids) for c in results[request.request_id].completions)
    return _outputs(results), refs


def _assert_drafted(engine: Any) -> None:
    st = engine.stats()
    assert st["num_accepted_tokens"] > 0, "no drafted token was accepted"
    assert st["num_draft_tokens"] > st["num_accepted_tokens"], "no drafted token was rejected"


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 9},  # prompts chunked; drafts share the token budget
        {"num_kv_blocks": 24},  # preemption: speculative work evicted, recomputed
        {"attention": "gather"},
        {"enable_prefix_caching": False},
    ],
)
def test_outputs_identical_with_and_without(
    make_engine: Any, greedy: bool, options: dict[str, Any]
) -> None:
    """Greedy and seeded sampling alike: the acceptance rule uses each member's own
    uniforms, one per emitted token, so speculation changes no token (CD forks included)."""
    reqs = _workload(greedy)
    base, refs = _references(make_engine(token_speculation=False), reqs)
    spec = use_drafters(make_engine(**options), OracleDrafter(refs, VOCAB_SIZE))
    assert _run(spec, reqs) == base
    _assert_drafted(spec)
    if "num_kv_blocks" in options:
        assert spec.scheduler.num_preemptions > 0
    if "max_num_batched_tokens" in options:
        assert spec.counters.num_mixed_steps > 0
    if not greedy:
        assert spec.num_forks > 0


def test_forks_inside_a_verify_row(make_engine: Any) -> None:
    """Members of one deduped sequence leave the draft at different positions: each forks
    where its own draw departs, and keeps its own stream."""
    req = GenerateRequest(
        "f", SamplingParams(temperature=1.2, max_tokens=16, seed=3), prompt="fork here", n=12
    )
    base, refs = _references(make_engine(token_speculation=False), [req])
    spec = use_drafters(make_engine(), OracleDrafter(refs, VOCAB_SIZE, wrong_every=0))
    spec.add_request(req)
    spec.step()  # the prompt: every member draws its first token; they split
    forks_before = spec.num_forks
    out = _outputs(run_all(spec))
    assert out == base
    assert spec.num_forks > forks_before
    _assert_drafted_some(spec)


def _assert_drafted_some(engine: Any) -> None:
    assert engine.stats()["num_accepted_tokens"] > 0


def test_abort_mid_draft_frees_everything(make_engine: Any) -> None:
    """Abort a request right after a step that verified drafts for it: its blocks are freed
    at once, its partial output is a prefix of the reference, the others are unchanged."""
    reqs = _workload(greedy=False)
    base, refs = _references(make_engine(token_speculation=False), reqs)
    spec = use_drafters(make_engine(), OracleDrafter(refs, VOCAB_SIZE))
    for request in reqs:
        spec.add_request(request)
    results: dict[str, Any] = {}
    victim = "r2"
    while spec.stats()["num_verify_rows"] == 0 or victim not in spec.requests:
        for r in spec.step():
            results[r.request_id] = r
        assert victim in spec.requests, "the victim finished before any draft was verified"
    used = spec.block_manager.num_used_blocks
    (aborted,) = spec.abort(victim)
    assert spec.block_manager.num_used_blocks < used
    for got, want in zip(aborted.completions, base[victim], strict=True):
        assert got.finish_reason == FinishReason.ABORT
        assert want[0][: len(got.token_ids)] == got.token_ids
    results.update(run_all(spec))
    out = _outputs(results)
    assert victim not in out
    assert out == {k: v for k, v in base.items() if k != victim}


def test_prefix_cache_hits_with_drafts(make_engine: Any) -> None:
    """Blocks filled by accepted drafts are published; a later prompt that repeats them
    hits the cache, and outputs stay those of plain decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = GenerateRequest("a", params, prompt="The cache holds this prompt and then")
    base, refs = _references(make_engine(token_speculation=False), [first])
    spec = use_drafters(make_engine(), OracleDrafter(refs, VOCAB_SIZE, wrong_every=0))
    assert _run(spec, [first]) == base
    assert spec.stats()["num_accepted_tokens"] >= 16  # several blocks came from drafts
    again = GenerateRequest("b", params, prompt_ids=tuple(refs[0][:-2]))
    hits = spec.block_manager.num_prefix_hit_blocks
    reference = make_engine(token_speculation=False)
    assert _run(spec, [again]) == _run(reference, [again])
    assert spec.block_manager.num_prefix_hit_blocks - hits >= len(refs[0]) // 4 - 1


def test_logprobs_match(make_engine: Any) -> None:
    params = SamplingParams(temperature=0.9, max_tokens=14, seed=11, logprobs=3)
    req = GenerateRequest("lp", params, prompt="logprobs of every position", n=3)
    plain = make_engine(token_speculation=False)
    plain.add_request(req)
    want = run_all(plain)["lp"]
    refs = [plain.encode(req.prompt) + list(c.token_ids) for c in want.completions]
    spec = use_drafters(make_engine(), OracleDrafter(refs, VOCAB_SIZE))
    spec.add_request(req)
    got = run_all(spec)["lp"]
    _assert_drafted(spec)
    for a, b in zip(got.completions, want.completions, strict=True):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_same_seed_same_output_run_to_run(make_engine: Any) -> None:
    """The engine as shipped (its own drafters, its cost model fitted to measured step times,
    so how much it drafts may differ run to run): the outputs do not."""
    reqs = _workload(greedy=False)
    first, second = make_engine(), make_engine()
    assert _run(first, reqs) == _run(second, reqs)
    assert first.stats()["num_decode_rows"] > 0


def test_sampled_distribution_kept(make_engine: Any) -> None:
    """Thousands of members of one request; after the first token t0 (drawn by the prompt's
    row) a drafter proposes a fixed pair (d1, d2): the second token fits the model's
    distribution p(. | t0), the third (after an accepted d1) fits p(. | t0 d1); and the
    counts match sampling without drafts (other seeds: a two-sample test, not the same
    draws)."""
    prompt, members = "distribution", 4000
    probe = make_engine(token_speculation=False)
    vocab = probe.loaded.args.vocab_size

    def dist(ids: list[int]) -> torch.Tensor:
        sp = SamplingParams(temperature=1.0, max_tokens=1, logprobs=vocab)
        probe.add_request(GenerateRequest("p", sp, prompt_ids=tuple(ids)))
        (c,) = run_all(probe)["p"].completions
        p = torch.zeros(vocab)
        for tok, lp in c.logprobs[0].top:
            p[tok] = float(torch.tensor(lp).exp())
        return p / p.sum()

    ids = probe.encode(prompt)
    t0 = int(dist(ids).argmax())
    p1 = dist([*ids, t0])
    d1 = int(p1.argsort(descending=True)[1])  # a likely token, not the likeliest
    p2 = dist([*ids, t0, d1])
    d2 = int(p2.argmax())

    def sample(spec: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        engine = make_engine(
            token_speculation=spec, max_num_seqs=members, max_num_batched_tokens=members
        )
        if spec:
            use_drafters(engine, _AfterFirst(len(ids), t0, [d1, d2]))
        sp = SamplingParams(temperature=1.0, max_tokens=3, seed=seed, ignore_eos=True)
        engine.add_request(GenerateRequest("s", sp, prompt=prompt, n=members))
        comps = [c.token_ids for c in run_all(engine)["s"].completions if c.token_ids[0] == t0]
        if spec:
            st = engine.stats()
            assert st["num_verify_rows"] > 0 and st["num_draft_tokens_fixed"] > 0
        second = torch.bincount(torch.tensor([c[1] for c in comps]), minlength=vocab)
        third = [c[2] for c in comps if c[1] == d1]
        return second, torch.bincount(torch.tensor(third), minlength=vocab)

    with_second, with_third = sample(True, 1)
    without_second, without_third = sample(False, 2)
    for counts, p in ((with_second, p1), (with_third, p2), (without_second, p1)):
        keep = p * counts.sum() >= 5  # chi-square wants expected counts >= 5
        p = p.double() / p.double().sum()
        expected = torch.cat([p[keep], p[~keep].sum()[None]]) * counts.sum()
        observed = torch.cat([counts[keep], counts[~keep].sum()[None]]).double()
        assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
    for a, b in ((with_second, without_second), (with_third, without_third)):
        cols = (a + b) >= 10
        table = torch.stack([a[cols], b[cols]]).numpy()
        assert chi2_contingency(table).pvalue > 1e-3


class _AfterFirst(WrongDrafter):
    """A point-mass draft, proposed right after the first output token ``first``."""

    name = "fixed"

    def __init__(self, prompt_len: int, first: int, draft: list[int]) -> None:
        self.prompt_len, self.first, self.draft = prompt_len, first, draft

    def propose(self, context: Any) -> list[int]:
        tokens = context.token_ids
        if len(tokens) == self.prompt_len + 1 and tokens[-1] == self.first:
            return self.draft[: context.limit]
        return []


def test_wrong_drafts_are_switched_off(make_engine: Any) -> None:
    """A drafter that is never right stops being asked (but for rare exploration) under the
    real cost model, and costs no token of output."""
    reqs = _workload(greedy=True)
    base, _ = _references(make_engine(token_speculation=False), reqs)
    spec = use_drafters(make_engine(), WrongDrafter(), free=False)
    assert _run(spec, reqs) == base
    st = spec.stats()
    assert st["num_accepted_tokens_wrong"] == 0
    assert st["num_verify_rows"] < 0.25 * st["num_decode_rows"]


def test_right_drafts_grow_long_at_batch_one(make_engine: Any) -> None:
    """At one row a step is nearly all fixed cost: a drafter that is right gets long drafts
    and the sequence needs far fewer steps."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    req = GenerateRequest("one", params, prompt="a single long greedy generation")
    base, refs = _references(make_engine(token_speculation=False), [req])
    spec = use_drafters(
        make_engine(max_draft_tokens=8), OracleDrafter(refs, VOCAB_SIZE, wrong_every=0), free=False
    )
    assert _run(spec, [req]) == base
    assert spec.counters.num_decode_steps <= 60 // 3
    assert spec.stats()["num_decode_tokens"] / spec.stats()["num_decode_rows"] > 3


def test_switch_off(make_engine: Any) -> None:
    engine = make_engine(token_speculation=False)
    assert engine.speculator is None
    _run(engine, _workload(greedy=True))
    st = engine.stats()
    assert st["num_draft_tokens"] == 0 and st["num_verify_rows"] == 0


async def test_in_the_engine_process_with_its_counters_in_the_stats(make_backend: Any) -> None:
    """The engine in its own process drafts (the drafter named by ``module:attr`` is built
    there), keeps every output, and its counters cross in the typed step messages."""
    reqs = [r for r in _workload(greedy=True) if r.request_id.startswith("r")]
    outputs = []
    for on in (False, True):
        options = {"drafter": "spec_drafters:wrong_drafter"} if on else {}
        backend = make_backend(token_speculation=on, **options)
        results = await asyncio.gather(*(backend.generate(r) for r in reqs))
        outputs.append(_outputs({r.request_id: r for r in results}))
        await backend.check_health()
        st = backend.stats()
    assert outputs[0] == outputs[1]
    assert st["num_draft_tokens_wrong"] > 0 and st["num_draft_tokens"] > 0
    assert st["num_verify_rows"] > 0
