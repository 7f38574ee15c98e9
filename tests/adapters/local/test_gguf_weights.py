"""A GGUF's quantized weights at decode steps (``EngineConfig(weights="gguf")``): the C
kernel against the dequantized weights (Q4_1 and Q8_0), the Linear paths, reading a GGUF
(rows in Hugging Face's order), and the refusals naming the option."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_fixtures import built_kernel, tiny_llama

from spec_tot.adapters.local.config import EngineConfig
from spec_tot.adapters.local.model.gguf_weights import (
    Q4Weight,
    Q8Weight,
    QuantKernel,
    load_quant_kernel,
    read_gguf,
)
from spec_tot.adapters.local.model.linear import Linear, QuantPath
from spec_tot.adapters.local.model.loader import load_model_folder
from spec_tot.errors import ConfigError
from spec_tot.peers.smollm2 import smollm2_folder, unpermute

__all__ = ["tiny_llama"]  # a fixture, imported for pytest


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> QuantKernel:
    return built_kernel(load_quant_kernel, tmp_path_factory.mktemp("cache"), "the quantized kernel")


def random_q4(n: int, k: int, seed: int = 0) -> Q4Weight:
    """Random Q4_1 blocks as GGUF lays them out (fp16 d, fp16 m, 16 bytes of codes)."""
    rng = np.random.default_rng(seed)
    blocks = np.zeros((n, k // 32, 20), dtype=np.uint8)
    scales = np.stack([rng.uniform(0.001, 0.02, (n, k // 32)),
                       rng.uniform(-0.1, 0.0, (n, k // 32))], -1).astype(np.float16)  # fmt: skip
    blocks[:, :, :4] = scales.view(np.uint8).reshape(n, k // 32, 4)
    blocks[:, :, 4:] = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    return Q4Weight.from_blocks(blocks.reshape(n, -1), n, k)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_the_kernel_is_the_dequantized_matmul(kernel: QuantKernel, rows: int) -> None:
    weight = random_q4(70, 96, seed=rows)
    dense = weight.dequantize()
    # inputs int8 represents exactly (every block of 32 spans -127..127): exact sums
    codes = torch.randint(-127, 128, (rows, 96)).float()
    codes[:, ::32] = 127.0
    x = codes * 0.01
    assert torch.allclose(kernel.linear(x, weight), x @ dense.T, rtol=1e-5, atol=1e-5)
    # any input: int8 per block of 32 as llama.cpp does, about 1% off
    wide = torch.randn(rows, 2 * 96)[:, ::2]  # strided rows
    ref = wide @ dense.T
    assert ((kernel.linear(wide, weight) - ref).norm() / ref.norm()).item() < 0.03


@pytest.mark.parametrize("rows", [1, 6])
def test_the_kernel_multiplies_q8_0_blocks(kernel: QuantKernel, rows: int) -> None:
    rng = np.random.default_rng(rows)
    blocks = np.zeros((40, 3, 34), dtype=np.uint8)
    blocks[:, :, :2] = rng.uniform(0.001, 0.01, (40, 3, 1)).astype(np.float16).view(np.uint8)
    blocks[:, :, 2:] = rng.integers(-128, 128, (40, 3, 32)).astype(np.int8).view(np.uint8)
    weight = Q8Weight.from_blocks(blocks.reshape(40, -1), 40, 96)
    codes = torch.randint(-127, 128, (rows, 96)).float()
    codes[:, ::32] = 127.0
    x = codes * 0.01  # exact in int8: exact sums
    ref = x @ weight.dequantize().T
    assert torch.allclose(kernel.linear(x, weight), ref, rtol=1e-5, atol=1e-4)


def test_a_linear_takes_the_quantized_path_up_to_its_rows(kernel: QuantKernel) -> None:
    weight = random_q4(64, 64)
    dense = weight.dequantize()
    linear = Linear(dense, quant=QuantPath(weight, kernel, max_rows=2))
    assert [linear.kernel(r) for r in (1, 2, 3)][:2] == ["gguf", "gguf"]
    assert linear.kernel(3) != "gguf"
    x, other = torch.randn(2, 64), torch.randn(2, 64)
    q4 = kernel.linear(x, weight)
    assert torch.equal(linear(x), q4)
    assert torch.allclose(linear.silu(x), torch.nn.functional.silu(q4))
    assert torch.allclose(linear.times(x, other), q4 * other)
    assert torch.allclose(linear.plus(x, other), q4 + other)
    many = torch.randn(3, 64)
    assert torch.allclose(linear(many), many @ dense.T, rtol=1e-4, atol=1e-5)  # float path


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_gguf_is_read_in_hugging_face_row_order(tmp_path: Path, kind: str) -> None:
    """Each block format as GGUF's own ``gguf.quants`` writes and reads it."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, (64, 64)).astype(np.float32)  # 4 heads of 16 rows
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    q = quantize(w, qtype)
    writer.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = read_gguf(tmp_path / "m.gguf", heads=4, kv_heads=4)
    (name, weight), *_ = read.items()
    assert name == "model.layers.0.self_attn.q_proj.weight"
    expected = unpermute(gguf.quants.dequantize(q, qtype), 4)
    assert np.allclose(weight.dequantize().numpy(), expected.reshape(64, 64), atol=1e-6)


def test_the_kernel_multiplies_q4_0_blocks(kernel: QuantKernel) -> None:
    """Q4_0 runs as Q4_1 with ``m = -8 d``: the kernel's sums are the dequantized ones."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(1).normal(0, 0.02, (40, 96)).astype(np.float32)
    raw = quantize(w, gguf.GGMLQuantizationType.Q4_0)
    weight = Q4Weight.from_q4_0_blocks(raw, 40, 96)
    dense = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType.Q4_0).reshape(40, 96))
    assert torch.equal(weight.dequantize(), dense.float())
    codes = torch.randint(-127, 128, (3, 96)).float()
    codes[:, ::32] = 127.0
    x = codes * 0.01  # exact in int8: exact sums
    assert torch.allclose(kernel.linear(x, weight), x @ dense.float().T, rtol=1e-5, atol=1e-5)


def test_smollm2s_gguf_weights_are_its_float_weights() -> None:
    """On the real model when fetched (CI fetches it): the GGUF's Q4_1 matrices, read in
    Hugging Face's order, are the float folder's weights."""
    folder = smollm2_folder()
    if not (folder / "model.gguf").is_file():
        pytest.skip("SmolLM2 not fetched (python scripts/fetch_smollm2.py)")
    from safetensors import safe_open

    read = read_gguf(folder / "model.gguf", heads=9, kv_heads=3)
    with safe_open(str(folder / "model.safetensors"), "pt") as tensors:
        for name in ("model.layers.0.self_attn.q_proj.weight",
                     "model.layers.29.mlp.down_proj.weight"):  # fmt: skip
            assert torch.allclose(read[name].dequantize(), tensors.get_tensor(name), atol=1e-6)


def test_gguf_is_refused_naming_the_option(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="weights"):
        EngineConfig(model=str(tiny_llama), weights="int3")
    with pytest.raises(ConfigError, match=r"weights: .*model\.gguf.* is missing"):
        load_model_folder(tiny_llama, "cpu", torch.float32, with_tokenizer=False, weights="gguf")
    with pytest.raises(ConfigError, match="weights: gguf runs on the CPU in float32"):
        load_model_folder(tiny_llama, "cpu", torch.bfloat16, with_tokenizer=False, weights="gguf")


def test_auto_weights_run_the_gguf_only_where_the_folder_ships_one(tiny_llama: Path) -> None:
    """The default, ``weights="auto"``: a folder without a ``model.gguf`` runs its float
    weights (and a bfloat16 engine always does); SmolLM2's, when fetched, its GGUF's."""
    assert EngineConfig(model=str(tiny_llama)).weights == "auto"
    loaded = load_model_folder(tiny_llama, "cpu", torch.float32, with_tokenizer=False,
                               weights="auto")  # fmt: skip
    assert loaded.weights == "float"
    folder = smollm2_folder()
    if not (folder / "model.gguf").is_file():
        pytest.skip("SmolLM2 not fetched (python scripts/fetch_smollm2.py)")
    on_bf16 = load_model_folder(folder, "cpu", torch.bfloat16, with_tokenizer=False,
                                weights="auto")  # fmt: skip
    assert on_bf16.weights == "float"
    if load_quant_kernel()[0] is not None:
        loaded = load_model_folder(folder, "cpu", torch.float32, with_tokenizer=False,
                                   weights="auto")  # fmt: skip
        assert loaded.weights == "gguf" and loaded.model.layer(0).o_linear.quant is not None


def test_the_engine_runs_smollm2_on_its_gguf_weights() -> None:
    """End to end on the real model when fetched: the engine loads ``weights="gguf"``, its
    decode steps take the Q4 path where it measured faster, and greedy decoding runs to the
    end with every KV block freed."""
    folder = smollm2_folder()
    if not (folder / "model.gguf").is_file():
        pytest.skip("SmolLM2 not fetched (python scripts/fetch_smollm2.py)")
    from engine_fixtures import assert_pool_free

    from spec_tot.adapters.local.engine.llm_engine import LLMEngine
    from spec_tot.requests import GenerateRequest, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(folder), weights="gguf", num_kv_blocks=64,
                                    max_model_len=256, saturation_batch=4))  # fmt: skip
    layer = engine.loaded.model.layer(0)
    assert layer.o_linear.quant is not None and layer.down_linear.quant is not None
    assert engine.loaded.model.head_linear.quant is not None  # the Q8_0 embedding
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request(GenerateRequest("q", params, prompt="What is 2 + 3?"))
    done = []
    while engine.has_unfinished():
        done.extend(engine.step())
    assert len(done) == 1 and done[0].completions[0].num_tokens == 8
    assert_pool_free(engine)
