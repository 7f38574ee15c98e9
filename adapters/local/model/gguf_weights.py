"""A GGUF model's quantized weights as shipped (Q4_0, Q4_1, Q8_0), and the C kernel that
multiplies by them.

SmolLM2-135M ships as GGUF Q4_1 (``spec_tot.peers.smollm2``): groups of 32 weights of an
output row with a scale ``d`` and a minimum ``m``, ``w = d * q + m`` for 4-bit codes
``q``. The model folder holds both that GGUF (``model.gguf``) and its float32
dequantization (``model.safetensors``): the same values, so the two paths differ only by
float32 rounding in the sums (tested). At a decode step's few rows a matmul reads its
weights once and does little arithmetic on them: 4-bit codes read 6.4x fewer bytes than
float32 (``csrc/quant_linear.c``). At many rows the arithmetic dominates and oneDNN's
blocked float32 GEMM wins; ``Linear`` takes the quantized path up to the row count measured
fastest (``DecoderModel.attach_quantized``). SmolLM2's embedding ships as Q8_0 (32 int8 and
a scale): as the tied LM head, the largest matmul of a decode step, it takes the same road
(the embedding lookup stays float32). Q4_0 (``w = d * (q - 8)``, no minimum) is Q4_1 with
``m = -8 d``: the same kernel, and the same sums, since ``-8 d`` is exact in float32.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spec_tot.peers.smollm2 import hf_name, unpermute

from .c_kernels import load_c_function

__all__ = [
    "Q4Weight",
    "Q8Weight",
    "QuantKernel",
    "load_quant_kernel",
    "quant_max_rows",
    "read_gguf",
]

_BLOCK = 32
_BLOCK_BYTES = 20  # Q4_1: fp16 d, fp16 m, 16 bytes of codes
_Q4_0_BYTES = 18  # Q4_0: fp16 d, 16 bytes of codes
_Q8_BYTES = 34  # Q8_0: fp16 d, 32 int8
_ERRORS = {-1: "bad shape", -5: "out of memory"}


@dataclass(frozen=True, slots=True)
class Q4Weight:
    """One ``[n, k]`` weight in Q4_1 blocks: ``qs`` ``[n, k/32, 16]`` uint8 codes (byte
    ``j``: weight ``j`` low nibble, ``j + 16`` high), ``d`` and ``m`` ``[n, k/32]`` float32."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qs.shape[0]), int(self.qs.shape[1]) * _BLOCK

    @classmethod
    def from_blocks(cls, raw: np.ndarray, n: int, k: int) -> Q4Weight:
        """From GGUF's raw Q4_1 bytes, ``n`` rows of ``k`` weights."""
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // _BLOCK, _BLOCK_BYTES)
        scales = blocks[:, :, :4].copy().view(np.float16).astype(np.float32)
        return cls(
            torch.from_numpy(blocks[:, :, 4:].copy()),
            torch.from_numpy(np.ascontiguousarray(scales[:, :, 0])),
            torch.from_numpy(np.ascontiguousarray(scales[:, :, 1])),
        )

    @classmethod
    def from_q4_0_blocks(cls, raw: np.ndarray, n: int, k: int) -> Q4Weight:
        """From GGUF's raw Q4_0 bytes: codes centred on 8, so ``m = -8 d``."""
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // _BLOCK, _Q4_0_BYTES)
        d = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)[:, :, 0]
        return cls(
            torch.from_numpy(blocks[:, :, 2:].copy()),
            torch.from_numpy(np.ascontiguousarray(d)),
            torch.from_numpy(np.ascontiguousarray(-8.0 * d)),
        )

    def dequantize(self) -> torch.Tensor:
        low, high = self.qs & 0x0F, self.qs >> 4
        codes = torch.cat([low, high], dim=-1).float()  # [n, k/32, 32]
        w = codes * self.d.unsqueeze(-1) + self.m.unsqueeze(-1)
        return w.reshape(self.shape)

    def take_rows(self, order: np.ndarray) -> Q4Weight:
        index = torch.from_numpy(np.asarray(order, dtype=np.int64))
        rows = (self.qs[index], self.d[index], self.m[index])
        return Q4Weight(*(t.contiguous() for t in rows))

    @staticmethod
    def cat(parts: Sequence[Q4Weight]) -> Q4Weight:
        """The rows of ``parts`` stacked (q, k, v into one qkv; gate and up)."""
        return Q4Weight(
            torch.cat([p.qs for p in parts]).contiguous(),
            torch.cat([p.d for p in parts]).contiguous(),
            torch.cat([p.m for p in parts]).contiguous(),
        )


@dataclass(frozen=True, slots=True)
class Q8Weight:
    """One ``[n, k]`` weight in Q8_0 blocks: ``qs`` ``[n, k/32, 32]`` int8, ``d``
    ``[n, k/32]`` float32; ``w = d * q``."""

    qs: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qs.shape[0]), int(self.qs.shape[1]) * _BLOCK

    @classmethod
    def from_blocks(cls, raw: np.ndarray, n: int, k: int) -> Q8Weight:
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // _BLOCK, _Q8_BYTES)
        scales = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)[:, :, 0]
        codes = blocks[:, :, 2:].copy().view(np.int8)
        return cls(torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scales)))

    def dequantize(self) -> torch.Tensor:
        return (self.qs.float() * self.d.unsqueeze(-1)).reshape(self.shape)

    def take_rows(self, order: np.ndarray) -> Q8Weight:
        index = torch.from_numpy(np.asarray(order, dtype=np.int64))
        return Q8Weight(self.qs[index].contiguous(), self.d[index].contiguous())


def read_gguf(path: str | Path, heads: int, kv_heads: int) -> dict[str, Q4Weight | Q8Weight]:
    """Every Q4_0, Q4_1 and Q8_0 matrix of the GGUF at ``path``, by its Hugging Face name, rows in
    Hugging Face's order (llama.cpp's interleaved RoPE rows of q and k undone, as the
    float32 conversion does)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    kinds: dict[Any, Callable[[np.ndarray, int, int], Q4Weight | Q8Weight]] = {
        gguf.GGMLQuantizationType.Q4_0: Q4Weight.from_q4_0_blocks,
        gguf.GGMLQuantizationType.Q4_1: Q4Weight.from_blocks,
        gguf.GGMLQuantizationType.Q8_0: Q8Weight.from_blocks,
    }
    out: dict[str, Q4Weight | Q8Weight] = {}
    for tensor in reader.tensors:
        parse = kinds.get(tensor.tensor_type)
        if parse is None or len(tensor.shape) != 2:
            continue
        k, n = (int(s) for s in tensor.shape)  # GGUF lists dims inner-first
        weight = parse(np.asarray(tensor.data), n, k)
        rest = tensor.name.split(".", 2)[-1]
        if arch == "llama" and rest in ("attn_q.weight", "attn_k.weight"):
            order = unpermute(np.arange(n), heads if rest == "attn_q.weight" else kv_heads)
            weight = weight.take_rows(order)
        out[hf_name(tensor.name)] = weight
    return out


@dataclass(frozen=True)
class QuantKernel:
    """``linear(x, weight)``: ``x`` ``[rows, k]`` float32 (rows may be strided) times a
    ``Q4Weight`` or ``Q8Weight`` ``[n, k]`` transposed -> ``[rows, n]`` float32."""

    path: str
    function: ctypes._CFuncPtr

    def linear(self, x: torch.Tensor, weight: Q4Weight | Q8Weight) -> torch.Tensor:
        n, k = weight.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, n), dtype=torch.float32)
        q4 = isinstance(weight, Q4Weight)
        code = self.function(
            x.data_ptr(), x.stride(0), rows, k, 0 if q4 else 1,
            weight.qs.data_ptr(), weight.d.data_ptr(), weight.m.data_ptr() if q4 else None, n,
            out.data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
        if code:
            raise RuntimeError(f"quantized matmul kernel refused its input: {_ERRORS.get(code)}")
        return out


def load_quant_kernel(root: str | Path | None = None) -> tuple[QuantKernel | None, str]:
    """The kernel (built on first use) and ``""``, or None and why not."""
    function, path, error = load_c_function(
        "quant_linear.c", "spec_tot_quant_linear", "the C quantized matmul kernel", root
    )
    if function is None:
        return None, error
    function.restype = ctypes.c_int
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, i64, i64, i64, ctypes.c_int, pointer, pointer, pointer, i64]
    function.argtypes += [pointer, i64, ctypes.c_int]
    return QuantKernel(path, function), ""


def quant_max_rows(
    kernel: QuantKernel,
    weight: Q4Weight | Q8Weight,
    dense: Callable[[torch.Tensor], torch.Tensor],
    candidates: Sequence[int] = (1, 2, 4, 8, 16),
    reps: int = 10,
) -> int:
    """The most rows at which ``kernel`` on ``weight`` measured faster than ``dense`` (the
    same matmul in float32), by at least 5%: 0 when it never is. Milliseconds, at load;
    the thread count is the engine's."""
    best = 0
    for rows in candidates:
        x = torch.randn(rows, weight.shape[1])

        def quantized(x: torch.Tensor = x) -> torch.Tensor:
            return kernel.linear(x, weight)

        def floats(x: torch.Tensor = x) -> torch.Tensor:
            return dense(x)

        times = []
        for run in (quantized, floats):
            run()
            started = time.perf_counter()
            for _ in range(reps):
                run()
            times.append(time.perf_counter() - started)
        if times[0] >= 0.95 * times[1]:
            break
        best = rows
    return best
