"""What a speculative LangGraph run returns beside the graph's own output."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["LangGraphMetrics", "LangGraphResult", "TaskRecord", "TaskStatus"]

# committed: run on the real path; adopted: a speculative run the real step took over;
# cancelled: speculative, cancelled (mis-predicted or pruned); unused: speculative, finished,
# never adopted; failed: speculative, raised (the real step re-ran the task if it needed it).
TaskStatus = Literal["committed", "adopted", "cancelled", "unused", "failed"]


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """One task of the run. ``id`` is ``<step>:<node>:<n>``; ``parent`` is the task whose
    ``Send`` started it (None for edge-triggered tasks). Times are seconds from the run's
    start; ``started_s`` of an adopted task is when it started speculatively."""

    id: str
    node: str
    step: int
    parent: str | None
    status: TaskStatus
    started_s: float
    finished_s: float | None

    @property
    def speculative(self) -> bool:
        return self.status != "committed"


@dataclass(frozen=True, slots=True)
class LangGraphMetrics:
    """``speculative``: tasks started ahead of their superstep; ``adopted``: of those, the
    ones a real step took over (``hit_rate`` = adopted / speculative)."""

    wall_s: float
    steps: int
    committed: int
    speculative: int
    adopted: int
    cancelled: int
    unused: int
    failed: int

    @property
    def hit_rate(self) -> float:
        return self.adopted / self.speculative if self.speculative else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass(frozen=True, slots=True)
class LangGraphResult:
    """The graph's output (``state``: what ``invoke`` returns), every task of the run as a
    tree (``tasks``, children after parents), and the run's figures."""

    state: Any
    tasks: tuple[TaskRecord, ...]
    metrics: LangGraphMetrics

    def children(self, task_id: str | None) -> list[TaskRecord]:
        return [t for t in self.tasks if t.parent == task_id]

    def by_status(self) -> Mapping[str, int]:
        counts: dict[str, int] = {}
        for task in self.tasks:
            counts[task.status] = counts.get(task.status, 0) + 1
        return counts
