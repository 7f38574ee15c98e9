"""Turns a step plan into packed model inputs and runs one forward pass.

Tokens are packed row after row, decode rows first (a verify row of token speculation is a
decode row of ``1 + k`` tokens: its last token and the drafted ones). Block tables become
slot indices once per step (one small tensor build per group of rows); nothing here loops
over layers, and the per-row Python work is reading a few ints and slicing a few lists.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from spec_tot.errors import ConfigError

from ..config import ATTENTION_MODES
from ..engine.sequence import ScheduledRow
from ..stage_clock import GpuTimer, StageClock
from .attention import DenseMeta, GatherPagedKernel, PagedKernel, PagedMeta, SparseMeta
from .cuda_graphs import GraphedDecode
from .host_copy import to_device
from .model import DecoderModel, KVCache, StepInputs
from .paged_kernel import load_paged_kernel
from .triton_paged import TritonPagedKernel, load_triton_kernel

__all__ = ["ATTENTION_MODES", "ModelRunner"]

_log = logging.getLogger("spec_tot.engine")

# Prompt chunks of at most this many tokens join the decode rows on an in-place path.
SPARSE_CHUNK_TOKENS = 32
# A ragged pattern (no padding entries) when padding would be more than 15% of the work and
# more entries than its few extra ops per layer cost.
RAGGED_BELOW = 0.85
RAGGED_MIN_WASTE = 8192


def _choose_attention(
    attention: str, device: str, dtype: torch.dtype
) -> tuple[str, PagedKernel | None, str]:
    """The decode path, its paged kernel (None off ``"paged"``) and why ``"auto"`` fell back:
    the C kernel on CPU in float32, the Triton kernel on CUDA; sparse (CPU) or gather
    (elsewhere) where neither loads."""
    kernel: PagedKernel | None = None
    note = ""
    cpu_in_place = device == "cpu" and dtype == torch.float32
    if attention in ("auto", "paged"):
        if cpu_in_place:
            kernel, note = load_paged_kernel()
        elif device.startswith("cuda"):
            kernel, note = load_triton_kernel(device)
            if kernel is None:  # still graph-safe: reads whole tables, no compiler
                _log.warning("paged decode on CUDA through torch gathers: %s", note)
                kernel = GatherPagedKernel()
        else:
            note = "no paged kernel for this device and dtype"
    if attention == "paged" and kernel is None:
        raise ConfigError(
            "attention",
            "'paged' needs float32 on CPU with a C compiler, or CUDA"
            + (f" ({note})" if note else ""),
        )
    if attention == "auto" and kernel is None and (cpu_in_place or device.startswith("cuda")):
        # once per engine: decode attention runs ~2-4x slower on the fallback
        _log.warning("paged decode kernel unavailable, using a fallback: %s", note)
    if attention == "auto":
        attention = "paged" if kernel else ("sparse" if cpu_in_place else "gather")
    return attention, kernel, note


class ModelRunner:
    """``attention``: ``"paged"`` runs decode rows through a fused kernel over the pool (the
    C kernel on CPU float32, Triton on CUDA; the default where it loads), ``"sparse"`` reads
    the pool in place through sparse products (the CPU fallback), ``"gather"`` gathers every
    context and runs SDPA. ``kernel_note`` says why ``"auto"`` fell back. ``cuda_graphs``
    (CUDA with the paged kernel): steps whose every token is on the paged path replay from
    CUDA graphs (``cuda_graphs.py``) up to ``max_graph_tokens`` tokens and ``max_len``."""

    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        device: str,
        attention: str = "auto",
        cuda_graphs: bool = False,
        max_len: int | None = None,
        max_graph_tokens: int = 512,
        clock: StageClock | None = None,
    ) -> None:
        self.model = model
        # "inputs" and "forward" laps of the caller's step clock; GPU time of the forwards
        self.clock = clock or StageClock()
        self.gpu = GpuTimer(device)
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size
        self._scratch = cache.scratch_block
        self._slot_offsets = torch.arange(self.block_size, device=device)
        self._arange = torch.arange(model.args.max_position_embeddings + 1, device=device)
        args = model.args
        self._heads, self._kv_heads = args.num_heads, args.num_kv_heads
        group = args.num_heads // args.num_kv_heads
        self._head_map = torch.arange(args.num_heads, device=device) // group
        self._dtype = model.embed.dtype
        self.attention, self._kernel, self.kernel_note = _choose_attention(
            attention, device, self._dtype
        )
        # The Triton kernel takes prompt chunks of any length too (each token one query over
        # slots 0..p): every step then reads the pool in place, none gathers contexts for
        # SDPA (whose fused kernels on CUDA plan anew for each new shape), and any step up
        # to the largest bucket replays from a graph. The C kernel keeps long chunks apart.
        self._every_row_paged = isinstance(self._kernel, TritonPagedKernel)
        self.graphs: GraphedDecode | None = None
        if cuda_graphs and device.startswith("cuda"):
            if self.attention == "paged" and self._kernel is not None:
                longest = max_len or args.max_position_embeddings
                self.graphs = GraphedDecode(
                    model, cache, self._kernel, max_graph_tokens, -(-longest // self.block_size)
                )
            else:
                self.kernel_note = self.kernel_note or "cuda_graphs needs attention='paged'"
                _log.warning("CUDA graphs off: %s", self.kernel_note)
        self._pool_rows = cache.k[0].shape[0] * self.block_size * args.num_kv_heads
        self._zeros = torch.zeros(0, dtype=self._dtype, device=device)  # CSR pattern values
        with warnings.catch_warnings():  # torch warns once per process that CSR is "beta"
            warnings.simplefilter("ignore")
            empty = torch.zeros(1, dtype=torch.int64, device=device)
            torch.sparse_csr_tensor(empty, empty[:0], empty[:0].float(), size=(0, 1))

    def _range(self, n: int) -> torch.Tensor:
        """``0..n-1`` (int64, on the device): a view of one range, grown on demand."""
        if self._arange.numel() < n:
            self._arange = torch.arange(2 * n, device=self.device)
        return self._arange[:n]

    def _tensor(self, data: Seq[object]) -> torch.Tensor:
        return to_device(data, torch.int64, self.device)

    def _tables(self, rows: Seq[ScheduledRow], blocks: int) -> torch.Tensor:
        """``[rows, blocks]`` block ids of each row (past a row's table: the scratch block)."""
        tables = []
        for row in rows:
            table = row.seq.block_table[:blocks]
            tables.append(table + [self._scratch] * (blocks - len(table)))
        return self._tensor(tables)

    def _gather_index(self, rows: Seq[ScheduledRow], width: int) -> torch.Tensor:
        """``[rows, width]`` flat pool slots of positions ``0..width-1`` of each row (past a
        row's table: the scratch block)."""
        bs = self.block_size
        table_t = self._tables(rows, -(-width // bs))
        index = (table_t[:, :, None] * bs + self._slot_offsets).view(len(rows), -1)
        return index[:, :width]

    def _token_rows(self, rows: Seq[ScheduledRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions of the rows' tokens, one per token, and (when a row has more than one:
        short prompt chunks, each token a query of its own) the row each token is of."""
        if all(row.num_tokens == 1 for row in rows):
            return self._tensor([row.start for row in rows]), None
        counts = self._tensor([row.num_tokens for row in rows])
        row_of = torch.repeat_interleave(self._range(len(rows)), counts)
        first = torch.cumsum(counts, 0) - counts
        starts = self._tensor([row.start for row in rows])
        positions = starts[row_of] + torch.arange(row_of.numel(), device=self.device)
        return positions - first[row_of], row_of

    def _paged_meta(self, rows: Seq[ScheduledRow]) -> tuple[PagedMeta, torch.Tensor, torch.Tensor]:
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

    def _sparse_meta(
        self, rows: Seq[ScheduledRow]
    ) -> tuple[SparseMeta, torch.Tensor, torch.Tensor]:
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
        allowed = self._range(width)[None, :] <= positions[:, None]
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
            crow = self._range(n * heads + 1) * width
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

    def _dense_meta(
        self, rows: Seq[ScheduledRow], first_token: int
    ) -> tuple[DenseMeta, torch.Tensor, torch.Tensor]:
        """Meta for a group of rows, their write slots and positions (packed order)."""
        n_rows = len(rows)
        q_lens = [row.num_tokens for row in rows]
        q_max, total = max(q_lens), sum(q_lens)
        width = max(row.end for row in rows)
        index = self._gather_index(rows, width)
        starts = self._tensor([row.start for row in rows])
        offsets = self._range(q_max)
        positions_pad = starts[:, None] + offsets[None, :]  # [rows, q_max]
        if all(q == q_max for q in q_lens):
            valid = None
            positions = positions_pad.reshape(-1)
            slots = index.gather(1, positions_pad).reshape(-1)
        else:
            valid = offsets[None, :] < self._tensor(q_lens)[:, None]
            positions = positions_pad[valid]
            slots = index.gather(1, positions_pad.clamp(max=width - 1))[valid]
        if n_rows == 1 and (rows[0].start == 0 or q_max == 1):
            mask = None  # plain causal from slot 0 (or one query seeing its whole context)
        else:
            allowed = self._range(width)[None, None, :] <= positions_pad[:, :, None]
            mask = self._additive(allowed).unsqueeze(1)
        meta = DenseMeta(first_token, total, q_max, index, mask)
        if valid is not None:
            flat = torch.arange(n_rows * q_max, device=self.device).view(n_rows, q_max)
            token = torch.cumsum(self._tensor([0, *q_lens[:-1]]), 0)[:, None] + offsets[None, :]
            meta.q_index = torch.where(valid, token, 0)
            meta.out_index = flat[valid]
        return meta, slots, positions

    def _split(
        self, rows: Seq[ScheduledRow], num_decode: int
    ) -> tuple[list[ScheduledRow], list[ScheduledRow]]:
        """Rows for the sparse path (decode rows, and beside them short prompt chunks: a
        chunk of a few tokens costs less there than a gather and SDPA of its own) and the
        rest (prompts alone run faster through SDPA)."""
        if self._every_row_paged:
            return list(rows), []
        if self.attention not in ("sparse", "paged") or not num_decode:
            return [], list(rows)
        small = [r for r in rows[num_decode:] if r.num_tokens <= SPARSE_CHUNK_TOKENS]
        if len(small) == len(rows) - num_decode:
            return list(rows), []
        return [*rows[:num_decode], *small], [
            r for r in rows[num_decode:] if r.num_tokens > SPARSE_CHUNK_TOKENS
        ]

    def prepare(
        self, rows: Seq[ScheduledRow], num_decode: int
    ) -> tuple[StepInputs, torch.Tensor | None]:
        """The step's inputs, and (when the rows had to be reordered: sparse tokens first)
        where each token of the plan's packed order went."""
        sparse_rows, dense_rows = self._split(rows, num_decode)
        ordered = [*sparse_rows, *dense_rows]
        perm = None
        if any(a is not b for a, b in zip(ordered, rows, strict=True)):
            where = {id(r): i for i, r in enumerate(ordered)}
            offsets, total = [], 0
            for row in ordered:
                offsets.append(total)
                total += row.num_tokens
            perm = self._tensor(
                [offsets[where[id(r)]] + k for r in rows for k in range(r.num_tokens)]
            )
        ids: list[int] = []
        for row in ordered:
            if row.num_tokens == 1:
                ids.append(row.seq.token_ids[row.start])
            else:  # a prompt chunk, or a verify row: its last token and the drafted ones
                ids.extend(row.input_ids())
        slot_parts, pos_parts = [], []
        sparse: SparseMeta | PagedMeta | None = None
        dense: list[DenseMeta] = []
        if sparse_rows:
            in_place = self._paged_meta if self.attention == "paged" else self._sparse_meta
            sparse, slots, pos = in_place(sparse_rows)
            slot_parts.append(slots)
            pos_parts.append(pos)
        decode = dense_rows[:num_decode] if not sparse_rows else []
        groups = [decode, dense_rows[len(decode) :]]
        first = sparse.num_rows if sparse is not None else 0
        for group in groups:
            if group:
                meta, slots, pos = self._dense_meta(group, first)
                dense.append(meta)
                slot_parts.append(slots)
                pos_parts.append(pos)
                first += meta.num_tokens
        slots_t = slot_parts[0] if len(slot_parts) == 1 else torch.cat(slot_parts)
        positions = pos_parts[0] if len(pos_parts) == 1 else torch.cat(pos_parts)
        cos, sin = self.model.rope(positions)
        return StepInputs(self._tensor(ids), slots_t, cos, sin, sparse, tuple(dense)), perm

    @torch.inference_mode()
    def run(
        self,
        rows: Seq[ScheduledRow],
        num_decode: int,
        logit_tokens: Seq[int],
        cow: list[tuple[int, int]],
    ) -> torch.Tensor:
        """Copy-on-write copies first, then the forward; returns ``[len(logit_tokens),
        vocab]`` float32 logits of the given packed token indices."""
        clock, gpu = self.clock, self.gpu
        self.cache.copy_blocks(cow)
        graphs = self.graphs
        if graphs is not None:
            bucket = graphs.bucket(rows) if self._all_paged(rows, num_decode) else None
            logits = graphs.run(rows, bucket, clock, gpu) if bucket is not None else None
            if logits is not None:
                logits = _select(logits, logit_tokens, self._tensor)
                clock.lap("forward")
                return logits
            graphs.eager_steps += 1
        step, perm = self.prepare(rows, num_decode)
        clock.lap("inputs")
        # eagerly the host launches kernel by kernel: the GPU's gaps between them count
        # as busy here (an upper bound; a replay's time is exact)
        gpu.begin()
        hidden = self.model(step, self.cache)
        if perm is not None:
            hidden = hidden.index_select(0, perm[self._tensor(logit_tokens)])
            logits = self.model.logits(hidden)
        else:
            logits = self.model.logits(_select(hidden, logit_tokens, self._tensor))
        gpu.end()
        clock.lap("forward")
        return logits

    @property
    def graph_token_limit(self) -> int | None:
        """The most tokens a step may have and still replay from a graph (None: no graphs)."""
        graphs = self.graphs
        return graphs.buckets[-1] if graphs is not None and graphs.enabled else None

    def _all_paged(self, rows: Seq[ScheduledRow], num_decode: int) -> bool:
        sparse_rows, dense_rows = self._split(rows, num_decode)
        return bool(sparse_rows) and not dense_rows and self.attention == "paged"


def _select(
    rows: torch.Tensor, tokens: Seq[int], tensor: Callable[[Seq[object]], torch.Tensor]
) -> torch.Tensor:
    """Rows ``tokens`` of ``rows`` (no copy when they are every row, in order: decode-only
    steps)."""
    every = len(tokens) == rows.shape[0] and all(t == i for i, t in enumerate(tokens))
    return rows if every else rows.index_select(0, tensor(tokens))
