"""Output features of the engine: logprobs (sampled, top-k, given ids, prompt), min_tokens,
ignore_eos, max_tokens=0, matched_stop; reference values from transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_fixtures import make_engine, run_all, tiny_llama
from transformers import AutoModelForCausalLM

from spec_tot.requests import FinishReason, GenerateRequest, SamplingParams

__all__ = ["make_engine", "tiny_llama"]

torch.set_num_threads(1)


def _one(engine: Any, params: SamplingParams, prompt: str = "Hello", **kw: Any) -> Any:
    engine.add_request(GenerateRequest("r", params, prompt=prompt, **kw))
    return run_all(engine)["r"]


def _hf_logprobs(path: Path, ids: list[int], temperature: float) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits / temperature, dim=-1)


def test_logprobs_of_sampled_top_and_given(make_engine: Any, tiny_llama: Path) -> None:
    engine = make_engine()
    params = SamplingParams(
        temperature=0.7, seed=4, max_tokens=6, logprobs=3, logprob_token_ids=(5, 9)
    )
    result = _one(engine, params)
    done = result.completions[0]
    assert len(done.logprobs) == done.num_tokens
    prompt = engine.encode("Hello")
    ref = _hf_logprobs(tiny_llama, prompt + list(done.token_ids), 0.7)
    for i, entry in enumerate(done.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert entry.token_id == done.token_ids[i]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        top = row.topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t for t, _ in entry.given] == [5, 9]
        assert [v for _, v in entry.given] == pytest.approx(
            [float(row[5]), float(row[9])], abs=1e-4
        )
    # logprobs=0: the sampled token only; None: nothing
    only = _one(engine, SamplingParams(temperature=0.0, max_tokens=3, logprobs=0))
    assert all(not e.top and not e.given for e in only.completions[0].logprobs)
    assert len(only.completions[0].logprobs) == only.completions[0].num_tokens
    assert _one(engine, SamplingParams(temperature=0.0, max_tokens=3)).completions[0].logprobs == ()


def test_prompt_logprobs_and_prefill_only(make_engine: Any, tiny_llama: Path) -> None:
    engine = make_engine()
    prompt = "Hello world, again"
    ids = engine.encode(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=0, logprobs=2)
    # warm the prefix cache first: prompt logprobs must still be computed, not skipped
    run_all_ids = _one(engine, SamplingParams(temperature=0.0, max_tokens=2), prompt=prompt)
    assert run_all_ids.completions[0].num_tokens >= 1
    result = _one(engine, params, prompt=prompt, prompt_logprobs_from=0)
    done = result.completions[0]
    assert done.num_tokens == 0 and done.token_ids == () and done.text == ""
    assert done.finish_reason == FinishReason.LENGTH and done.matched_stop is None
    ref = _hf_logprobs(tiny_llama, ids, 1.0)
    assert len(result.prompt_logprobs) == len(ids) and result.prompt_logprobs[0] is None
    for j in range(1, len(ids)):
        entry = result.prompt_logprobs[j]
        assert entry is not None and entry.token_id == ids[j]
        assert entry.logprob == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-4)
        assert [t for t, _ in entry.top] == ref[j - 1].topk(2).indices.tolist()
    later = _one(engine, params, prompt=prompt, prompt_logprobs_from=5)
    assert later.prompt_logprobs == result.prompt_logprobs[5:]


def test_prompt_logprobs_over_chunked_prefill(make_engine: Any) -> None:
    prompt = "a longer prompt that is cut into chunks of a few tokens each"
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0)
    whole = _one(make_engine(), params, prompt=prompt, prompt_logprobs_from=2)
    chunked = _one(
        make_engine(max_num_batched_tokens=7), params, prompt=prompt, prompt_logprobs_from=2
    )
    assert [e.token_id for e in chunked.prompt_logprobs if e] == [
        e.token_id for e in whole.prompt_logprobs if e
    ]
    pairs = zip(chunked.prompt_logprobs, whole.prompt_logprobs, strict=True)
    assert all(a and b and a.logprob == pytest.approx(b.logprob, abs=1e-5) for a, b in pairs)
    assert chunked.completions[0].token_ids == whole.completions[0].token_ids


def test_min_tokens_masks_stop_ids_and_stop_strings(make_engine: Any) -> None:
    engine = make_engine()
    free = _one(engine, SamplingParams(temperature=0.0, max_tokens=40)).completions[0]
    tok = free.token_ids[2]
    first = free.token_ids.index(tok)
    stopped = _one(engine, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(tok,)))
    assert stopped.completions[0].num_tokens == first + 1
    assert stopped.completions[0].matched_stop == tok
    late = _one(
        engine,
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(tok,), min_tokens=first + 4),
    ).completions[0]
    assert tok not in late.token_ids[: first + 4]  # masked: never drawn before min_tokens
    assert late.num_tokens >= first + 4
    # a stop string is not checked before min_tokens
    stop = free.text[1]
    early = _one(engine, SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)))
    assert early.completions[0].matched_stop == stop and early.completions[0].num_tokens == 2
    held = _one(engine, SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,), min_tokens=5))
    assert held.completions[0].num_tokens >= 5
    assert held.completions[0].token_ids[:2] == free.token_ids[:2]


def test_min_tokens_masks_eos_in_the_sampler() -> None:
    from spec_tot.adapters.local.engine.sampler import Sampler
    from spec_tot.adapters.local.engine.sequence import Member, RequestState, Sequence
    from spec_tot.requests import Priority

    def seq(params: SamplingParams, outputs: int) -> Sequence:
        state = RequestState("r", params, (1,), Priority.COMMITTED, [None])
        tokens = [1] + [3] * outputs
        return Sequence(1, tokens, 1, params, Priority.COMMITTED, 1, [Member(state, 0, None)])

    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0, 1.0]])  # EOS (2) is the argmax
    sampler = Sampler(frozenset({2}))
    params = SamplingParams(temperature=0.0, min_tokens=2, logprobs=1)
    tokens, lps = sampler.sample(logits.clone(), [seq(params, 1)])
    assert tokens == [[3]] and lps[0] is not None and lps[0][3].top[0][0] == 3
    assert sampler.sample(logits.clone(), [seq(params, 2)])[0] == [[2]]  # reached: allowed
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sampler.sample(logits.clone(), [seq(ignoring, 0)])[0] == [[2]]


def test_ignore_eos_and_matched_stop_ids(make_engine: Any) -> None:
    engine = make_engine()
    free = _one(engine, SamplingParams(temperature=0.0, max_tokens=40))
    n = free.completions[0].num_tokens
    ignoring = _one(engine, SamplingParams(temperature=0.0, max_tokens=n + 5, ignore_eos=True))
    out = ignoring.completions[0]
    assert out.num_tokens == n + 5 and out.finish_reason == FinishReason.LENGTH
    assert out.token_ids[:n] == free.completions[0].token_ids and out.matched_stop is None
    tok = free.completions[0].token_ids[1]
    by_id = _one(engine, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(tok,)))
    assert by_id.completions[0].matched_stop == tok
    assert by_id.completions[0].token_ids[-1] == tok


def test_stop_string_split_over_tokens(make_engine: Any) -> None:
    """A stop string spanning several tokens is found, the text cut before its start."""
    engine = make_engine()
    free = _one(engine, SamplingParams(temperature=1.0, seed=7, max_tokens=40)).completions[0]
    stop = free.text[3:6]
    cut = free.text.index(stop)
    out = _one(engine, SamplingParams(temperature=1.0, seed=7, max_tokens=40, stop=("zzz", stop)))
    done = out.completions[0]
    assert done.text == free.text[:cut] and done.matched_stop == stop
    assert done.token_ids == free.token_ids[: len(done.token_ids)]
