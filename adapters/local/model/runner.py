"""Turns a step plan into packed model inputs and runs one forward pass.

Tokens are packed row after row, decode rows first (a verify row of token speculation is a
decode row of ``1 + k`` tokens: its last token and the drafted ones). Block tables become
slot indices once per step (one small tensor build per group of rows); nothing here loops
over layers, and the per-row Python work is reading a few ints and slicing a few lists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from spec_tot.errors import ConfigError

from ..config import ATTENTION_MODES
from ..stage_clock import GpuTimer, StageClock
from .attention import DenseMeta, GatherPagedKernel, PagedKernel, PagedMeta, SparseMeta
from .cuda_graphs import GraphedDecode
from .model import DecoderModel, KVCache, StepInputs
from .paged_kernel import load_paged_kernel
from .step_meta import StepMeta
from .step_rows import StepRow
from .triton_paged import TritonPagedKernel, load_triton_kernel

__all__ = ["ATTENTION_MODES", "ModelRunner"]

_log = logging.getLogger("spec_tot.engine")

# Prompt chunks of at most this many tokens join the decode rows on an in-place path.
SPARSE_CHUNK_TOKENS = 32


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
        args = model.args
        self.attention, self._kernel, self.kernel_note = _choose_attention(
            attention, device, model.embed.dtype
        )
        self.meta = StepMeta(model.args, cache, device, model.embed.dtype, self._kernel)
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

    def _split(self, rows: Seq[StepRow], num_decode: int) -> tuple[list[StepRow], list[StepRow]]:
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
        self, rows: Seq[StepRow], num_decode: int
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
            perm = self.meta.tensor(
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
            in_place = self.meta.paged if self.attention == "paged" else self.meta.sparse
            sparse, slots, pos = in_place(sparse_rows)
            slot_parts.append(slots)
            pos_parts.append(pos)
        decode = dense_rows[:num_decode] if not sparse_rows else []
        groups = [decode, dense_rows[len(decode) :]]
        first = sparse.num_rows if sparse is not None else 0
        for group in groups:
            if group:
                meta, slots, pos = self.meta.dense(group, first)
                dense.append(meta)
                slot_parts.append(slots)
                pos_parts.append(pos)
                first += meta.num_tokens
        slots_t = slot_parts[0] if len(slot_parts) == 1 else torch.cat(slot_parts)
        positions = pos_parts[0] if len(pos_parts) == 1 else torch.cat(pos_parts)
        cos, sin = self.model.rope(positions)
        return StepInputs(self.meta.tensor(ids), slots_t, cos, sin, sparse, tuple(dense)), perm

    @torch.inference_mode()
    def run(
        self,
        rows: Seq[StepRow],
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
                logits = _select(logits, logit_tokens, self.meta.tensor)
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
            hidden = hidden.index_select(0, perm[self.meta.tensor(logit_tokens)])
            logits = self.model.logits(hidden)
        else:
            logits = self.model.logits(_select(hidden, logit_tokens, self.meta.tensor))
        gpu.end()
        clock.lap("forward")
        return logits

    @property
    def graph_token_limit(self) -> int | None:
        """The most tokens a step may have and still replay from a graph (None: no graphs)."""
        graphs = self.graphs
        return graphs.buckets[-1] if graphs is not None and graphs.enabled else None

    def _all_paged(self, rows: Seq[StepRow], num_decode: int) -> bool:
        sparse_rows, dense_rows = self._split(rows, num_decode)
        return bool(sparse_rows) and not dense_rows and self.attention == "paged"


def _select(
    rows: torch.Tensor, tokens: Seq[int], tensor: Callable[[Seq[object]], torch.Tensor]
) -> torch.Tensor:
    """Rows ``tokens`` of ``rows`` (no copy when they are every row, in order: decode-only
    steps)."""
    every = len(tokens) == rows.shape[0] and all(t == i for i, t in enumerate(tokens))
    return rows if every else rows.index_select(0, tensor(tokens))
