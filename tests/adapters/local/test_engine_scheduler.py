"""Stops, priorities, admission, preemption, abort; the KV pool ends 100% free every time."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fixtures import make_engine, run_all, tiny_llama

from spec_tot.errors import ConfigError
from spec_tot.requests import FinishReason, GenerateRequest, Priority, SamplingParams

__all__ = ["make_engine", "tiny_llama"]

torch.set_num_threads(1)


def _greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, **{"max_tokens": 30, **kw})


def _one(engine: Any, params: SamplingParams, prompt: str = "Hello world") -> Any:
    engine.add_request(GenerateRequest("r", params, prompt=prompt))
    return run_all(engine)["r"].completions[0]


def test_stop_string_truncates(make_engine: Any) -> None:
    engine = make_engine()
    free = _one(engine, SamplingParams(temperature=1.0, seed=3, max_tokens=30))
    text = free.text
    assert len(text) > 8
    stop = text[5:7]
    first = text.index(stop)
    out = _one(engine, SamplingParams(temperature=1.0, seed=3, max_tokens=30, stop=(stop,)))
    assert out.finish_reason == FinishReason.STOP
    assert out.text == text[:first]


def test_stop_token_id(make_engine: Any) -> None:
    engine = make_engine()
    free = _one(engine, SamplingParams(temperature=1.0, seed=5, max_tokens=30))
    token = free.token_ids[4]
    cut = free.token_ids.index(token) + 1
    out = _one(
        engine, SamplingParams(temperature=1.0, seed=5, max_tokens=30, stop_token_ids=(token,))
    )
    assert out.finish_reason == FinishReason.STOP
    assert out.token_ids == free.token_ids[:cut]
    assert out.text == engine.tokenizer.decode(list(free.token_ids[: cut - 1]))


def test_max_tokens(make_engine: Any) -> None:
    out = _one(
        make_engine(), SamplingParams(temperature=1.0, seed=1, max_tokens=5, stop_token_ids=())
    )
    assert out.num_tokens <= 5
    assert out.finish_reason == (FinishReason.LENGTH if out.num_tokens == 5 else FinishReason.STOP)


def test_admission_bounded_by_free_blocks(make_engine: Any) -> None:
    """8 prompts of ~3 blocks each in a 10-block pool: never over-admitted, same outputs."""
    prompts = [f"prompt number {i}" for i in range(8)]
    params = _greedy(max_tokens=8)
    small, big = make_engine(num_kv_blocks=10), make_engine()
    for eng in (small, big):
        for i, p in enumerate(prompts):
            eng.add_request(GenerateRequest(f"r{i}", params, prompt=p))
    small.step()
    assert small.block_manager.num_used_blocks <= 10
    assert len(small.scheduler.running) < len(prompts)  # the pool, not the queue, bounded it
    out_small = {k: v.completions for k, v in run_all(small).items()}
    out_big = {k: v.completions for k, v in run_all(big).items()}
    assert out_small == out_big
    assert small.counters.peak_kv_blocks_used <= 10


def test_committed_runs_before_speculative_under_pressure(make_engine: Any) -> None:
    engine = make_engine(num_kv_blocks=16)
    params = _greedy(max_tokens=24)
    for i in range(4):
        engine.add_request(
            GenerateRequest(f"spec{i}", params, prompt=f"spec {i}", priority=Priority.SPECULATIVE)
        )
    for _ in range(6):
        engine.step()
    assert engine.block_manager.num_free_blocks < 10  # the committed prompt cannot fit
    engine.add_request(GenerateRequest("commit", params, prompt="committed work"))
    added_at = engine.counters.num_steps
    done_at: dict[str, int] = {}
    results: dict[str, Any] = {}
    while engine.has_unfinished():
        for r in engine.step():
            done_at[r.request_id] = engine.counters.num_steps
            results[r.request_id] = r
    # the committed request ran from its arrival on (a token a step; steps are all-prefill or
    # all-decode, so a readmitted speculative prefill may take one step of its own)
    assert done_at["commit"] - added_at <= results["commit"].completions[0].num_tokens + 2
    long_spec = [
        k for k, r in results.items() if k != "commit" and r.completions[0].num_tokens == 24
    ]
    assert long_spec and all(done_at[k] > done_at["commit"] for k in long_spec)
    assert engine.scheduler.num_preemptions > 0  # speculative work made room
    # preemption (recompute) changes no output
    ref = make_engine()
    for i in range(4):
        ref.add_request(GenerateRequest(f"spec{i}", params, prompt=f"spec {i}"))
    ref.add_request(GenerateRequest("commit", params, prompt="committed work"))
    assert {k: v.completions for k, v in run_all(ref).items()} == {
        k: v.completions for k, v in results.items()
    }


def test_waiting_queue_priority_order(make_engine: Any) -> None:
    engine = make_engine(max_num_seqs=1)
    params = _greedy(max_tokens=3)
    engine.add_request(GenerateRequest("s", params, prompt="a", priority=Priority.SPECULATIVE))
    engine.add_request(GenerateRequest("c1", params, prompt="b"))
    engine.add_request(GenerateRequest("c2", params, prompt="c"))
    order = []
    while engine.has_unfinished():
        order += [r.request_id for r in engine.step()]
    assert order == ["c1", "c2", "s"]


def test_abort_by_id_and_prefix_mid_generation(make_engine: Any) -> None:
    engine = make_engine()
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=60, stop_token_ids=())
    for rid in ("q1/a", "q1/a/b", "q1x", "q2"):
        engine.add_request(GenerateRequest(rid, params, prompt="go", n=3))
    for _ in range(5):
        engine.step()
    assert engine.abort("q") == []  # "q1" does not start with "q/"
    gone = engine.abort("q1")
    assert sorted(r.request_id for r in gone) == ["q1/a", "q1/a/b"]
    for result in gone:
        assert len(result.completions) == 3
        assert any(c.finish_reason == FinishReason.ABORT for c in result.completions)
    (by_id,) = engine.abort_request("q1x")
    assert by_id.request_id == "q1x"
    rest = run_all(engine)
    assert set(rest) == {"q2"}


def test_bad_requests_raise_config_error(make_engine: Any) -> None:
    engine = make_engine(max_model_len=16)
    with pytest.raises(ConfigError, match="prompt"):
        engine.add_request(GenerateRequest("long", _greedy(), prompt="x" * 40))
    engine.add_request(GenerateRequest("dup", _greedy(max_tokens=2), prompt="x"))
    with pytest.raises(ConfigError, match="request_id"):
        engine.add_request(GenerateRequest("dup", _greedy(), prompt="x"))
    run_all(engine)
    with pytest.raises(ConfigError, match="block_size"):
        make_engine(block_size=0)


def test_prompts_tokenized_ahead_in_one_call(make_engine: Any) -> None:
    """The engine core tokenizes a command batch's prompts in one call: each prompt gets
    the ids it would alone, a refused one still fails alone with its own error, and an
    unused entry does not outlive the next batch."""
    from transformers import AutoTokenizer

    from spec_tot.adapters.local.engine.validate import RequestValidator
    from spec_tot.graphs.game24 import PROGRAM

    real = AutoTokenizer.from_pretrained(PROGRAM.backend_options("local")["policy_path"])
    engine = make_engine()
    texts = ["Use 4 4 6 8.\n4+4=8 (left: 6 8 8)\n", "héllo  wörld\n\n", "x" * 5000, "a\ud800"]
    for tokenizer in (engine.tokenizer, real):
        validator = RequestValidator(tokenizer, 1 << 20, 4096, 8, max_chars=4096)
        validator.encode_ahead(texts[:3])
        assert set(validator._ahead) == set(texts[:2])  # the long one is left to its check
        params = SamplingParams(max_tokens=1)
        for text in texts[:2]:
            ids = validator.prompt_ids(GenerateRequest("r", params, prompt=text))
            assert ids == list(tokenizer.encode(text))
        with pytest.raises(ConfigError, match="characters"):
            validator.prompt_ids(GenerateRequest("r", params, prompt=texts[2]))
        validator.encode_ahead([texts[0], texts[1]])
        validator.encode_ahead([texts[1], "other", "third"])
        assert texts[0] not in validator._ahead  # left by the batch before: forgotten
        validator.encode_ahead(texts[:2] + texts[3:])  # a batch the tokenizer refuses
        assert validator.prompt_ids(GenerateRequest("r", params, prompt=texts[0])) == list(
            tokenizer.encode(texts[0])
        )
