"""The attention metadata of a step's rows: block tables as slot indices, positions, and
the per-path layouts (``PagedMeta`` for the fused kernel, ``SparseMeta`` for sparse products
over the pool, ``DenseMeta`` for gathered contexts and SDPA), built once per step on the
model's device."""

from __future__ import annotations

import warnings
from collections.abc import Sequence as Seq
from typing import Any

import torch

from .attention import DenseMeta, PagedMeta, SparseMeta
from .host_copy import to_device
from .model import KVCache
from .step_rows import StepRow

__all__ = ["RAGGED_BELOW", "RAGGED_MIN_WASTE", "StepMeta"]

# A ragged pattern (no padding entries) when padding would be more than 15% of the work and
# more entries than its few extra ops per layer cost.
RAGGED_BELOW = 0.85
RAGGED_MIN_WASTE = 8192


class StepMeta:
    """Builds a step's index tensors and attention layouts for one model and KV pool."""

    def __init__(
        self, args: Any, cache: KVCache, device: str, dtype: torch.dtype, kernel: Any
    ) -> None:
        self.device = device
        self.block_size = cache.block_size
        self._kernel = kernel
        self._dtype = dtype
        self._scratch = cache.scratch_block
        self._slot_offsets = torch.arange(self.block_size, device=device)
        self._arange = torch.arange(args.max_position_embeddings + 1, device=device)
        self._heads, self._kv_heads = args.num_heads, args.num_kv_heads
        group = args.num_heads // args.num_kv_heads
        self._head_map = torch.arange(args.num_heads, device=device) // group
        self._pool_rows = cache.k[0].shape[0] * self.block_size * args.num_kv_heads
        self._zeros = torch.zeros(0, dtype=dtype, device=device)  # CSR pattern values
        with warnings.catch_warnings():  # torch warns once per process that CSR is "beta"
            warnings.simplefilter("ignore")
            empty = torch.zeros(1, dtype=torch.int64, device=device)
            torch.sparse_csr_tensor(empty, empty[:0], empty[:0].float(), size=(0, 1))

    def range(self, n: int) -> torch.Tensor:
        """``0..n-1`` (int64, on the device): a view of one range, grown on demand."""
        if self._arange.numel() < n:
            self._arange = torch.arange(2 * n, device=self.device)
        return self._arange[:n]

    def tensor(self, data: Seq[object]) -> torch.Tensor:
        return to_device(data, torch.int64, self.device)

    def _tables(self, rows: Seq[StepRow], blocks: int) -> torch.Tensor:
        """``[rows, blocks]`` block ids of each row (past a row's table: the scratch block)."""
        tables = []
        for row in rows:
            table = row.seq.block_table[:blocks]
            tables.append(table + [self._scratch] * (blocks - len(table)))
        return self.tensor(tables)

    def _gather_index(self, rows: Seq[StepRow], width: int) -> torch.Tensor:
        """``[rows, width]`` flat pool slots of positions ``0..width-1`` of each row (past a
        row's table: the scratch block)."""
        bs = self.block_size
        table_t = self._tables(rows, -(-width // bs))
        index = (table_t[:, :, None] * bs + self._slot_offsets).view(len(rows), -1)
        return index[:, :width]

    def _token_rows(self, rows: Seq[StepRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions of the rows' tokens, one per token, and (when a row has more than one:
        short prompt chunks, each token a query of its own) the row each token is of."""
        if all(row.num_tokens == 1 for row in rows):
            return self.tensor([row.start for row in rows]), None
        counts = self.tensor([row.num_tokens for row in rows])
        row_of = torch.repeat_interleave(self.range(len(rows)), counts)
        first = torch.cumsum(counts, 0) - counts
        starts = self.tensor([row.start for row in rows])
        positions = starts[row_of] + torch.arange(row_of.numel(), device=self.device)
        return positions - first[row_of], row_of

    def paged(self, rows: Seq[StepRow]) -> tuple[PagedMeta, torch.Tensor, torch.Tensor]:
        """Meta of rows whose tokens attend through the fused kernel (a token at position p
        sees slots 0..p), their write slots and positions."""
        assert self._kernel is not None  # attention == "paged" only with a kernel
        bs = self.block_size
        tables = self._tables(rows, -(-max(row.end for row in rows) // bs))
        positions, row_of = self._token_rows(rows)
        if row_of is not None:
            tables = tables.index_select(0, row_of)
        slots = tables.gather(1, (positions // bs)[:, None]).squeeze(1) * bs + positions % bs
        meta = PagedMeta(tables, positions + 1, positions.numel(), self._kernel)
        return meta, slots, positions

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros(allowed.shape, dtype=self._dtype, device=self.device)
        return zeros.masked_fill_(~allowed, float("-inf"))

    def sparse(self, rows: Seq[StepRow]) -> tuple[SparseMeta, torch.Tensor, torch.Tensor]:
        """Meta of rows whose tokens attend through the sparse path (one pattern row per
        token and head: a token at position p sees slots 0..p), their write slots and
        positions."""
        heads = self._heads
        width = max(row.end for row in rows)
        index = self._gather_index(rows, width)
        positions, row_of = self._token_rows(rows)
        if row_of is not None:
            index = index[row_of]
        n = positions.numel()
        slots = index.gather(1, positions[:, None]).squeeze(1)
        cols = (index[:, None, :] * self._kv_heads + self._head_map[None, :, None]).view(-1)
        allowed = self.range(width)[None, :] <= positions[:, None]
        flat = mask = None
        # entries a ragged pattern holds (per head): sum of p + 1 over every token
        used = sum(r.num_tokens * r.start + r.num_tokens * (r.num_tokens + 1) // 2 for r in rows)
        waste = n * width - used
        if waste > (1 - RAGGED_BELOW) * n * width and waste * heads > RAGGED_MIN_WASTE:
            lengths = (positions + 1).repeat_interleave(heads)
            crow = torch.zeros(n * heads + 1, dtype=torch.int64, device=self.device)
            torch.cumsum(lengths, 0, out=crow[1:])
            keep = allowed[:, None, :].expand(n, heads, width).reshape(-1)
            flat = keep.nonzero().squeeze(1)
            cols = cols.index_select(0, flat)
        else:
            crow = self.range(n * heads + 1) * width
            mask = self._additive(allowed)[:, None, :]
        nnz = cols.numel()
        if self._zeros.numel() < nnz:
            self._zeros = torch.zeros(2 * nnz, dtype=self._dtype, device=self.device)
        pattern = torch.sparse_csr_tensor(
            crow,
            cols,
            self._zeros[:nnz],
            size=(n * heads, self._pool_rows),
            check_invariants=False,
        )
        return SparseMeta(pattern, crow, cols, mask, width, n, flat), slots, positions

    def dense(
        self, rows: Seq[StepRow], first_token: int
    ) -> tuple[DenseMeta, torch.Tensor, torch.Tensor]:
        """Meta for a group of rows, their write slots and positions (packed order)."""
        n_rows = len(rows)
        q_lens = [row.num_tokens for row in rows]
        q_max, total = max(q_lens), sum(q_lens)
        width = max(row.end for row in rows)
        index = self._gather_index(rows, width)
        starts = self.tensor([row.start for row in rows])
        offsets = self.range(q_max)
        positions_pad = starts[:, None] + offsets[None, :]  # [rows, q_max]
        if all(q == q_max for q in q_lens):
            valid = None
            positions = positions_pad.reshape(-1)
            slots = index.gather(1, positions_pad).reshape(-1)
        else:
            valid = offsets[None, :] < self.tensor(q_lens)[:, None]
            positions = positions_pad[valid]
            slots = index.gather(1, positions_pad.clamp(max=width - 1))[valid]
        if n_rows == 1 and (rows[0].start == 0 or q_max == 1):
            mask = None  # plain causal from slot 0 (or one query seeing its whole context)
        else:
            allowed = self.range(width)[None, None, :] <= positions_pad[:, :, None]
            mask = self._additive(allowed).unsqueeze(1)
        meta = DenseMeta(first_token, total, q_max, index, mask)
        if valid is not None:
            flat = torch.arange(n_rows * q_max, device=self.device).view(n_rows, q_max)
            token = torch.cumsum(self.tensor([0, *q_lens[:-1]]), 0)[:, None] + offsets[None, :]
            meta.q_index = torch.where(valid, token, 0)
            meta.out_index = flat[valid]
        return meta, slots, positions
