"""Paged decode attention on CUDA: a Triton kernel that reads the KV pool in place.

The CUDA twin of ``csrc/paged_decode.c``: each query token (a decode row, one position of a
verify row, or one token of a short prompt chunk) has its own block-table row and context
length, and attends to slots ``0..length-1`` of its table. One program per (token, query
head) walks the context ``BLOCK_N`` slots at a time with an online softmax, in float32: no
context is gathered, no mask or pattern is built, and the loop bound is read from device
memory, so one launch serves any lengths. That last point is what lets a decode step be
captured in a CUDA graph (``cuda_graphs.py``): nothing about the step's shape but the token
count reaches the host.

Triton is optional: ``load_triton_kernel`` returns None and the reason where it does not
import (CPU builds of torch ship without it); the engine then keeps the gather path. With
``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (how the tests check it).
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["TritonPagedKernel", "load_triton_kernel"]

# Context slots per inner iteration: a multiple of every block size we use (16) keeps each
# K/V tile to whole rows; 32 measured as a fair default for head_dim 64 on an H200's warps.
BLOCK_N = 32


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def paged_decode(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lengths_ptr,
        out_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_tab,
        stride_ot,
        stride_oh,
        BLOCK_SIZE: tl.constexpr,
        KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ) -> None:
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        kv_head = head // GROUP
        length = tl.load(lengths_ptr + tok).to(tl.int32)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + tok * stride_qt + head * stride_qh + d, mask=d_ok, other=0.0)
        q = q.to(tl.float32) * scale
        m_i = tl.zeros([], tl.float32) - float("inf")
        l_i = tl.zeros([], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for start in range(0, length, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            valid = offs < length
            block = tl.load(tables_ptr + tok * stride_tab + offs // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + offs % BLOCK_SIZE
            base = (slot * KV_HEADS + kv_head) * HEAD_DIM
            tile_ok = valid[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + base[:, None] + d[None, :], mask=tile_ok, other=0.0)
            s = tl.sum(k.to(tl.float32) * q[None, :], 1)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + base[:, None] + d[None, :], mask=tile_ok, other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        out = acc / l_i
        dest = out_ptr + tok * stride_ot + head * stride_oh + d
        tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=d_ok)

    return paged_decode


class TritonPagedKernel:
    """``attend`` has the signature of the C kernel's (``paged_kernel.PagedDecodeKernel``):
    ``q`` ``[n, Hq, D]``, pools ``[blocks, block_size, Hkv, D]``, ``tables`` ``[n, >=
    blocks of the longest context]``, ``lengths`` ``[n]`` -> ``[n, Hq, D]``. Launches only:
    no host synchronisation, no allocation but the output (graph-safe)."""

    def __init__(self, function: Any) -> None:
        self.function = function

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
        _, block_size, kv_heads, _ = k_pool.shape
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty((n, heads, dim), dtype=q.dtype, device=q.device)
        if n == 0:
            return out
        block_d = max(16, 1 << (dim - 1).bit_length())
        self.function[(n, heads)](
            q,
            k_pool,
            v_pool,
            tables,
            lengths,
            out,
            scale,
            q.stride(0),
            q.stride(1),
            tables.stride(0),
            out.stride(0),
            out.stride(1),
            BLOCK_SIZE=block_size,
            KV_HEADS=kv_heads,
            GROUP=heads // kv_heads,
            HEAD_DIM=dim,
            BLOCK_D=block_d,
            BLOCK_N=BLOCK_N,
        )
        return out


def load_triton_kernel(device: str) -> tuple[TritonPagedKernel | None, str]:
    """The kernel for ``device`` and an empty note, or None and why not. On CPU only under
    ``TRITON_INTERPRET=1`` (Triton's interpreter: tests). The kernel is compiled and checked
    here on a small case: Triton builds its launcher with the machine's C compiler on first
    use, and a failure there must turn the kernel down now, not fail a step later."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not device.startswith("cuda") and not interpret:
        return None, "Triton kernels run on CUDA (or on CPU under TRITON_INTERPRET=1)"
    try:
        kernel = TritonPagedKernel(_build())
        _probe(kernel, device)
        return kernel, ""
    except Exception as exc:  # ImportError, no compiler, a Triton too old for this kernel
        return None, f"triton unavailable: {exc!r}"


def _probe(kernel: TritonPagedKernel, device: str) -> None:
    """One (token, head) pair over three slots, against the softmax it must compute."""
    gen = torch.Generator().manual_seed(0)
    k_pool = torch.randn(2, 4, 1, 16, generator=gen)
    v_pool = torch.randn(2, 4, 1, 16, generator=gen)
    q = torch.randn(1, 1, 16, generator=gen)
    tables = torch.tensor([[1]])
    lengths = torch.tensor([3])
    got = kernel.attend(*(t.to(device) for t in (q, k_pool, v_pool, tables, lengths)), 0.25)
    weights = torch.softmax(k_pool[1, :3, 0] @ q[0, 0] * 0.25, dim=0)
    want = weights @ v_pool[1, :3, 0]
    if not torch.allclose(got.cpu()[0, 0], want, atol=1e-4):
        raise RuntimeError("the paged kernel disagrees with its reference on a probe")
