"""The float type a CPU engine runs a model in when ``EngineConfig(dtype="auto")``.

A checkpoint that ships in bfloat16 or float16 runs in bfloat16 where this CPU multiplies
in bfloat16 faster than in float32 (AVX-512 BF16 or AMX: a decode step's matmuls read half
the bytes), measured here at load on a matmul of the model's own shape. Elsewhere, and for
checkpoints that ship in float32 or whose GGUF weights run (``weights="gguf"``, float32
only), it runs float32. On an AVX2-only CPU bfloat16 is emulated: SmolLM2's matmuls took
44 ms at one row against float32's 54 ms, then fell behind from two rows on (1.3 s at 32
against 0.1 s; ``benchmarks/README.md``, "GGUF weights"), so a fixed rule would be wrong on
one kind of CPU or the other.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from .linear import Linear

__all__ = ["BF16_MARGIN", "auto_cpu_dtype", "bf16_pays", "shipped_dtype"]

# bfloat16 must be this much faster (time ratio) at every measured row count: it costs
# precision, so a tie keeps float32.
BF16_MARGIN = 0.9
_ROWS = (1, 8)  # a decode step alone and a batch of them
_SIXTEEN_BIT = ("bfloat16", "float16")


def _config(folder: str | Path) -> dict[str, Any]:
    """``config.json`` of ``folder``; empty where it cannot be read (the loader reports a
    bad folder, naming it)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def shipped_dtype(folder: str | Path) -> str | None:
    """The dtype ``config.json`` says the weights were saved in (``dtype``, or the older
    ``torch_dtype``), None when it says none."""
    config = _config(folder)
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value) if value else None


def bf16_pays(out_features: int, in_features: int, reps: int = 5) -> bool:
    """Whether a ``[out, in]`` matmul ran in bfloat16 within ``BF16_MARGIN`` of float32's
    time at every row count of ``_ROWS``, each as the engine runs it (``Linear``: oneDNN's
    packed float32, ``F.linear`` in bfloat16). A few milliseconds where bfloat16 is native."""
    weight = torch.randn(out_features, in_features) * 0.02
    paths = ((Linear(weight), torch.float32), (Linear(weight.to(torch.bfloat16)), torch.bfloat16))
    for rows in _ROWS:
        times = []
        for linear, dtype in paths:
            x = torch.randn(rows, in_features).to(dtype)
            linear(x)  # warm: oneDNN's first call builds its primitive
            started = time.perf_counter()
            for _ in range(reps):
                linear(x)
            times.append(time.perf_counter() - started)
        if times[1] > BF16_MARGIN * times[0]:
            return False
    return True


def auto_cpu_dtype(folder: str | Path, gguf_runs: bool) -> torch.dtype:
    """``dtype="auto"`` on the CPU for the model folder ``folder``: bfloat16 for a 16-bit
    checkpoint where it measured faster, else float32 (and always float32 where the
    folder's GGUF weights run: their kernel takes float32 inputs)."""
    config = _config(folder)
    if gguf_runs or (config.get("dtype") or config.get("torch_dtype")) not in _SIXTEEN_BIT:
        return torch.float32
    hidden = int(config.get("hidden_size", 0))
    inner = int(config.get("intermediate_size", 0))
    if hidden <= 0 or inner <= 0:
        return torch.float32
    return torch.bfloat16 if bf16_pays(inner, hidden) else torch.float32
