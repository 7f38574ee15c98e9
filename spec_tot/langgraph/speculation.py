"""Walking past the superstep barrier: predict the next supersteps on a partial pool.

LangGraph's loop runs every real superstep. While a fan-out step waits for its slowest
task, a prediction pass forks the state the step started from, applies the writes of the
tasks that have finished (the partial pool), and prepares the supersteps that would follow
as LangGraph would: reward and select nodes run on the partial pool (the user's own
functions), and the ``Send``s the select's router emits become speculative tasks. A pass
recurses through speculative steps whose tasks have finished (up to ``max_depth`` partial
steps). Each speculative task runs once; when the loop starts a real task of the same
node on an equal input (on the node's declared ``reads``), the task adopts that run's
return value instead of running the node (``spec_tot.langgraph.adoption``). Impure nodes
never run here: a step with one stops the pass.

Passes run after every task completion (real or speculative). What a pass no longer reaches
is cancelled at once when the graph's selects are declared ``top_k`` (a dropped ``Send`` is
never emitted later), and otherwise kept, unused, until its superstep passes or its slot is
needed. Slots come from the speculation budget of the spec-tot backends the graph uses,
shared with every other app on them, or else from the app's own pool
(``spec_tot.langgraph.slots``). Nothing a speculative task does reaches the run's state,
checkpoints, streams or callbacks unless it is adopted (``spec_tot.langgraph.replay``).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from langchain_core.runnables import RunnableConfig

from spec_tot.branch import BranchContext, current_branch
from spec_tot.langgraph._pregel import PregelExecutableTask, World, arun_task
from spec_tot.langgraph.adoption import speculating
from spec_tot.langgraph.entries import Entry, SendOwners, equal_inputs, match_key
from spec_tot.langgraph.results import TaskRecord, TaskStatus
from spec_tot.langgraph.roles import NodeRole
from spec_tot.langgraph.slots import DEEP_UTILITY, EXACT_UTILITY, RunSlots
from spec_tot.langgraph.steps import StepView

__all__ = ["Speculator"]

_SETTLE_TURNS = 4  # event-loop turns a pass waits for runs it has just started


@dataclass
class Speculator:
    """The speculative side of one run. The run calls ``begin_step`` when the loop starts a
    superstep, ``task_done`` as its tasks finish and ``claim`` when a real task of a
    speculable node starts; all on ``loop``."""

    roles: Mapping[str, NodeRole]
    config: RunnableConfig  # the loop's, as speculative tasks get it (_pregel.speculative_base)
    slots: RunSlots
    max_depth: int
    strict: bool
    prefix: str
    clock: Callable[[], float]
    owners: SendOwners
    pool: Executor | None = None  # the run's own threads for sync node functions
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    entries: list[Entry] = field(default_factory=list)
    records: list[TaskRecord] = field(default_factory=list)
    _view: StepView | None = None
    _reserved: dict[str, Entry] = field(default_factory=dict)  # real task id -> its run
    _adopting: dict[str, Entry] = field(default_factory=dict)  # the same, kept once claimed
    _every: list[Entry] = field(default_factory=list)  # every run launched
    # Guards the entries and reservations: real tasks of a sync run reserve and claim from
    # LangGraph's worker threads, predictions run on the loop.
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _null: list[PregelExecutableTask] | None = None  # the real step's null step, once
    # What asked for a pass since the last one started: None (a real event) or the
    # speculative runs that ended (a pass that already used a run's result drops it).
    _dirty: set[Entry | None] = field(default_factory=set)
    _passing: asyncio.Task[None] | None = None
    _closed: bool = False
    _aborts: set[asyncio.Task[Any]] = field(default_factory=set)
    _live: set[asyncio.Task[Any]] = field(default_factory=set)  # every run not yet ended
    _recorded: set[str] = field(default_factory=set)
    _ids_issued: int = 0  # speculative runs launched; the next run's serial
    _failed_passes: int = 0  # passes a user function failed on (partial state)

    # -- the run's side -------------------------------------------------------------------
    def reserve(self, view: StepView) -> tuple[list[Entry], list[Entry]]:
        """A real superstep started (any thread, while the step runs): reserve the runs its
        tasks will adopt (predicted for this step first: a run predicted for another step
        computed the same thing all the same). Returns (stale, adopted): the runs
        predicted for this step or earlier that none adopts, and the adopted ones, for
        ``begin_step`` to act on from the loop."""
        with self._lock:
            if self._closed:
                return [], []
            reserved: dict[str, Entry] = {}
            taken: set[int] = set()
            for task in view.tasks:
                if not self._pure(task):
                    continue
                key = match_key(self.roles.get(task.name), task.input)
                entry = self._find(task, key, view.step, taken) or self._find(
                    task, key, None, taken
                )
                if entry is not None and not entry.failed:  # a failed run is re-run for real
                    taken.add(id(entry))
                    reserved[task.id] = entry
                    entry.adopted = True
                    entry.branch.speculative = False
            stale = [e for e in self.entries if not e.adopted and e.step <= view.step]
            self.entries = [
                e for e in self.entries if not e.adopted and not e.cancelled and e not in stale
            ]
            self._view, self._reserved, self._null = view, reserved, None
            self._adopting = dict(reserved)
            return stale, list(reserved.values())

    def begin_step(self, view: StepView, stale: list[Entry], adopted: list[Entry]) -> None:
        """On the loop, after ``reserve``: count the adopted runs as hits, cancel the stale
        ones, predict from the pool the step starts with."""
        for entry in adopted:
            if entry.lease is not None:
                entry.lease.adopted()
        for entry in stale:
            self._cancel(entry)
        if self._closed or view is not self._view:
            return
        if any(not self._pure(t) for t in view.tasks):
            self._freeze()
        if len(view.tasks) > 1:
            self._schedule()

    def claim(self, view: StepView, task: PregelExecutableTask) -> Entry | None:
        """The speculative run ``task`` adopts, if one was reserved for it (any thread)."""
        with self._lock:
            if view is not self._view:
                return None
            return self._reserved.pop(task.id, None)

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
        if view is self._view:
            self._schedule()

    async def close(self) -> list[Future[Any]]:
        """Cancel everything still speculative and wait until no task of it is left; returns
        the calls of its sync nodes still on a thread (a thread cannot be interrupted)."""
        with self._lock:
            self._closed = True
            self._view = None
            unclaimed = list(self._reserved.values())
            for entry in unclaimed:
                entry.adopted = False  # reserved for a task that never ran it
            self.entries = [*self.entries, *unclaimed]
            self._reserved, self._adopting = {}, {}
        if self._passing is not None and not self._passing.done():
            self._passing.cancel()
            await asyncio.wait([self._passing])
        for entry in self.entries:
            self._cancel(entry)
        if self._live:  # cancelled runs included: nothing outlives the run
            await asyncio.wait(self._live)
        if self._aborts:
            await asyncio.wait(self._aborts)
        for entry in self.entries:
            self._finish_record(entry)
        threads = [f for e in self._every for f in e.threads if not f.done()]
        self.entries, self._every, self._adopting = [], [], {}
        self.slots.close()
        return threads

    def _pure(self, task: PregelExecutableTask) -> bool:
        role = self.roles.get(task.name)
        return role is not None and role.pure

    def _freeze(self) -> None:
        """An impure task may mutate state objects in place: freeze every live run's key
        (a deep copy of the input it ran on) so that adoption compares with what it saw.
        Pure graphs never pay for the copies."""
        for entry in self.entries:
            if entry.frozen or entry.cancelled:
                continue
            try:
                entry.key = copy.deepcopy(entry.key)
                entry.frozen = True
            except Exception:  # a key that cannot be copied cannot be trusted any more
                self._cancel(entry)
        self.entries = [e for e in self.entries if not e.cancelled]

    # -- prediction -----------------------------------------------------------------------
    def _schedule(self, cause: Entry | None = None) -> None:
        if self._closed:
            return
        self._dirty.add(cause)
        if self._passing is None or self._passing.done():
            self._passing = self.loop.create_task(self._passes(self.loop.time()))

    async def _passes(self, scheduled: float) -> None:
        self.slots.app.observe_lag(self.loop.time() - scheduled)
        # One pass at a time; events during a pass ask for one more after it.
        while self._dirty and not self._closed:
            self._dirty.clear()
            try:
                used = await self._pass()
            except Exception:
                # The user's routers and reducers ran on a partial state they were never
                # meant to see (or the null step's empty updates): no prediction from it.
                # The real run never depends on a pass.
                self._failed_passes += 1
                continue
            self._dirty -= used  # runs that ended during the pass and that it used

    async def _settle(self, entries: list[Entry]) -> None:
        # Let runs that need no I/O (a scorer, a select) finish before going deeper, so a
        # chain of cheap pure steps is one pass, not one pass per step.
        for _ in range(_SETTLE_TURNS):
            if all(e.future is not None and e.future.done() for e in entries):
                return
            await asyncio.sleep(0)

    async def _pass(self) -> set[Entry | None]:
        """One prediction; returns the speculative runs whose results it used."""
        used: set[Entry | None] = set()
        view = self._view
        if view is None or view.world is None or self._closed:
            return used
        born = self._ids_issued
        real = view.finished_writes()
        adopted = self._adopted_writes(view, {t.id for t, _ in real})
        used.update(e for _, _, e in adopted)
        finished = real + [(t, w) for t, w, _ in adopted]
        if len(real) == len(view.tasks) or (not finished and len(view.tasks) == 1):
            return used  # complete (the loop takes it from here), or nothing to go on
        world = view.world.fork()
        if finished:
            world.apply_writes_of(finished)
        else:
            if self._null is None:
                self._null = self._null_step(view.world)
            world.apply(self._null)
        exact, depth = True, 0
        referenced: set[int] = set()
        reached: dict[int, bool] = {}
        while world.step <= world.stop:
            step_tasks = world.prepare(self.config)
            if not step_tasks:
                break
            reached[world.step] = exact
            pairs: list[tuple[PregelExecutableTask, Entry]] = []
            blocked = False
            for task in step_tasks:
                entry = None
                if self._pure(task):
                    key = match_key(self.roles.get(task.name), task.input)
                    entry = self._find(task, key, world.step, referenced) or self._launch(
                        world, task, key, exact
                    )
                if entry is None:
                    blocked = True
                    continue
                referenced.add(id(entry))
                pairs.append((task, entry))
            if not blocked and pairs:
                await self._settle([e for _, e in pairs])
                if self._closed:
                    return used
            ready = [(t, e) for t, e in pairs if e.ok]
            used.update(e for _, e in ready)
            if blocked or not ready:
                break
            if len(ready) < len(step_tasks):
                depth += 1
                if depth > self.max_depth:
                    break
                exact = False
            for _, entry in ready:
                self.owners.record(entry.task.writes, entry.id)
            # The writes a run made, under the task this pass prepared (which may be the
            # run's own task, if the pass launched it): never extended onto either.
            world.apply_writes_of((t, list(e.task.writes)) for t, e in ready)
        if self._view is view:  # a pass that outlived its real step knows nothing new
            self._prune(referenced, reached, born)
        return used

    def _adopted_writes(
        self, view: StepView, done: set[str]
    ) -> list[tuple[PregelExecutableTask, list[Any], Entry]]:
        """The writes of the step's tasks whose adopted run has returned but which have not
        finished yet: what they will write (the same node on an equal input), known now."""
        with self._lock:
            adopting = dict(self._adopting)
        return [
            (task, list(entry.task.writes), entry)
            for task in view.tasks
            if task.id not in done and (entry := adopting.get(task.id)) is not None and entry.ok
        ]

    def _null_step(self, real: World) -> list[PregelExecutableTask]:
        """The real step as if its tasks had returned empty updates: before any of them
        finishes, the pool is what the step started with (the ToT tutorial keeps the
        parents in it), and the select already has something to keep."""
        out = real.fork().prepare(self.config)
        try:
            for task in out:
                for writer in task.writers:
                    writer.invoke(None, task.config)  # no update (any state schema)
        except Exception:  # a node whose edges cannot take an empty update: no prediction
            return []
        return out

    def _prune(self, referenced: set[int], reached: dict[int, bool], born: int) -> None:
        with self._lock:
            self._prune_locked(referenced, reached, born)

    def _prune_locked(self, referenced: set[int], reached: dict[int, bool], born: int) -> None:
        for entry in list(self.entries):
            if entry.step not in reached or entry.serial >= born:
                continue  # this pass did not look that far, or the run is newer than it
            entry.wanted = id(entry) in referenced
            # Strict early pruning: with top-k selects, a run predicted from the real
            # partial pool and dropped from a larger one is never wanted again. Otherwise
            # it stays (unused) until its step passes or its slot is needed.
            if self.strict and not entry.wanted and entry.exact and reached[entry.step]:
                self._cancel(entry)
        self.entries = [e for e in self.entries if not e.cancelled]

    def _find(
        self,
        task: PregelExecutableTask,
        key: Any,
        step: int | None = None,
        taken: set[int] | None = None,
    ) -> Entry | None:
        """A live run of ``task``'s node on an equal input (``key``, its ``match_key``;
        predicted for ``step`` when given), other than those in ``taken``: equal Sends in
        one step are separate calls."""
        with self._lock:
            return self._find_locked(task, key, step, taken)

    def _find_locked(
        self, task: PregelExecutableTask, key: Any, step: int | None, taken: set[int] | None
    ) -> Entry | None:
        for entry in self.entries:
            if (
                entry.node == task.name
                and not entry.adopted
                and not entry.cancelled
                and (step is None or entry.step == step)
                and (taken is None or id(entry) not in taken)
                and equal_inputs(entry.key, key)
            ):
                return entry
        return None

    def _launch(
        self, world: World, task: PregelExecutableTask, key: Any, exact: bool
    ) -> Entry | None:
        if not self.slots.app.idle:
            return None  # the loop is busy: speculation would slow the real path down
        utility = EXACT_UTILITY if exact else DEEP_UTILITY
        role = self.roles.get(task.name)
        reserve = role is not None and role.kind == "thought"
        lease = self.slots.acquire(utility, reserve)
        if lease is None and self._evict():
            lease = self.slots.acquire(utility, reserve)
        if lease is None:
            return None
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
        with self._lock:
            self.entries.append(entry)
            self._every.append(entry)
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
        with self._lock:
            idle = [e for e in self.entries if e.running and not e.wanted]
        if not idle:
            return False
        victim = min(idle, key=lambda e: (-e.step, e.id))
        self._cancel(victim)
        self.entries = [e for e in self.entries if not e.cancelled]
        return True

    def _cancel(self, entry: Entry) -> None:
        with self._lock:
            if entry.cancelled or entry.adopted:
                return
            entry.cancelled = True
        if entry.finished_s is None:
            entry.finished_s = self.clock()
        if entry.future is not None and not entry.future.done():
            if entry.lease is not None:
                entry.lease.unpool()  # its budget sequences free when the run ends
            entry.future.cancel()
            self._aborts.add(task := self.loop.create_task(entry.branch.abort()))
            task.add_done_callback(self._aborts.discard)
        self._finish_record(entry)

    def _finish_record(self, entry: Entry) -> None:
        if entry.adopted or entry.id in self._recorded:
            return
        self._recorded.add(entry.id)
        status: TaskStatus = "failed" if entry.failed else "unused" if entry.ok else "cancelled"
        self.records.append(
            TaskRecord(
                entry.id,
                entry.node,
                entry.step,
                entry.parent,
                status,
                entry.started_s,
                entry.finished_s,
            )
        )
