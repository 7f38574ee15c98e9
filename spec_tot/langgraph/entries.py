"""What the speculator keeps: its speculative runs (``Entry``), how they are matched to
real tasks (node and input, on the node's ``reads``), and which task emitted each ``Send``
(the task tree)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from spec_tot.branch import BranchContext
from spec_tot.langgraph._pregel import PregelExecutableTask, sends_in
from spec_tot.langgraph.replay import EventLog
from spec_tot.langgraph.roles import NodeRole
from spec_tot.langgraph.slots import Lease

__all__ = ["Entry", "SendOwners", "equal_inputs", "match_key"]


class SendOwners:
    """Which task wrote each pending ``Send`` (the parent of the task it starts)."""

    def __init__(self) -> None:
        self._owners: dict[int, tuple[Any, str]] = {}

    def record(self, writes: Iterable[tuple[str, Any]], owner: str) -> None:
        for send in sends_in(writes):
            self._owners[id(send)] = (send, owner)  # keep the Send alive: ids stay unique

    def parent(self, sends: Sequence[Any], task: PregelExecutableTask) -> str | None:
        """The owner of the ``Send`` that started ``task``, given the step's pending
        ``sends`` (a push task's path indexes them)."""
        path = task.path
        if len(path) < 2 or not isinstance(path[1], int) or path[1] >= len(sends):
            return None
        hit = self._owners.get(id(sends[path[1]]))
        return hit[1] if hit is not None else None


@dataclass(eq=False)
class Entry:
    """One speculative task: predicted for superstep ``step`` on input ``key``."""

    id: str
    serial: int  # launch order within the run
    node: str
    step: int
    key: Any
    task: PregelExecutableTask
    branch: BranchContext
    exact: bool  # predicted from the real partial pool through complete steps only
    parent: str | None
    started_s: float
    log: EventLog = field(default_factory=EventLog)
    pool: Executor | None = None  # where a sync node function runs
    future: asyncio.Task[Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)  # the run ended
    threads: list[Future[Any]] = field(default_factory=list)  # its sync calls on threads
    output: Any = None  # a private copy of what the node returned
    has_output: bool = False
    adopted: bool = False
    cancelled: bool = False
    lease: Lease | None = None  # the slot it runs in (spec_tot.langgraph.slots)
    wanted: bool = True  # the latest pass that reached its step still uses it
    frozen: bool = False  # ``key`` is a private copy (taken before an impure task ran)
    finished_s: float | None = None

    def is_speculative(self) -> bool:
        return self.branch.speculative and not self.cancelled

    @property
    def running(self) -> bool:
        f = self.future
        return f is not None and not f.done() and not self.adopted and not self.cancelled

    @property
    def ok(self) -> bool:
        f = self.future
        return (
            f is not None
            and f.done()
            and not f.cancelled()
            and f.exception() is None
            and self.has_output
        )

    @property
    def failed(self) -> bool:
        f = self.future
        return f is not None and f.done() and not f.cancelled() and f.exception() is not None


def match_key(role: NodeRole | None, value: Any) -> Any:
    if role is None or role.reads is None or not isinstance(value, Mapping):
        return value
    return {k: (k in value, value.get(k)) for k in role.reads}


def equal_inputs(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an input whose __eq__ raises can never be matched
        return False
