"""Model parity with transformers, batching invariance and prefix sharing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_fixtures import make_engine, make_tiny_model, run_all, tiny_llama
from transformers import AutoModelForCausalLM

from spec_tot.requests import FinishReason, GenerateRequest, SamplingParams

__all__ = ["make_engine", "tiny_llama"]

torch.set_num_threads(1)

PROMPTS = ["Hello world", "abc", "The quick brown fox jumps over", "x=1;y=2;", "Q"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _hf_greedy(path: Path, ids: list[int], max_new: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :]]


@pytest.mark.parametrize(
    ("family", "tie", "rope"),
    [
        ("llama", False, None),
        ("qwen2", True, None),
        ("llama", False, {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}),
    ],
)
def test_greedy_matches_transformers(
    tmp_path: Path, make_engine: Any, family: str, tie: bool, rope: dict[str, Any] | None
) -> None:
    path = make_tiny_model(tmp_path / family, family=family, tie=tie, rope=rope, seed=3)
    engine = make_engine(path)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(GenerateRequest(f"r{i}", GREEDY, prompt=prompt))
    results = run_all(engine)
    for i, prompt in enumerate(PROMPTS):
        ids = engine.encode(prompt)
        mine = list(results[f"r{i}"].completions[0].token_ids)
        assert mine == _hf_greedy(path, ids, GREEDY.max_tokens), prompt


def _generate(engine: Any, prompts: list[str], params: SamplingParams) -> list[tuple[int, ...]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", params, prompt=prompt))
    results = run_all(engine)
    return [results[f"r{i}"].completions[0].token_ids for i in range(len(prompts))]


def test_batched_equals_unbatched(make_engine: Any) -> None:
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=11)
    batched = _generate(make_engine(), PROMPTS, params)
    single = [_generate(make_engine(max_num_seqs=1), [p], params)[0] for p in PROMPTS]
    assert batched == single


def test_prefix_sharing_changes_no_output_and_hits(make_engine: Any) -> None:
    stem = "Let us think step by step about 24: "
    prompts = [stem + tail for tail in ("4+4", "6*4", "8*3", "12+12")]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    on, off = make_engine(enable_prefix_caching=True), make_engine(enable_prefix_caching=False)
    assert _generate(on, prompts, params) == _generate(off, prompts, params)
    assert on.block_manager.num_prefix_hit_blocks > 0
    assert off.block_manager.num_prefix_hit_blocks == 0


def test_child_prompt_reuses_generated_blocks(make_engine: Any) -> None:
    """A ToT child (parent prompt + parent output) hits the parent's generated blocks."""
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=20)
    prompt = engine.encode("Step 1: ")
    engine.add_request(GenerateRequest("parent", params, prompt_ids=tuple(prompt)))
    parent = run_all(engine)["parent"].completions[0]
    child_ids = tuple(prompt) + parent.token_ids
    engine.add_request(GenerateRequest("child", params, prompt_ids=child_ids))
    child = run_all(engine)["child"]
    assert child.cached_prompt_tokens >= len(child_ids) - engine.config.block_size - 1
    fresh = make_engine(enable_prefix_caching=False)
    fresh.add_request(GenerateRequest("child", params, prompt_ids=child_ids))
    assert run_all(fresh)["child"].completions[0].token_ids == child.completions[0].token_ids


def test_max_tokens_and_length(make_engine: Any) -> None:
    engine = make_engine()
    engine.add_request(
        GenerateRequest("a", SamplingParams(temperature=0.0, max_tokens=7), prompt="hi")
    )
    out = run_all(engine)["a"].completions[0]
    if out.finish_reason == FinishReason.LENGTH:
        assert out.num_tokens == 7
    else:  # stopped on eos first
        assert out.token_ids[-1] == 2 and out.num_tokens <= 7


def test_synthetic_workload_random_model(make_engine: Any) -> None:
    """Random-weight model from a config dict (no file), lognormal step lengths."""
    from engine_fixtures import assert_pool_free

    from spec_tot.adapters.local.config import EngineConfig, SyntheticWorkload
    from spec_tot.adapters.local.engine import LLMEngine
    from spec_tot.adapters.local.synthetic import synthetic_prompt_ids, synthetic_step_len

    shape = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    workload = SyntheticWorkload(seed=1, step_len_mu=2.5, step_len_sigma=0.5)
    outs = []
    for dedup in (True, False):
        engine = LLMEngine(
            EngineConfig(
                model_config=shape,
                synthetic=workload,
                block_size=4,
                num_kv_blocks=256,
                max_model_len=256,
                max_num_batched_tokens=512,
                enable_dedup=dedup,
            )
        )
        params = SamplingParams(temperature=1.0, max_tokens=40, seed=0)
        engine.add_request(GenerateRequest("s/0", params, prompt="some text prompt", n=4))
        ids = tuple(synthetic_prompt_ids(workload, 0, 256))
        engine.add_request(GenerateRequest("s/1", params, prompt_ids=ids))
        results = run_all(engine)
        assert_pool_free(engine)
        for rid, res in results.items():
            for i, c in enumerate(res.completions):
                assert c.num_tokens == min(40, synthetic_step_len(workload, rid, i))
        outs.append({k: [c.token_ids for c in v.completions] for k, v in results.items()})
    assert outs[0] == outs[1]
