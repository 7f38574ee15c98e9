"""One real superstep as a speculative run sees it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from spec_tot.langgraph._pregel import PregelExecutableTask, World

__all__ = ["StepView"]


@dataclass(eq=False)
class StepView:
    """The superstep ``step`` of LangGraph's loop: the state it started from (``world``, a
    copy taken while it ran), its tasks in path order, their record ids
    (``<step>:<node>:<i>``) and the writes of those that have finished."""

    step: int
    world: World | None  # None when the run does not speculate
    tasks: list[PregelExecutableTask]
    sends: list[Any]  # the step's pending Sends (a push task's path indexes them)
    started_s: float
    rids: dict[str, str] = field(default_factory=dict)
    null: list[PregelExecutableTask] | None = None  # its null step, once a pass needed it
    _finished: dict[str, list[Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.rids = {t.id: f"{self.step}:{t.name}:{i}" for i, t in enumerate(self.tasks)}
        for task in self.tasks:
            if task.writes:  # writes a resumed run kept: the loop does not run it again
                self._finished[task.id] = list(task.writes)

    def task(self, task_id: str) -> PregelExecutableTask | None:
        for task in self.tasks:
            if task.id == task_id:
                return task
        return None

    def finish(self, task: PregelExecutableTask) -> list[Any]:
        """Record that ``task`` finished; a copy of its writes (they are complete: the
        observer that calls this is the task's last writer)."""
        writes = list(task.writes)
        with self._lock:
            self._finished[task.id] = writes
        return writes

    def finished_writes(self) -> list[tuple[PregelExecutableTask, list[Any]]]:
        with self._lock:
            done = dict(self._finished)
        return [(t, done[t.id]) for t in self.tasks if t.id in done]
