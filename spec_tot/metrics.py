"""Run metrics: a mutable recorder during the run, a frozen summary after it."""

from __future__ import annotations

import asyncio
import dataclasses
import resource
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["METRIC_KEYS", "MetricsRecorder", "QueryRecord", "RunMetrics"]

METRIC_KEYS: tuple[str, ...] = (
    "queries",
    "solved",
    "accuracy",
    "wall_s",
    "queries_per_s",
    "output_tokens",
    "wasted_tokens",
    "tokens_per_s",
    "spec_hit_rate",
    "reward_calls",
    "reward_batch_tokens_mean",
    "peak_inflight",
    "peak_kv_blocks",
    "latency_p50_s",
    "latency_p99_s",
    "goodput",
)


@dataclass(frozen=True, slots=True)
class QueryRecord:
    query_id: str
    status: str  # ok | failed | cancelled | timeout
    solved: bool
    latency_s: float
    output_tokens: int
    wasted_tokens: int
    nodes: int


@dataclass(frozen=True, slots=True)
class RunMetrics:
    """One run's figures. ``to_dict`` has exactly ``METRIC_KEYS`` plus the extras below them.

    ``wasted_tokens`` counts tokens generated for nodes that ended cancelled (aborted, failed,
    mis-speculated) or that were speculative and never adopted. ``goodput`` is correct
    answers per second whose latency was within the deadline. Token-level speculative
    decoding, from the backend's stats (``with_backend_stats``; 0 where it reports none):
    ``draft_tokens`` verified, ``accepted_tokens`` of them kept, ``acceptance_rate`` their
    ratio, ``tokens_per_step`` output tokens per decode row and step (1.0 without drafts).
    Where the time went from the executor's side: ``executor_cpu_s`` (its own CPU),
    ``generation_pending_s`` / ``reward_pending_s`` (wall seconds with at least one
    generation / reward call outstanding).
    """

    queries: int
    solved: int
    accuracy: float
    wall_s: float
    queries_per_s: float
    output_tokens: int
    wasted_tokens: int
    tokens_per_s: float
    spec_hit_rate: float
    reward_calls: int
    reward_batch_tokens_mean: float
    peak_inflight: int
    peak_kv_blocks: int
    latency_p50_s: float
    latency_p99_s: float
    goodput: float
    failed: int = 0
    cancelled: int = 0
    speculative_nodes: int = 0
    speculative_hits: int = 0
    reward_items: int = 0
    nodes: int = 0
    executor_cpu_s: float = 0.0
    executor_cpu_us_per_token: float = 0.0
    generation_pending_s: float = 0.0
    reward_pending_s: float = 0.0
    peak_rss_mb: float = 0.0
    useful_tokens_per_s: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    tokens_per_step: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_backend_stats(self, stats: Mapping[str, float]) -> RunMetrics:
        """These figures plus the token-speculation ones a backend's ``stats()`` holds
        (``num_draft_tokens``, ``num_accepted_tokens``, ``num_decode_rows``,
        ``num_decode_tokens``: the embedded engine's, or what a server reported)."""
        drafted = int(stats.get("num_draft_tokens", 0))
        accepted = int(stats.get("num_accepted_tokens", 0))
        rows = stats.get("num_decode_rows", 0.0)
        return dataclasses.replace(
            self,
            draft_tokens=drafted,
            accepted_tokens=accepted,
            acceptance_rate=accepted / drafted if drafted else 0.0,
            tokens_per_step=stats.get("num_decode_tokens", 0.0) / rows if rows else 0.0,
        )


@dataclass
class MetricsRecorder:
    """Counters shared by every query of one run (single event loop: no locks needed)."""

    goodput_deadline_s: float = 60.0
    started: float = 0.0
    records: list[QueryRecord] = field(default_factory=list)
    reward_calls: int = 0
    reward_items: int = 0
    reward_tokens: int = 0
    inflight: int = 0
    committed_inflight: int = 0
    peak_inflight: int = 0
    speculative_nodes: int = 0
    speculative_hits: int = 0
    executor_cpu_s: float = 0.0
    # wall seconds (the loop's clock) with at least one generation / reward call outstanding:
    # beside ``executor_cpu_s``, where a run's time went from the executor's side
    generation_pending_s: float = 0.0
    reward_pending_s: float = 0.0
    rewards_outstanding: int = 0
    _generation_since: float = 0.0
    _reward_since: float = 0.0

    def request_started(self, *, speculative: bool = False) -> None:
        if not self.inflight:
            self._generation_since = _now()
        self.inflight += 1
        self.committed_inflight += not speculative
        self.peak_inflight = max(self.peak_inflight, self.inflight)

    def request_finished(self, *, speculative: bool = False) -> None:
        self.inflight -= 1
        self.committed_inflight -= not speculative
        if not self.inflight:
            self.generation_pending_s += _now() - self._generation_since

    def reward_call(self, items: int, tokens: int) -> None:
        self.reward_calls += 1
        self.reward_items += items
        self.reward_tokens += tokens

    def reward_started(self) -> None:
        if not self.rewards_outstanding:
            self._reward_since = _now()
        self.rewards_outstanding += 1

    def reward_finished(self) -> None:
        self.rewards_outstanding -= 1
        if not self.rewards_outstanding:
            self.reward_pending_s += _now() - self._reward_since

    def query_finished(self, record: QueryRecord) -> None:
        self.records.append(record)

    def summary(self, *, wall_s: float, peak_kv_blocks: int = 0) -> RunMetrics:
        """Figures of the run; ``wall_s`` is measured on the event loop's clock, which is
        virtual under the simulator."""
        wall = max(wall_s, 1e-9)
        queries = len(self.records)
        solved = sum(r.solved for r in self.records)
        output = sum(r.output_tokens for r in self.records)
        latencies = np.array([r.latency_s for r in self.records], dtype=float)
        on_time = sum(r.solved and r.latency_s <= self.goodput_deadline_s for r in self.records)
        return RunMetrics(
            queries=queries,
            solved=solved,
            accuracy=solved / queries if queries else 0.0,
            wall_s=wall,
            queries_per_s=queries / wall,
            output_tokens=output,
            wasted_tokens=sum(r.wasted_tokens for r in self.records),
            tokens_per_s=output / wall,
            spec_hit_rate=(
                self.speculative_hits / self.speculative_nodes if self.speculative_nodes else 0.0
            ),
            reward_calls=self.reward_calls,
            reward_batch_tokens_mean=(
                self.reward_tokens / self.reward_calls if self.reward_calls else 0.0
            ),
            peak_inflight=self.peak_inflight,
            peak_kv_blocks=peak_kv_blocks,
            latency_p50_s=float(np.percentile(latencies, 50)) if queries else 0.0,
            latency_p99_s=float(np.percentile(latencies, 99)) if queries else 0.0,
            goodput=on_time / wall,
            failed=sum(r.status == "failed" for r in self.records),
            cancelled=sum(r.status in ("cancelled", "timeout") for r in self.records),
            speculative_nodes=self.speculative_nodes,
            speculative_hits=self.speculative_hits,
            reward_items=self.reward_items,
            nodes=sum(r.nodes for r in self.records),
            executor_cpu_s=self.executor_cpu_s,
            executor_cpu_us_per_token=1e6 * self.executor_cpu_s / output if output else 0.0,
            generation_pending_s=self.generation_pending_s,
            reward_pending_s=self.reward_pending_s,
            peak_rss_mb=_peak_rss_mb(),
            useful_tokens_per_s=(output - sum(r.wasted_tokens for r in self.records)) / wall,
        )


def _now() -> float:
    """The running loop's clock (virtual under the simulator), else the monotonic clock."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


def _peak_rss_mb() -> float:
    """The process's peak resident set so far (Linux and macOS report it differently)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024
