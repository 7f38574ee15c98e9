"""What a run returns: one ``ToTResult`` per query, and a ``BatchResult`` with the run's
metrics. A leaf module (the app and the executor both build these)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from spec_tot.metrics import RunMetrics
from spec_tot.tree import SearchTree

__all__ = ["BatchResult", "ToTResult"]


@dataclass(frozen=True)
class ToTResult:
    """One query's outcome. ``status`` is ok, failed or timeout (a cancelled query raises
    ``asyncio.CancelledError``); the partial tree is kept in every case."""

    query_id: str
    answer: str | None
    score: float | None
    solved: bool
    status: str
    tree: SearchTree
    latency_s: float
    errors: tuple[str, ...] = ()
    truncated: bool = False
    votes: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchResult:
    results: list[ToTResult]
    metrics: RunMetrics
