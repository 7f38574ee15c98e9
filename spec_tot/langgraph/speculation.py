"""Walking past the superstep barrier: predicted tasks run ahead, real tasks adopt them.

LangGraph's loop runs every real superstep. While a fan-out step waits for its slowest
task, prediction passes (``spec_tot.langgraph.prediction``) run the user's reward and select
nodes on the partial pool and start the ``Send``s they emit as speculative tasks. When the
loop starts a real task of the same node on an equal input (on the node's declared
``reads``), the task adopts that run's return value instead of running the node
(``spec_tot.langgraph.adoption``). Impure nodes never run here.

Passes run after every task completion (real or speculative). What a pass no longer reaches
is cancelled at once when the graph's selects are declared ``top_k`` (a dropped ``Send`` is
never emitted later), and otherwise kept, unused, until its superstep passes or its slot is
needed. Admission is by the speculation dispatcher of the spec-tot backends the graph uses,
shared with every other app on them, or else by the app's own
(``spec_tot.langgraph.slots``). Nothing a speculative task does reaches the run's state,
checkpoints, streams or callbacks unless it is adopted (``spec_tot.langgraph.replay``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from langchain_core.runnables import RunnableConfig

from spec_tot.branch_context import BranchContext, current_branch
from spec_tot.langgraph._pregel import PregelExecutableTask, World, arun_task
from spec_tot.langgraph.adoption import speculating
from spec_tot.langgraph.entries import Entry, EntryTable, SendOwners, match_key
from spec_tot.langgraph.prediction import Prediction, predict
from spec_tot.langgraph.results import TaskRecord, TaskStatus
from spec_tot.langgraph.roles import NodeRole
from spec_tot.langgraph.slots import Lease, RunSlots
from spec_tot.langgraph.steps import StepView

__all__ = ["Speculator"]


@dataclass
class Speculator:
    """The speculative side of one run. The run calls ``reserve`` (any thread) and then
    ``begin_step`` (on ``loop``) when the loop starts a superstep, ``task_done`` as its
    tasks finish, ``claim`` (any thread) and ``wait`` when a real task of a speculable node
    starts."""

    roles: Mapping[str, NodeRole]
    config: RunnableConfig  # the loop's, as speculative tasks get it (_pregel.speculative_base)
    slots: RunSlots
    strict: bool
    prefix: str
    clock: Callable[[], float]
    owners: SendOwners
    pool: Executor | None = None  # the app's own threads for sync node functions
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    table: EntryTable = field(default_factory=EntryTable)
    records: list[TaskRecord] = field(default_factory=list)
    closed: bool = False
    # What asked for a pass since the last one started: None (a real event) or the
    # speculative runs that ended (a pass that already used a run's result drops it).
    _dirty: set[Entry | None] = field(default_factory=set)
    _passing: asyncio.Task[None] | None = None
    _aborts: set[asyncio.Task[Any]] = field(default_factory=set)
    _live: set[asyncio.Task[Any]] = field(default_factory=set)  # every run not yet ended
    _recorded: set[str] = field(default_factory=set)
    _ids_issued: int = 0  # speculative runs launched; the next run's serial
    failed_passes: int = 0  # passes a user function failed on (partial state)

    @functools.cached_property
    def _thoughts(self) -> tuple[str, ...]:
        """The graph's model-call nodes."""
        return tuple(name for name, role in self.roles.items() if role.kind == "thought")

    # -- the run's side -------------------------------------------------------------------
    def reserve(self, view: StepView) -> tuple[list[Entry], list[Entry]]:
        """A real superstep started (any thread, while it runs): reserve the runs its
        tasks adopt; returns the stale and the adopted runs for ``begin_step``."""
        keys = {
            t.id: match_key(role, t.input)
            for t in view.tasks
            if (role := self.roles.get(t.name)) is not None and role.pure
        }
        return self.table.reserve(view, keys)

    def begin_step(self, view: StepView, stale: list[Entry], adopted: list[Entry]) -> None:
        """On the loop, after ``reserve``: count the adopted runs as hits, cancel the stale
        ones, predict from the pool the step starts with."""
        for entry in adopted:
            if entry.lease is not None:
                entry.lease.adopted()
        for entry in stale:
            self._cancel(entry)
        if self.closed or view is not self.table.view:
            return
        if any(not self._pure(t) for t in view.tasks):
            self._freeze()
        if len(view.tasks) > 1:
            self._schedule()

    def claim(self, view: StepView, task: PregelExecutableTask) -> Entry | None:
        """The speculative run ``task`` adopts, if one was reserved for it (any thread)."""
        return self.table.claim(view, task.id)

    async def wait(self, entry: Entry) -> bool:
        """Wait for an adopted run; True if it returned (its output is the task's)."""
        future = entry.future
        if future is None:  # pragma: no cover - every entry gets its future at launch
            return False
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            future.cancel()  # the real task was cancelled: nobody else wants the run
            raise
        return entry.ok

    def task_done(self, view: StepView) -> None:
        if view is self.table.view:
            self._schedule()

    async def close(self) -> list[Future[Any]]:
        """Cancel everything still speculative and wait until no task of it is left; returns
        the calls of its sync nodes still on a thread (a thread cannot be interrupted)."""
        self.closed = True
        remaining = self.table.close()
        if self._passing is not None and not self._passing.done():
            self._passing.cancel()
            await asyncio.wait([self._passing])
        for entry in remaining:
            self._cancel(entry)
        if self._live:  # cancelled runs included: nothing outlives the run
            await asyncio.wait(self._live)
        if self._aborts:
            await asyncio.wait(self._aborts)
        for entry in remaining:
            self._finish_record(entry)
        threads = [f for e in self.table.every for f in e.threads if not f.done()]
        self.table.every = []
        self.slots.close()
        return threads

    def _pure(self, task: PregelExecutableTask) -> bool:
        role = self.roles.get(task.name)
        return role is not None and role.pure

    def _freeze(self) -> None:
        """An impure task may mutate state objects in place: freeze every live run's key
        (a deep copy of the input it ran on) so that adoption compares with what it saw.
        Pure graphs never pay for the copies."""
        for entry in self.table.freeze_keys():  # a key that cannot be copied: not trusted
            self._cancel(entry)
        self.table.sweep()

    # -- prediction -----------------------------------------------------------------------
    def _schedule(self, cause: Entry | None = None) -> None:
        if self.closed:
            return
        self._dirty.add(cause)
        if self._passing is None or self._passing.done():
            self._passing = self.loop.create_task(self._passes(self.loop.time()))

    async def _passes(self, scheduled: float) -> None:
        self.slots.observe_lag(self.loop.time() - scheduled)
        # One pass at a time; events during a pass ask for one more after it.
        while self._dirty and not self.closed:
            self._dirty.clear()
            view, born = self.table.view, self._ids_issued
            if view is None:
                return
            try:
                seen = await predict(self, view)
            except Exception:
                # The user's routers and reducers ran on a partial state they were never
                # meant to see (or the null step's empty updates): no prediction from it.
                # The real run never depends on a pass.
                self.failed_passes += 1
                continue
            if self.table.view is view:  # a pass that outlived its step knows nothing new
                self._prune(seen, born)
            self._dirty -= seen.used  # runs that ended during the pass and that it used

    def _prune(self, seen: Prediction, born: int) -> None:
        for entry in self.table.live():
            if entry.step not in seen.reached or entry.serial >= born:
                continue  # the pass did not look that far, or the run is newer than it
            entry.wanted = id(entry) in seen.referenced
            # Strict early pruning: with top-k selects, a run predicted from the real
            # partial pool and dropped from a larger one is never wanted again. Otherwise
            # it stays (unused) until its step passes or its slot is needed.
            if self.strict and not entry.wanted and entry.exact and seen.reached[entry.step]:
                self._cancel(entry)
        self.table.sweep()

    # -- speculative runs -----------------------------------------------------------------
    def launch(
        self, world: World, task: PregelExecutableTask, key: Any, exact: bool
    ) -> Entry | None:
        """Start ``task`` (prepared on ``world``) speculatively, if a slot is free."""
        if not self.slots.quiet():
            return None  # busy: speculation would slow the real path down
        caps = [(self.table.in_flight(), self.config.get("max_concurrency"))]  # runs count
        # Hit rates are learnt per node, and per level: a prediction from the real partial
        # pool is one step ahead, one built on speculative steps more.
        kind, level = f"langgraph:{task.name}", 1 if exact else 2
        role = self.roles.get(task.name)
        reserve = role is not None and role.kind == "thought"
        before = time.thread_time()
        # A function node run ahead lets the model calls after it run ahead: a hit saves
        # the longest of them too (none when the graph makes no model call).
        costs = self.slots.app.node_costs
        unblocks = max((costs.get(n, (0.0,))[0] for n in self._thoughts), default=0.0)
        lease = self.slots.acquire(kind, level, reserve, task.name, unblocks, caps)
        if lease is None and self._evict():
            caps = [(self.table.in_flight(), self.config.get("max_concurrency"))]
            lease = self.slots.acquire(kind, level, reserve, task.name, unblocks, caps)
        if lease is None:
            return None
        entry = self._start(world, task, key, exact, lease)
        for dispatcher in lease.launched_on:  # what a launch costs, against what it saves
            dispatcher.launch_cpu.spent(time.thread_time() - before)
        return entry

    def _start(
        self, world: World, task: PregelExecutableTask, key: Any, exact: bool, lease: Lease
    ) -> Entry:
        n = self._ids_issued
        self._ids_issued = n + 1
        branch = BranchContext(f"{self.prefix}/spec{n}", speculative=True, loop=self.loop)
        entry = Entry(
            id=f"{world.step}:{task.name}:spec{n}",
            serial=n,
            node=task.name,
            step=world.step,
            key=key,
            task=task,
            branch=branch,
            exact=exact,
            parent=self.owners.parent(world.pending_sends(), task),
            started_s=self.clock(),
            pool=self.pool,
            lease=lease,
        )
        branch.admission = functools.partial(self.slots.admit, lease, entry.is_speculative)
        entry.future = self.loop.create_task(self._run(entry))
        self._live.add(entry.future)
        entry.future.add_done_callback(functools.partial(self._on_entry_done, entry))
        self.table.add(entry)
        return entry

    async def _run(self, entry: Entry) -> None:
        speculating.set(entry)
        current_branch.set(entry.branch)
        await arun_task(entry.task)

    def _on_entry_done(self, entry: Entry, future: asyncio.Task[Any]) -> None:
        self._live.discard(future)
        entry.done.set()
        if entry.finished_s is None:
            entry.finished_s = self.clock()
        if entry.lease is not None:
            entry.lease.release()
        if not entry.cancelled and (entry.wanted or entry.adopted):
            self._schedule(entry)  # its writes extend the prediction (an unwanted run's do not)

    def _evict(self) -> bool:
        """Free a slot held by a run no prediction wants now (least likely first)."""
        victim = self.table.least_wanted()
        if victim is not None:
            self._cancel(victim)
            self.table.sweep()
        return victim is not None

    def _cancel(self, entry: Entry) -> None:
        if not self.table.mark_cancelled(entry):
            return
        if entry.finished_s is None:
            entry.finished_s = self.clock()
        if entry.future is not None and not entry.future.done():
            if entry.lease is not None:
                entry.lease.uncount()  # its sequences free when the run ends
            entry.future.cancel()
            self._aborts.add(task := self.loop.create_task(entry.branch.abort()))
            task.add_done_callback(self._aborts.discard)
        self._finish_record(entry)

    def _finish_record(self, entry: Entry) -> None:
        if entry.adopted or entry.id in self._recorded:
            return
        self._recorded.add(entry.id)
        self.records.append(_record(entry))


def _record(entry: Entry) -> TaskRecord:
    """What a speculative run that no real task adopted was, for the run's task tree."""
    status: TaskStatus = "failed" if entry.failed else "unused" if entry.ok else "cancelled"
    return TaskRecord(
        entry.id, entry.node, entry.step, entry.parent, status, entry.started_s, entry.finished_s
    )
