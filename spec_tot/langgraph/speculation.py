"""Walking past the superstep barrier: predict the next supersteps on a partial pool.

While a fan-out step waits for its slowest task, a prediction pass forks the state, applies
the writes of the tasks that have finished (the partial pool), and prepares the supersteps
that would follow, as LangGraph would: reward and select nodes run on the partial pool (the
user's own functions), and the ``Send``s the select's router emits become speculative
tasks. A pass recurses through speculative steps whose tasks have finished (up to
``max_depth`` partial steps). Each speculative task runs once; when a real step prepares a
task with the same node and an equal input (on the node's declared ``reads``), it adopts
that run's writes instead of running it again. Impure nodes
never run here: a step with one stops the pass.

Passes run after every task completion (real or speculative). What a pass no longer reaches
is cancelled at once when the graph's selects are declared ``top_k`` (a dropped ``Send`` is
never emitted later), and otherwise kept, unused, until its superstep passes or its slot is
needed. Slots come from the speculation budget of the spec-tot backends the graph uses,
shared with every other app on them, or else from the app's own pool
(``spec_tot.langgraph.slots``).
Speculative tasks report to the run's callbacks like real ones, tagged ``SPECULATIVE_TAG``
(so a trace shows what speculation cost, and what it saved once adopted).
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from langchain_core.runnables import RunnableConfig

from spec_tot.branch import BranchContext
from spec_tot.langgraph._pregel import PregelExecutableTask, World, execute
from spec_tot.langgraph.entries import Entry, SendOwners, equal_inputs, match_key
from spec_tot.langgraph.results import TaskRecord, TaskStatus
from spec_tot.langgraph.roles import NodeRole
from spec_tot.langgraph.slots import DEEP_UTILITY, EXACT_UTILITY, RunSlots

__all__ = ["SPECULATIVE_TAG", "Speculator"]

# Tag of speculative tasks' runs (and of the LLM calls inside them) in traces and callbacks.
SPECULATIVE_TAG = "spec_tot:speculative"

_SETTLE_TURNS = 4  # event-loop turns a pass waits for runs it has just started


@dataclass
class Speculator:
    """The speculative side of one run; the runner calls ``begin_step``/``task_done``."""

    roles: Mapping[str, NodeRole]
    config: RunnableConfig  # for speculative tasks: the run's, tagged SPECULATIVE_TAG
    manager: Any  # the run's callback manager: speculative work is traced, tagged
    slots: RunSlots
    max_depth: int
    strict: bool
    prefix: str
    clock: Callable[[], float]
    owners: SendOwners
    pool: Executor | None = None  # sync runs: speculative tasks on their own threads
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    entries: list[Entry] = field(default_factory=list)
    records: list[TaskRecord] = field(default_factory=list)
    _real: tuple[World, list[PregelExecutableTask], set[str]] | None = None
    _null: list[PregelExecutableTask] | None = None  # the real step's null step, once
    _dirty: bool = False
    _passing: asyncio.Task[None] | None = None
    _closed: bool = False
    _aborts: set[asyncio.Task[Any]] = field(default_factory=set)
    _live: set[asyncio.Task[Any]] = field(default_factory=set)  # every run not yet ended
    _recorded: set[str] = field(default_factory=set)
    _ids_issued: int = 0  # speculative runs launched; the next run's serial

    # -- the runner's side ----------------------------------------------------------------
    def begin_step(self, world: World, tasks: list[PregelExecutableTask]) -> dict[str, Entry]:
        """Adopt matching speculative runs for the real step's tasks; drop stale ones."""
        adopted: dict[str, Entry] = {}
        for task in tasks:
            # Predicted for this step first; a run predicted for another step computed
            # the same thing all the same.
            key = match_key(self.roles.get(task.name), task.input)
            entry = self._find(task, key, world.step) or self._find(task, key)
            if entry is not None and not entry.failed:  # a failed run is re-run for real
                entry.adopted = True
                entry.branch.speculative = False
                if entry.lease is not None:
                    entry.lease.adopted()
                adopted[task.id] = entry
        for entry in self.entries:
            if not entry.adopted and entry.step <= world.step:
                self._cancel(entry)
        self.entries = [e for e in self.entries if not e.adopted and not e.cancelled]
        self._real = (world, tasks, set())
        self._null = None
        if len(tasks) > 1:
            self._schedule()  # predict from the pool the step starts with
        return adopted

    def before_impure(self) -> None:
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

    def task_done(self, task: PregelExecutableTask) -> None:
        if self._real is not None:
            self._real[2].add(task.id)
            self._schedule()

    def end_step(self) -> None:
        self._real = None

    async def close(self) -> None:
        """Cancel everything still speculative and wait until nothing is left running."""
        self._closed = True
        self._real = None
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
        self.entries = []
        self.slots.close()

    # -- prediction -----------------------------------------------------------------------
    def _schedule(self) -> None:
        if self._closed:
            return
        self._dirty = True
        if self._passing is None or self._passing.done():
            self._passing = self.loop.create_task(self._passes(self.loop.time()))

    async def _passes(self, scheduled: float) -> None:
        self.slots.app.observe_lag(self.loop.time() - scheduled)
        # One pass at a time; events during a pass ask for one more after it.
        while self._dirty and not self._closed:
            self._dirty = False
            await self._pass()

    async def _settle(self, entries: list[Entry]) -> None:
        # Let runs that need no I/O (a scorer, a select) finish before going deeper, so a
        # chain of cheap pure steps is one pass, not one pass per step.
        for _ in range(_SETTLE_TURNS):
            if all(e.future is not None and e.future.done() for e in entries):
                return
            await asyncio.sleep(0)

    async def _pass(self) -> None:
        if self._real is None or self._closed:
            return
        real_view = self._real
        born = self._ids_issued
        real, tasks, done = real_view
        finished = [t for t in tasks if t.id in done]
        if len(finished) == len(tasks) or (not finished and len(tasks) == 1):
            return  # complete (the runner takes it from here), or nothing to go on
        world = real.fork()
        if not finished and self._null is None:
            self._null = self._null_step(real)
        world.apply(finished or self._null or [])
        exact, depth = True, 0
        referenced: set[int] = set()
        reached: dict[int, bool] = {}
        while world.step <= world.stop:
            step_tasks = world.prepare(self.config, self.manager)
            if not step_tasks:
                break
            reached[world.step] = exact
            pairs: list[tuple[PregelExecutableTask, Entry]] = []
            blocked = False
            for task in step_tasks:
                entry = None
                role = self.roles.get(task.name)
                if role is not None and role.pure:
                    key = match_key(role, task.input)
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
                    return
            ready = [(t, e) for t, e in pairs if e.ok]
            if blocked or not ready:
                break
            if len(ready) < len(step_tasks):
                depth += 1
                if depth > self.max_depth:
                    break
                exact = False
            for task, entry in ready:
                task.writes.extend(entry.task.writes)
                self.owners.record(task, entry.id)
            world.apply([t for t, _ in ready])
        if self._real is real_view:  # a pass that outlived its real step knows nothing new
            self._prune(referenced, reached, born)

    def _null_step(self, real: World) -> list[PregelExecutableTask]:
        """The real step as if its tasks had returned empty updates: before any of them
        finishes, the pool is what the step started with (the ToT tutorial keeps the
        parents in it), and the select already has something to keep."""
        out = real.fork().prepare(self.config)
        try:
            for task in out:
                for writer in task.writers:
                    writer.invoke({}, task.config)
        except Exception:  # a node whose edges cannot take an empty update: no prediction
            return []
        return out

    def _prune(self, referenced: set[int], reached: dict[int, bool], born: int) -> None:
        for entry in self.entries:
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
            parent=self.owners.parent(world, task),
            started_s=self.clock(),
            lease=lease,
        )
        branch.admission = functools.partial(self.slots.admit, lease, entry.is_speculative)
        entry.future = self.loop.create_task(self._run(entry))
        self._live.add(entry.future)
        entry.future.add_done_callback(functools.partial(self._on_entry_done, entry))
        self.entries.append(entry)
        return entry

    async def _run(self, entry: Entry) -> None:
        await execute(entry.task, entry.branch, self.pool)

    def _on_entry_done(self, entry: Entry, future: asyncio.Task[Any]) -> None:
        self._live.discard(future)
        if entry.finished_s is None:
            entry.finished_s = self.clock()
        if entry.lease is not None:
            entry.lease.release()
        if not entry.cancelled and entry.wanted:  # an unwanted run extends no prediction
            self._schedule()

    def _evict(self) -> bool:
        """Free a slot held by a run no prediction wants now (least likely first)."""
        idle = [e for e in self.entries if e.running and not e.wanted]
        if not idle:
            return False
        victim = min(idle, key=lambda e: (-e.step, e.id))
        self._cancel(victim)
        self.entries = [e for e in self.entries if not e.cancelled]
        return True

    def _cancel(self, entry: Entry) -> None:
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
