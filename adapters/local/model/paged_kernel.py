"""The fused paged decode-attention kernel (``csrc/paged_decode.c``), built on first use
(``c_kernels.py``: how, where, for which CPU).

Where no compiler is found or the build fails, ``load_paged_kernel`` returns None with the
reason and the engine keeps the sparse path (same results up to float rounding, tested).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_tot.progress import note

from .c_kernels import NO_COMPILER, load_c_function

__all__ = ["PagedDecodeKernel", "load_paged_kernel"]

_SOURCE = "paged_decode.c"
_SYMBOL = "spec_tot_paged_decode"
_ERRORS = {
    -1: "bad shape",
    -2: "more than 64 query heads per KV head",
    -3: "a context longer than its block table",
    -4: "a block id outside the pool",
    -5: "out of memory",
}


@dataclass(frozen=True)
class PagedDecodeKernel:
    """``attend(q, k_pool, v_pool, tables, lengths, scale)``: ``q`` ``[n, Hq, D]`` (rows
    may be strided, heads and dims contiguous), pools ``[blocks, block_size, Hkv, D]``,
    ``tables`` ``[n, max_blocks]`` int64 block ids, ``lengths`` ``[n]`` int64 context
    lengths (row ``i`` sees slots ``0 .. lengths[i] - 1``) -> ``[n, Hq, D]``. float32 on
    CPU only; the caller checks that (``supports``)."""

    path: str
    function: ctypes._CFuncPtr

    @staticmethod
    def supports(q: torch.Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype == torch.float32

    def attend(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        n, heads, dim = q.shape
        blocks, block_size, kv_heads, _ = k_pool.shape
        if q.stride(2) != 1 or q.stride(1) != dim:
            q = q.contiguous()
        out = torch.empty((n, heads, dim), dtype=q.dtype)
        code = self.function(
            q.data_ptr(),
            q.stride(0),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            lengths.data_ptr(),
            out.data_ptr(),
            n,
            heads,
            kv_heads,
            dim,
            block_size,
            blocks,
            scale,
            torch.get_num_threads(),
        )
        if code:
            raise RuntimeError(f"paged decode kernel refused its input: {_ERRORS.get(code, code)}")
        return out


def load_paged_kernel(root: str | Path | None = None) -> tuple[PagedDecodeKernel | None, str]:
    """The kernel (built into ``root/kernels`` when not yet there) and ``""``, or None and
    why not."""
    function, path, error = load_c_function(_SOURCE, _SYMBOL, "the C decode kernel", root)
    if function is None:
        if error != NO_COMPILER:
            note(f"no C decode kernel ({error}): decode attention runs in PyTorch, slower")
        return None, error
    function.restype = ctypes.c_int
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, i64, pointer, pointer, pointer, i64, pointer, pointer]
    function.argtypes += [i64] * 6 + [ctypes.c_float, ctypes.c_int]
    return PagedDecodeKernel(path, function), ""
