"""Paged decode-attention cases and a plain gather + SDPA reference, shared by the tests of
the C kernel and of the Triton kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attention_case", "reference_attention"]


def reference_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    _, block_size, kv_heads, dim = k_pool.shape
    out = []
    for i in range(q.shape[0]):
        length = int(lengths[i])
        slots = (tables[i][:, None] * block_size + torch.arange(block_size)).reshape(-1)
        slots = slots[:length]
        k = k_pool.reshape(-1, kv_heads, dim)[slots].transpose(0, 1)[None]
        v = v_pool.reshape(-1, kv_heads, dim)[slots].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            q[i][None, :, None, :], k, v, scale=scale, enable_gqa=True
        )
        out.append(o[0, :, 0, :])
    return torch.stack(out)


def attention_case(
    n: int, heads: int, kv_heads: int, dim: int, longest: int, seed: int, block_size: int = 16
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-longest // block_size)
    pool = n * blocks + 3
    k_pool = torch.randn(pool, block_size, kv_heads, dim, generator=gen)
    v_pool = torch.randn(pool, block_size, kv_heads, dim, generator=gen)
    # rows share no block, in a shuffled order; a row's unused entries point anywhere valid
    tables = torch.randperm(pool, generator=gen)[: n * blocks].view(n, blocks).contiguous()
    lengths = torch.randint(1, longest + 1, (n,), generator=gen)
    lengths[0] = longest  # one row fills its table, block boundary included
    # queries as the model hands them: a slice of a wider [T, Hq + Hkv, D] tensor
    qk = torch.randn(n, heads + kv_heads, dim, generator=gen)
    return qk[:, :heads], k_pool, v_pool, tables, lengths
