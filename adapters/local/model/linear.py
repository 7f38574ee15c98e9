"""The decoder's linear layers, each computed by the kernel that measured fastest for it.

On CPU in float32, ``F.linear`` runs MKL's sgemm, which on this AMD EPYC (AVX-512) streams
the weights at 5-10 GB/s for 1-16 rows while a plain read streams 30 GB/s. oneDNN, with
each weight packed once into its blocked layout, ran SmolLM2-135M's matmuls (30 layers
plus the LM head, 540 MB) 1.6x faster than MKL at 1 row, 3.1x at 4, 2.4x at 16, 1.9x at 64,
1.5x at 1024 (``benchmarks/linear_kernels.py``, results/linear_kernels_smollm2.json). On
the random 4 x 128 Llama's small weights it gains little at 1-16 rows (1.03-1.13x) and pays
a fixed cost per call (about 20 us against MKL's 5-8 us for a 384 x 128 weight at one row):
a small weight goes to oneDNN only once the rows make the call big enough.

Both are float32 throughout (same dtype, same inputs; results agree to float32 rounding:
tested against transformers). oneDNN's result for a row does not depend on how many rows
share the call (tested), so a weight that always takes it is batch invariant.

The packed copies double the matmul weights' memory on CPU (the model keeps its own
tensors: the embedding lookup, a rebuild and the unpacked path read them). Everything else
(CUDA, other dtypes, oneDNN unavailable or ``torch.backends.mkldnn.enabled`` off) runs
``F.linear`` on the model's own weight: no copy is made.

With ``weights="gguf"`` a weight that ships quantized in the model's GGUF also has a
``QuantPath`` (``gguf_weights.py``): calls of few rows (a decode step) read its codes
instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ONEDNN_MIN_WEIGHT", "ONEDNN_MIN_WORK", "ONEDNN_PACK_ROWS", "Linear", "QuantPath"]

# A weight of at least this many elements takes oneDNN at every row count (its read
# dominates the fixed cost of a call).
ONEDNN_MIN_WEIGHT = 1 << 18
# A smaller weight takes oneDNN once rows x weight elements reach this.
ONEDNN_MIN_WORK = 1 << 21
# The row count oneDNN lays the packed weight out for (packed for 16 / 32 / 64 rows:
# 1.68 / 1.62 / 1.82x MKL at 1 row, 3.01 / 3.08 / 2.96x at 4, 1.73 / 1.91 / 1.84x at 64,
# 1.02 / 1.53 / 1.41x at 1024).
ONEDNN_PACK_ROWS = 32
_NEVER = 1 << 62


def _onednn_applies(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and bool(torch.backends.mkldnn.enabled)
    )


class QuantPath:
    """A weight's quantized twin as its GGUF ships it (``gguf_weights.Q4Weight`` /
    ``Q8Weight``) and the kernel that multiplies by it, taken for calls of at most
    ``max_rows`` rows (measured: ``DecoderModel.attach_quantized``)."""

    __slots__ = ("kernel", "max_rows", "weight")

    def __init__(self, weight: Any, kernel: Any, max_rows: int) -> None:
        self.weight, self.kernel, self.max_rows = weight, kernel, max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.kernel.linear(x, self.weight)
        return out


class Linear:
    """``y = x @ weight.T + bias`` over ``x`` ``[rows, in]``, and the same with an epilogue
    fused into the matmul where oneDNN runs it: ``silu(y)``, ``y * other``, ``y + other``
    (the product and the sum are bit for bit the unfused ones; oneDNN's silu differs from
    torch's by float32 rounding, about 1e-7 relative).

    ``weight`` and ``bias`` are read as given (views stay views); the packed copy is taken
    once, here: build the ``Linear`` after the weights are final, and again after any change
    of them. ``kernel(rows)`` names what a call of ``rows`` rows runs (``"onednn"`` or
    ``"torch"``); ``packed`` says whether oneDNN runs it at some row count.
    """

    __slots__ = ("_min_rows", "_packed", "_packed_bias", "bias", "quant", "weight")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, quant: QuantPath | None = None
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.quant = quant if bias is None else None  # the quantized kernel adds no bias
        self._packed: torch.Tensor | None = None
        self._packed_bias: torch.Tensor | None = None
        self._min_rows = _NEVER
        if _onednn_applies(weight):
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(
                    weight.detach(), ONEDNN_PACK_ROWS
                )
                if bias is not None:
                    self._packed_bias = bias.detach().clone()
            size = weight.numel()
            self._min_rows = 1 if size >= ONEDNN_MIN_WEIGHT else -(-ONEDNN_MIN_WORK // size)

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def kernel(self, rows: int) -> str:
        if self.quant is not None and rows <= self.quant.max_rows:
            return "gguf"
        return "onednn" if rows >= self._min_rows else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None and x.shape[0] <= self.quant.max_rows:
            return self.quant(x)
        if x.shape[0] >= self._min_rows:
            return self._onednn(x, "none")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ weight.T + bias)``."""
        if self.quant is not None and x.shape[0] <= self.quant.max_rows:
            return F.silu(self.quant(x))
        if x.shape[0] >= self._min_rows:
            return self._onednn(x, "swish")
        return F.silu(F.linear(x, self.weight, self.bias))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``(x @ weight.T + bias) * other`` (``other``: the output's shape)."""
        if self.quant is not None and x.shape[0] <= self.quant.max_rows:
            return self.quant(x).mul_(other)
        if x.shape[0] >= self._min_rows:
            return self._binary(x, other, "mul")
        return F.linear(x, self.weight, self.bias) * other

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``(x @ weight.T + bias) + other`` (a residual: the output's shape)."""
        if self.quant is not None and x.shape[0] <= self.quant.max_rows:
            return self.quant(x).add_(other)
        if x.shape[0] >= self._min_rows:
            return self._binary(x, other, "add")
        return F.linear(x, self.weight, self.bias) + other

    def _onednn(self, x: torch.Tensor, attr: str) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self._packed, self._packed_bias, attr, [], ""
        )
        return out

    def _binary(self, x: torch.Tensor, other: torch.Tensor, attr: str) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
            x, other, self._packed, self._packed_bias, attr
        )
        return out
