"""Load a local Hugging Face folder (config.json + *.safetensors + tokenizer), or build a
random-weight model from a config dict (no file at all). Never touches the hub."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spec_tot.errors import ConfigError

from .linear import Linear
from .model import DecoderModel, ModelArgs, rope_inv_freq, rope_tables
from .model_files import check_model_folder

__all__ = [
    "LoadedModel",
    "build_random_model",
    "cpu_auto_dtype",
    "from_hf_model",
    "load_model_folder",
    "make_hf_config",
]

_FAMILIES = ("llama", "qwen2")


@dataclass(slots=True)
class LoadedModel:
    model: DecoderModel
    args: ModelArgs
    tokenizer: Any | None  # a transformers tokenizer, or None (random-weight models)
    hf_config: Any
    weights: str = "float"  # what runs: "float", or "gguf" (its quantized matrices too)


def _check_family(config: Any, where: str) -> None:
    if getattr(config, "model_type", None) not in _FAMILIES:
        raise ConfigError(
            where, f"model_type {getattr(config, 'model_type', None)!r} not in {_FAMILIES}"
        )


def _build(config: Any, device: str, dtype: torch.dtype) -> DecoderModel:
    args = ModelArgs.from_hf(config)
    inv_freq, scaling = rope_inv_freq(config, args.head_dim)
    # Build on the meta device, then materialise on the target: no CPU copy of a big model.
    with torch.device("meta"):
        model = DecoderModel(args, inv_freq.to("meta"), scaling)
    model = model.to_empty(device=device).to(dtype)
    cos, sin = rope_tables(inv_freq, args.max_position_embeddings, scaling)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
    return model.eval()


def load_model_folder(
    path: str | Path,
    device: str,
    dtype: torch.dtype,
    with_tokenizer: bool = True,
    weights: str = "float",
) -> LoadedModel:
    """Read ``config.json``, every ``*.safetensors`` and the tokenizer from ``path``;
    ``weights="gguf"``: also its ``model.gguf``'s quantized matrices, run at the decode
    steps where they measured faster (``gguf_weights.py``); ``"auto"``: those where the
    folder has one and they can run here (float32 on the CPU, the C kernel built)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    folder = check_model_folder(path, "model")
    files = sorted(folder.glob("*.safetensors"))
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    _check_family(config, "model")
    model = _build(config, device, dtype)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file), device="cpu"))
    model.load_hf_weights(tensors)
    if weights == "auto":
        weights = "gguf" if _gguf_runs(folder, device, dtype) else "float"
    if weights == "gguf":
        _attach_gguf(model, folder, device, dtype)
    tokenizer = (
        AutoTokenizer.from_pretrained(folder, local_files_only=True) if with_tokenizer else None
    )
    return LoadedModel(model, model.args, tokenizer, config, weights)


def _gguf_runs(folder: Path, device: str, dtype: torch.dtype) -> bool:
    """``weights="auto"``: the folder ships a GGUF and its kernel runs here. Without a C
    compiler the float weights run, as they did before GGUF weights existed."""
    from .gguf_weights import load_quant_kernel

    if device != "cpu" or dtype != torch.float32 or not (folder / "model.gguf").is_file():
        return False
    return load_quant_kernel()[0] is not None


def cpu_auto_dtype(folder: str | Path, weights: str) -> torch.dtype:
    """``EngineConfig(dtype="auto")`` on the CPU for the model folder ``folder``: float32,
    or bfloat16 for a 16-bit checkpoint where it measured faster and no GGUF weights run
    (``dtype_choice.py``). Other devices keep ``config.resolve_dtype``'s rule."""
    from .dtype_choice import auto_cpu_dtype

    path = Path(folder)
    gguf = weights == "gguf" or (weights == "auto" and _gguf_runs(path, "cpu", torch.float32))
    return auto_cpu_dtype(path, gguf_runs=gguf)


def _attach_gguf(model: DecoderModel, folder: Path, device: str, dtype: torch.dtype) -> None:
    from .gguf_weights import load_quant_kernel, quant_max_rows, read_gguf

    gguf = folder / "model.gguf"
    if device != "cpu" or dtype != torch.float32:
        raise ConfigError("weights", f"gguf runs on the CPU in float32, not {device} {dtype}")
    if not gguf.is_file():
        raise ConfigError("weights", f"gguf reads the model's GGUF: {str(gguf)!r} is missing")
    kernel, error = load_quant_kernel()
    if kernel is None:
        raise ConfigError("weights", f"gguf needs its C kernel: {error}")
    args = model.args
    quantized = read_gguf(gguf, args.num_heads, args.num_kv_heads)
    if not quantized:
        raise ConfigError("weights", f"{str(gguf)!r} holds no Q4_0, Q4_1 or Q8_0 matrices")
    # the crossover of a layer's matmul (an MLP's, else any) and of the LM head, measured
    name = "model.layers.0.mlp.gate_proj.weight"
    layer = quantized.get(name) or next(iter(quantized.values()))
    rows = quant_max_rows(kernel, layer, Linear(layer.dequantize()))
    head = quantized.get("lm_head.weight" if model.lm_head is not None else
                         "model.embed_tokens.weight")  # fmt: skip
    head_rows = 0 if head is None else quant_max_rows(kernel, head, model.head_linear, reps=3)
    model.attach_quantized(quantized, kernel, rows, head_rows)


def make_hf_config(config: dict[str, Any]) -> Any:
    """A LlamaConfig / Qwen2Config from a plain dict (``model_type`` defaults to llama)."""
    from transformers import LlamaConfig, Qwen2Config

    options = dict(config)
    kind = options.pop("model_type", "llama")
    if kind not in _FAMILIES:
        raise ConfigError("model_config", f"model_type {kind!r} not in {_FAMILIES}")
    cls = LlamaConfig if kind == "llama" else Qwen2Config
    return cls(**options)


def build_random_model(
    config: dict[str, Any], device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> LoadedModel:
    """A random-weight model of any size (e.g. a 7B-shaped Llama on GPU) built from a config
    dict, without any file. Weights ~ N(0, initializer_range)."""
    hf_config = make_hf_config(config)
    model = _build(hf_config, device, dtype)
    model.init_random(float(getattr(hf_config, "initializer_range", 0.02)), seed)
    return LoadedModel(model, model.args, None, hf_config)


def from_hf_model(
    hf_model: Any, device: str, dtype: torch.dtype, tokenizer: Any = None
) -> LoadedModel:
    """Our model from an in-memory transformers ``LlamaForCausalLM``/``Qwen2ForCausalLM``
    (same weights; used by benchmarks comparing against transformers)."""
    config = hf_model.config
    _check_family(config, "model")
    model = _build(config, device, dtype)
    model.load_hf_weights(dict(hf_model.state_dict()))
    return LoadedModel(model, model.args, tokenizer, config)
