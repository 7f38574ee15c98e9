"""Decode steps replayed from CUDA graphs, one graph per padded token-count bucket.

On a GPU a small model's decode step is launch-bound: a few hundred kernel launches from
Python for a fraction of a millisecond of GPU work. As vLLM and SGLang do, the forward of a
step whose every token attends through the paged kernel (decode rows, verify rows of token
speculation, short prompt chunks: each token is one query with its own table row and
length, ``triton_paged.py``) is captured once per bucket of token counts and replayed.

What a step varies lives in one static device buffer ``[max_tokens, 3 + max_blocks]``
(int64, token-major: id, position, slot, then the token's block-table row), written on the
host into a pinned twin and copied up in one transfer of the bucket's rows. Padding tokens
(bucket minus real tokens) read one slot of the scratch block and write there: nothing real
is read or written by them. Everything else a layer needs (RoPE rows, context lengths) is
computed inside the graph from that buffer, so a replay has no host synchronisation; the
step's one synchronisation is the sampler reading its draws.

The engine captures every bucket when it starts (``capture_all``; warm-up runs on a side
stream, as ``torch.cuda.graph`` asks, over padding only); a bucket still missing is captured
the first time a step needs it (its warm-up writes the same K/V the replay writes). If a
capture fails, graphs are turned off for the engine with a warning and every step runs
eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from ..stage_clock import GpuTimer, StageClock
from .attention import PagedKernel, PagedMeta
from .model import DecoderModel, KVCache, StepInputs
from .step_rows import StepRow

__all__ = ["GraphStats", "GraphedDecode", "StepBuffer", "graph_buckets"]

_log = logging.getLogger("spec_tot.engine")

# Columns of the step buffer before the block table.
_ID, _POS, _SLOT, _TABLE = 0, 1, 2, 3


def graph_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token counts a graph is captured for: 1, 2, 4, 8, then every multiple of 16 up to
    ``max_tokens`` (itself included). Padding wastes at most 15 tokens' work once past 16,
    which on a GPU costs far less than the launches a graph saves."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = {n for n in (1, 2, 4, 8) if n <= max_tokens}
    sizes.update(range(16, max_tokens + 1, 16))
    sizes.add(max_tokens)
    return tuple(sorted(sizes))


def bucket_for(buckets: Seq[int], tokens: int) -> int | None:
    """The smallest bucket holding ``tokens``, or None past the largest."""
    for size in buckets:
        if size >= tokens:
            return size
    return None


class StepBuffer:
    """The host side of a graphed step: ``fill(rows, bucket)`` writes the rows' tokens into
    the pinned host array (padding past them), ``upload`` copies the bucket's rows into the
    device buffer the graphs read. Device-free logic: testable on CPU."""

    def __init__(
        self, max_tokens: int, max_blocks: int, block_size: int, scratch_block: int, device: str
    ) -> None:
        self.max_tokens, self.max_blocks = max_tokens, max_blocks
        self.block_size, self.scratch_block = block_size, scratch_block
        shape = (max_tokens, _TABLE + max_blocks)
        pin = device.startswith("cuda")
        self.host = torch.zeros(shape, dtype=torch.int64, pin_memory=pin)
        self.rows = self.host.numpy()
        self.device = torch.zeros(shape, dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None

    def fits(self, rows: Seq[StepRow]) -> bool:
        """Every row's context within ``max_blocks`` blocks."""
        return all(row.end <= self.max_blocks * self.block_size for row in rows)

    def fill(self, rows: Seq[StepRow], bucket: int) -> int:
        """Write the rows' tokens (packed order) and pad to ``bucket``; returns the count."""
        if self._copied is not None:  # the last upload has left the pinned array
            self._copied.synchronize()
        buf, bs = self.rows, self.block_size
        t = 0
        for row in rows:
            seq, start = row.seq, row.start
            blocks = -(-row.end // bs)
            table = seq.block_table[:blocks]
            if row.num_tokens == 1:
                buf[t, _ID] = seq.token_ids[start]
                buf[t, _POS] = start
                buf[t, _SLOT] = table[start // bs] * bs + start % bs
                buf[t, _TABLE : _TABLE + blocks] = table
                t += 1
                continue
            m = row.num_tokens
            positions = np.arange(start, start + m)
            table_np = np.asarray(table, dtype=np.int64)
            buf[t : t + m, _ID] = row.input_ids()
            buf[t : t + m, _POS] = positions
            buf[t : t + m, _SLOT] = table_np[positions // bs] * bs + positions % bs
            buf[t : t + m, _TABLE : _TABLE + blocks] = table_np
            t += m
        if t > bucket:
            raise ValueError(f"{t} tokens do not fit a bucket of {bucket}")
        pad = buf[t:bucket]
        pad[:, _ID] = 0
        pad[:, _POS] = 0
        pad[:, _SLOT] = self.scratch_block * bs
        pad[:, _TABLE] = self.scratch_block
        return t

    def upload(self, bucket: int) -> None:
        self.device[:bucket].copy_(self.host[:bucket], non_blocking=True)
        if self.device.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()


@dataclass(frozen=True, slots=True)
class GraphStats:
    graph_steps: int
    eager_steps: int
    graphs_captured: int
    padded_tokens: int


class GraphedDecode:
    """Captures and replays the paged-only step forward per bucket (see the module doc).
    ``run`` returns the logits of every token of the step (``[tokens, vocab]``, float32, a
    view of the graphs' one static output: valid until the next step)."""

    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        kernel: PagedKernel,
        max_tokens: int,
        max_blocks: int,
    ) -> None:
        self.model, self.cache, self.kernel = model, cache, kernel
        self.buckets = graph_buckets(max_tokens)
        device = str(cache.k[0].device)
        self.buffer = StepBuffer(
            self.buckets[-1], max_blocks, cache.block_size, cache.scratch_block, device
        )
        # every graph writes its logits into this one buffer: a graph's own output would
        # stay allocated for as long as the graph lives, one [n, vocab] per bucket (about
        # 5 GB over the buckets for a 152k vocabulary), where this is one [512, vocab]
        vocab = model.args.vocab_size
        self._logits = torch.empty((self.buckets[-1], vocab), dtype=torch.float32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: tuple[int, int] | None = None
        self.enabled = True
        self.note = ""
        self.graph_steps = self.eager_steps = self.padded_tokens = 0

    def bucket(self, rows: Seq[StepRow]) -> int | None:
        """The bucket this step would replay, or None (too many tokens, too long a context,
        or graphs off)."""
        if not self.enabled:
            return None
        size = bucket_for(self.buckets, sum(row.num_tokens for row in rows))
        return size if size is not None and self.buffer.fits(rows) else None

    def forward(self, n: int) -> torch.Tensor:
        """The bucket-``n`` forward from the device buffer, eagerly: what a capture records
        and a replay recomputes (``[n, vocab]`` logits, padding rows included)."""
        view = self.buffer.device[:n]
        positions = view[:, _POS]
        cos, sin = self.model.rope(positions)
        meta = PagedMeta(view[:, _TABLE:], positions + 1, n, self.kernel)
        step = StepInputs(view[:, _ID], view[:, _SLOT], cos, sin, meta, ())
        out = self._logits[:n]
        out.copy_(self.model.logits(self.model(step, self.cache)))
        return out

    def _capture(self, n: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self.forward(n)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.forward(n)
        self._pool = graph.pool()
        return graph, out

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every bucket now (largest first: the smaller ones reuse its memory pool),
        so no step pays for a capture; returns the seconds it took. A failure turns graphs
        off, as in ``run``."""
        started = time.perf_counter()
        for n in reversed(self.buckets):
            if n in self._graphs:
                continue
            self.buffer.fill([], n)  # padding only: the warm-up writes the scratch block
            self.buffer.upload(n)
            try:
                self._graphs[n] = self._capture(n)
            except Exception as exc:  # an op that cannot be captured on this build
                self._disable(n, exc)
                break
            # a graph's first launch also uploads it to the device (an H200 profile: 141 us
            # a launch on average over steps that mostly hit a bucket for the first time)
            self._graphs[n][0].replay()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    def _disable(self, bucket: int, exc: BaseException) -> None:
        self.enabled = False
        self.note = f"CUDA graph capture failed at {bucket} tokens: {exc!r}"
        _log.warning("%s; decode runs eagerly", self.note)

    def run(
        self, rows: Seq[StepRow], bucket: int, clock: StageClock, gpu: GpuTimer
    ) -> torch.Tensor | None:
        """The step's logits, or None when capturing failed (graphs are then off: the
        caller runs the step eagerly). Laps ``clock`` at "inputs" (and "capture"); ``gpu``
        times the transfer and the replay (queued back to back: GPU-busy time)."""
        tokens = self.buffer.fill(rows, bucket)
        clock.lap("inputs")
        gpu.begin()
        self.buffer.upload(bucket)
        entry = self._graphs.get(bucket)
        if entry is None:
            try:
                entry = self._graphs[bucket] = self._capture(bucket)
            except Exception as exc:  # an op that cannot be captured on this build
                self._disable(bucket, exc)
                return None
            clock.lap("capture")
        graph, out = entry
        graph.replay()
        gpu.end()
        self.graph_steps += 1
        self.padded_tokens += bucket - tokens
        return out[:tokens]

    def reset_counters(self) -> None:
        self.graph_steps = self.eager_steps = self.padded_tokens = 0

    def stats(self) -> GraphStats:
        return GraphStats(self.graph_steps, self.eager_steps, len(self._graphs), self.padded_tokens)
