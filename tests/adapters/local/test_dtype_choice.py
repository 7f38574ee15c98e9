"""``EngineConfig(dtype="auto")`` on the CPU: a checkpoint that ships in 16 bits runs in
bfloat16 where it measured faster here, float32 otherwise; float32 checkpoints and GGUF
weights always run float32 (``model/dtype_choice.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_fixtures import assert_pool_free, tiny_llama

from spec_tot.adapters.local.config import EngineConfig, resolve_dtype
from spec_tot.adapters.local.engine.llm_engine import LLMEngine
from spec_tot.adapters.local.model import dtype_choice
from spec_tot.adapters.local.model.loader import cpu_auto_dtype
from spec_tot.requests import GenerateRequest, SamplingParams

__all__ = ["tiny_llama"]  # a fixture, imported for pytest


def shipped_as(folder: Path, tmp_path: Path, dtype: str) -> Path:
    """A copy of ``folder`` whose ``config.json`` says its weights ship in ``dtype``."""
    copy = Path(shutil.copytree(folder, tmp_path / dtype))
    config = json.loads((copy / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = dtype
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def measured(monkeypatch: pytest.MonkeyPatch, pays: bool) -> list[tuple[int, int]]:
    """Replace the measurement by a verdict; returns the shapes it was asked about."""
    asked: list[tuple[int, int]] = []

    def verdict(out_features: int, in_features: int, reps: int = 5) -> bool:
        asked.append((out_features, in_features))
        return pays

    monkeypatch.setattr(dtype_choice, "bf16_pays", verdict)
    return asked


def greedy(engine: LLMEngine) -> tuple[int, ...]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request(GenerateRequest("q", params, prompt="hello there"))
    done = []
    while engine.has_unfinished():
        done.extend(engine.step())
    assert_pool_free(engine)
    return done[0].completions[0].token_ids


def test_a_16_bit_checkpoint_runs_bf16_where_it_measured_faster(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = shipped_as(tiny_llama, tmp_path, "bfloat16")
    asked = measured(monkeypatch, pays=True)
    engine = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=64, max_model_len=128))
    assert engine.dtype == torch.bfloat16 and engine.loaded.model.embed.dtype == torch.bfloat16
    assert asked == [(128, 64)]  # the model's own MLP shape: intermediate x hidden
    assert len(greedy(engine)) == 6
    float16 = shipped_as(tiny_llama, tmp_path, "float16")
    assert cpu_auto_dtype(float16, "auto") == torch.bfloat16


def test_it_stays_float32_where_bf16_measured_slower_or_is_not_asked_for(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = shipped_as(tiny_llama, tmp_path, "bfloat16")
    asked = measured(monkeypatch, pays=False)
    assert LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=64)).dtype == torch.float32
    assert asked
    asked.clear()
    # a float32 checkpoint, GGUF weights, an explicit dtype: nothing is measured
    assert cpu_auto_dtype(shipped_as(tiny_llama, tmp_path, "float32"), "auto") == torch.float32
    assert dtype_choice.auto_cpu_dtype(folder, gguf_runs=True) == torch.float32
    explicit = LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64))
    assert explicit.dtype == torch.float32 and asked == []
    assert resolve_dtype("auto", "cuda") == torch.bfloat16  # CUDA's default, as before


def test_the_measurement_runs_on_this_cpu() -> None:
    """The real measurement: a verdict, in well under a second on a small shape."""
    assert isinstance(dtype_choice.bf16_pays(256, 128, reps=2), bool)
    assert dtype_choice.shipped_dtype("/nonexistent") is None
