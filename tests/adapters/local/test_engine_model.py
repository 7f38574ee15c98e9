"""Model parity with transformers, batching invariance and prefix sharing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
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
    ("family", "tie", "rope", "hidden"),
    [
        ("llama", False, None, 64),
        ("qwen2", True, None, 64),
        ("llama", False, {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}, 64),
        ("qwen2", True, None, 512),  # weights big enough for oneDNN (CPU), q/k/v biases
    ],
)
def test_greedy_matches_transformers(
    tmp_path: Path,
    make_engine: Any,
    family: str,
    tie: bool,
    rope: dict[str, Any] | None,
    hidden: int,
) -> None:
    path = make_tiny_model(
        tmp_path / family, family=family, tie=tie, rope=rope, seed=3, hidden=hidden
    )
    engine = make_engine(path)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(GenerateRequest(f"r{i}", GREEDY, prompt=prompt))
    results = run_all(engine)
    for i, prompt in enumerate(PROMPTS):
        ids = engine.encode(prompt)
        mine = list(results[f"r{i}"].completions[0].token_ids)
        assert mine == _hf_greedy(path, ids, GREEDY.max_tokens), prompt


def _our_logits(path: Path, ids: list[int]) -> tuple[torch.Tensor, Any]:
    """Logits of every position: a prefill of all but the last token (dense attention),
    then the last as a decode row (the sparse path), straight through the model runner."""
    from spec_tot.adapters.local.engine.sequence import ScheduledRow
    from spec_tot.adapters.local.model.loader import load_model_folder
    from spec_tot.adapters.local.model.model import KVCache
    from spec_tot.adapters.local.model.runner import ModelRunner

    loaded = load_model_folder(path, "cpu", torch.float32, with_tokenizer=False)
    cache = KVCache.allocate(loaded.args, 16, 4, "cpu", torch.float32)
    runner = ModelRunner(loaded.model, cache, "cpu")
    seq = SimpleNamespace(token_ids=ids, block_table=list(range(-(-len(ids) // 4))))
    n = len(ids) - 1
    prefill = runner.run([ScheduledRow(seq, 0, n)], 0, list(range(n)), [])  # type: ignore[arg-type]
    decode = runner.run([ScheduledRow(seq, n, 1)], 1, [0], [])  # type: ignore[arg-type]
    return torch.cat([prefill, decode]), loaded.model


@pytest.mark.parametrize(("family", "hidden"), [("llama", 64), ("qwen2", 512), ("llama", 512)])
def test_logits_match_transformers_forward(tmp_path: Path, family: str, hidden: int) -> None:
    """fp32 logits as exact as transformers' fp32 forward (both against it in float64), on
    the kernels each size takes (hidden 512: oneDNN on CPU, with q/k/v biases for qwen2)."""
    path = make_tiny_model(tmp_path / family, family=family, hidden=hidden, seed=5)
    ids = [1, *range(10, 40)]
    ours, model = _our_logits(path, ids)
    layer = model.layer(0)
    kinds = {lin.kernel(1) for lin in (layer.qkv_linear, layer.o_linear, layer.down_linear)}
    if hidden == 512 and torch.backends.mkldnn.is_available():
        assert kinds == {"onednn"} and layer.gate_up_split is not None
    elif hidden == 64:
        assert kinds == {"torch"}
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        exact = hf.double()(torch.tensor([ids])).logits[0]
    # float32's own error here: transformers' fp32 forward against the same in float64
    hf_error = float((ref.double() - exact).abs().max())
    our_error = float((ours.double() - exact).abs().max())
    assert our_error <= 5 * hf_error + 1e-6, (our_error, hf_error)
    assert torch.allclose(ours, ref, rtol=0, atol=5e-5 * float(ref.abs().max()))


def test_linear_kernels_agree() -> None:
    """oneDNN's matmul and its fused epilogues against ``F.linear``: float32 rounding; the
    sum and product bit for bit the unfused ones; a row's result the same in any batch."""
    import torch.nn.functional as F

    from spec_tot.adapters.local.model.linear import Linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not built into this torch")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1024, 512, generator=gen) * 0.05
    bias = torch.randn(1024, generator=gen)
    x = torch.randn(37, 512, generator=gen)
    other = torch.randn(37, 1024, generator=gen)
    lin = Linear(weight, bias)
    assert lin.packed and lin.kernel(1) == "onednn"
    y = lin(x)
    ref = F.linear(x, weight, bias)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(lin.plus(x, other), y + other)
    assert torch.equal(lin.times(x, other), y * other)
    assert torch.allclose(lin.silu(x), F.silu(ref), rtol=1e-5, atol=1e-5)
    for rows in (1, 2, 5, 16):
        assert torch.equal(lin(x[:rows].contiguous()), y[:rows])
    small = Linear(weight[:64, :64].contiguous())  # few rows: MKL's lower per-call cost
    assert small.kernel(1) == "torch" and small.kernel(4096) == "onednn"
    assert torch.equal(small(x[:3, :64]), F.linear(x[:3, :64], weight[:64, :64]))
    cold = Linear(weight.to(torch.bfloat16))  # other dtypes: F.linear on the weight itself
    assert not cold.packed and cold.weight is not None


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
    from spec_tot.adapters.local.engine.llm_engine import LLMEngine
    from spec_tot.adapters.local.engine.synthetic import synthetic_prompt_ids, synthetic_step_len

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
