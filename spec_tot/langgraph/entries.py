"""What the speculator keeps: its speculative runs (``Entry``) in a table that matches them
to real tasks (node and input, on the node's ``reads``) and holds the current step's
reservations, and which task emitted each ``Send`` (the task tree)."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spec_tot.branch_context import BranchContext
from spec_tot.langgraph._pregel import PregelExecutableTask, sends_in
from spec_tot.langgraph.replay import EventLog
from spec_tot.langgraph.roles import NodeRole
from spec_tot.langgraph.slots import Lease

if TYPE_CHECKING:
    from spec_tot.langgraph.steps import StepView

__all__ = ["Entry", "EntryTable", "SendOwners", "equal_inputs", "match_key"]


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


class EntryTable:
    """A run's speculative runs that a real task may still adopt, and the runs reserved for
    the real superstep running now. Thread-safe: the real tasks of a sync run reserve and
    claim from LangGraph's worker threads while predictions run on the speculator's loop."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._live: list[Entry] = []
        self._reserved: dict[str, Entry] = {}  # real task id -> its run, until claimed
        self._adopting: dict[str, Entry] = {}  # the same, kept once claimed
        self.every: list[Entry] = []  # every run launched
        self.view: StepView | None = None  # the real step the reservations are for
        self.closed = False

    def add(self, entry: Entry) -> None:
        with self._lock:
            self._live.append(entry)
            self.every.append(entry)

    def live(self) -> list[Entry]:
        with self._lock:
            return list(self._live)

    def find(
        self, node: str, key: Any, step: int | None = None, taken: set[int] | None = None
    ) -> Entry | None:
        """A live run of ``node`` on an equal input (``key``, its ``match_key``; predicted
        for ``step`` when given), other than those in ``taken``: equal Sends in one step
        are separate calls."""
        with self._lock:
            for entry in self._live:
                if (
                    entry.node == node
                    and not entry.adopted
                    and not entry.cancelled
                    and (step is None or entry.step == step)
                    and (taken is None or id(entry) not in taken)
                    and equal_inputs(entry.key, key)
                ):
                    return entry
            return None

    def reserve(self, view: StepView, keys: Mapping[str, Any]) -> tuple[list[Entry], list[Entry]]:
        """The real step ``view`` started; ``keys``: the match key of each of its tasks
        that may adopt (by task id). Reserves a run for each such task (one predicted for
        this step first: a run predicted for another step computed the same thing all
        the same). Returns (stale, adopted): the runs predicted for this step or earlier
        that no task adopts, and the adopted ones."""
        with self._lock:
            if self.closed:
                return [], []
            reserved: dict[str, Entry] = {}
            taken: set[int] = set()
            for task in view.tasks:
                if task.id not in keys:
                    continue
                key = keys[task.id]
                entry = self.find(task.name, key, view.step, taken) or self.find(
                    task.name, key, None, taken
                )
                if entry is not None and not entry.failed:  # a failed run is re-run for real
                    taken.add(id(entry))
                    reserved[task.id] = entry
                    entry.adopted = True
                    entry.branch.speculative = False
            stale = [e for e in self._live if not e.adopted and e.step <= view.step]
            self._live = [
                e for e in self._live if not e.adopted and not e.cancelled and e not in stale
            ]
            self.view, self._reserved, self._adopting = view, reserved, dict(reserved)
            return stale, list(reserved.values())

    def claim(self, view: StepView, task_id: str) -> Entry | None:
        with self._lock:
            return self._reserved.pop(task_id, None) if view is self.view else None

    def adopting(self) -> dict[str, Entry]:
        """The current step's adopted runs, by real task id (claimed or not)."""
        with self._lock:
            return dict(self._adopting)

    def mark_cancelled(self, entry: Entry) -> bool:
        """Mark a run cancelled; False if it was already, or is adopted."""
        with self._lock:
            if entry.cancelled or entry.adopted:
                return False
            entry.cancelled = True
            return True

    def in_flight(self) -> int:
        """What counts against the run's ``max_concurrency``: the real step's unfinished
        tasks (running, or waiting for LangGraph's slots) and the speculative runs not yet
        ended."""
        view = self.view
        if view is None:
            return 0
        unfinished = len(view.tasks) - len(view.finished_writes())
        ahead = sum(
            1 for e in self.live() if e.future is not None and not e.future.done() and not e.adopted
        )
        return unfinished + ahead

    def least_wanted(self) -> Entry | None:
        """A running run no prediction wants now, the least likely needed first (deepest)."""
        idle = [e for e in self.live() if e.running and not e.wanted]
        return min(idle, key=lambda e: (-e.step, e.id)) if idle else None

    def freeze_keys(self) -> list[Entry]:
        """Freeze every live run's key (a deep copy of the input it ran on, before an impure
        task may mutate it in place); returns the runs whose key could not be copied."""
        failed = []
        for entry in self.live():
            if entry.frozen or entry.cancelled:
                continue
            try:
                entry.key = copy.deepcopy(entry.key)
                entry.frozen = True
            except Exception:
                failed.append(entry)
        return failed

    def sweep(self) -> None:
        with self._lock:
            self._live = [e for e in self._live if not e.cancelled]

    def close(self) -> list[Entry]:
        """No more reservations; every run not adopted by a task that ran it (to cancel)."""
        with self._lock:
            self.closed, self.view = True, None
            unclaimed = list(self._reserved.values())
            for entry in unclaimed:
                entry.adopted = False  # reserved for a task that never ran it
            out = [*self._live, *unclaimed]
            self._live, self._reserved, self._adopting = [], {}, {}
            return out


def match_key(role: NodeRole | None, value: Any) -> Any:
    if role is None or role.reads is None or not isinstance(value, Mapping):
        return value
    return {k: (k in value, value.get(k)) for k in role.reads}


def equal_inputs(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an input whose __eq__ raises can never be matched
        return False
