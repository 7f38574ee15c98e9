"""One run of a speculative graph, beside the LangGraph loop that runs it.

Nothing starts a run but LangGraph: the first runnable spec-tot put into the graph's nodes
(``spec_tot.langgraph.adoption``) that a loop calls asks the app's ``SpeculationPlan`` for
the loop's run, and the plan starts one, closed when the loop exits (LangGraph's own exit
stack). From then on the run keeps a view of each superstep as it starts (the state it
started from, its tasks), records each task as it finishes, and hands the speculator what it
needs: ``begin_step``, ``task_done`` and, when a real task of a speculable node starts,
``claim``. The speculator lives on an event loop: the loop's own for async runs, a thread of
its own for sync runs (whose tasks run on LangGraph's worker threads and talk to it through
thread-safe calls).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from langchain_core.runnables import RunnableConfig

from spec_tot._private.threads import LoopThread
from spec_tot.branch_context import BranchContext, current_branch
from spec_tot.langgraph._pregel import (
    PregelExecutableTask,
    PregelLoop,
    PregelNode,
    World,
    is_async,
    on_exit,
    path_key,
    pending_sends,
    speculative_base,
    task_id_of,
)
from spec_tot.langgraph.entries import Entry, SendOwners
from spec_tot.langgraph.results import LangGraphMetrics, TaskRecord, TaskStatus
from spec_tot.langgraph.roles import NodeRole
from spec_tot.langgraph.shared import RunTotals, SharedThreads
from spec_tot.langgraph.slots import SpeculationSlots
from spec_tot.langgraph.speculation import Speculator
from spec_tot.langgraph.steps import StepView

if TYPE_CHECKING:
    from spec_tot.langgraph.adoption import AdoptingNode

__all__ = ["GraphRun", "PlanView", "RunClaim", "run_claim"]


class PlanView(Protocol):
    """What a run reads of its app's plan (``SpeculationPlan``), and the one change it
    makes there: ``forget`` its loop when it ends."""

    @property
    def roles(self) -> Mapping[str, NodeRole]: ...
    @property
    def speculate(self) -> bool: ...
    @property
    def slots(self) -> SpeculationSlots: ...
    @property
    def strict(self) -> bool: ...
    @property
    def fork_nodes(self) -> dict[str, PregelNode]: ...
    @property
    def threads(self) -> SharedThreads: ...
    @property
    def totals(self) -> RunTotals: ...

    def forget(self, loop: PregelLoop) -> None: ...


@dataclass(eq=False)
class RunClaim:
    """Where ``arun`` finds the run its ``ainvoke`` started: the first run of ``plan``."""

    plan: PlanView
    run: GraphRun | None = None


run_claim: contextvars.ContextVar[RunClaim | None] = contextvars.ContextVar(
    "spec_tot_lg_claim", default=None
)


@dataclass(eq=False)
class GraphRun:
    plan: PlanView
    pregel: weakref.ref[PregelLoop]  # weak: nothing of a run keeps LangGraph's loop alive
    loop: asyncio.AbstractEventLoop | None  # where the speculator lives
    host: LoopThread | None = None  # that loop's thread, for a sync run
    prefix: str = field(default_factory=lambda: f"lg-{secrets.token_hex(6)}")
    records: list[TaskRecord] = field(default_factory=list)
    speculator: Speculator | None = None
    closing: bool = False
    _view: StepView | None = None
    _steps: set[int] = field(default_factory=set)
    _starts: dict[str, float] = field(default_factory=dict)
    _adopted: dict[str, Entry] = field(default_factory=dict)
    _owners: SendOwners = field(default_factory=SendOwners)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _t0: float = field(default_factory=time.monotonic)

    @classmethod
    def bind(cls, plan: PlanView, pregel: PregelLoop) -> GraphRun:
        """A new run for ``pregel`` (called from inside one of its tasks), closed when the
        loop exits."""
        host, loop = None, None
        if plan.speculate:
            if is_async(pregel):
                loop = asyncio.get_running_loop()
            else:
                host = plan.threads.acquire_host()
                loop = host.loop
        run = cls(plan, weakref.ref(pregel), loop, host)
        claim = run_claim.get()
        if claim is not None and claim.plan is plan and claim.run is None:
            claim.run = run
        if loop is not None:
            run.speculator = Speculator(
                roles=plan.roles,
                config=speculative_base(pregel.config),
                slots=plan.slots.for_run(run.prefix, shares_loop=host is None),
                strict=plan.strict,
                prefix=run.prefix,
                clock=run.clock,
                owners=run._owners,
                pool=plan.threads.pool(),
                loop=loop,
            )
        on_exit(pregel, run.aclose if is_async(pregel) else run.close)
        return run

    def clock(self) -> float:
        return time.monotonic() - self._t0

    # -- the loop's side (any thread) -----------------------------------------------------
    def see(self, config: RunnableConfig) -> tuple[StepView, PregelExecutableTask] | None:
        """The superstep and task a node call belongs to. The first call of a superstep
        takes its view (while the step runs, its state is the one it started from)."""
        task_id, loop = task_id_of(config), self.pregel()
        if task_id is None or loop is None:
            return None
        with self._lock:
            view = self._view
            if view is None or view.step != loop.step:
                view = self._new_view(loop)
        task = view.task(task_id)
        return None if task is None else (view, task)

    def _new_view(self, loop: PregelLoop) -> StepView:
        world = World.of_loop(loop, self.plan.fork_nodes) if self.speculator else None
        tasks = sorted(loop.tasks.values(), key=path_key)
        view = StepView(loop.step, world, tasks, pending_sends(loop), self.clock())
        self._view = view
        self._steps.add(loop.step)
        if self.speculator is not None:
            stale, adopted = self.speculator.reserve(view)
            self._soon(self.speculator.begin_step, view, stale, adopted)
        return view

    def call(self, node: AdoptingNode, input: Any, config: RunnableConfig, kw: Any) -> Any:
        """A real task calls a speculable node (sync)."""
        seen, spec = self.see(config), self.speculator
        if seen is None or spec is None:
            return node.inner.invoke(input, config, **kw)
        view, task = seen
        self._starts.setdefault(task.id, self.clock())
        entry = spec.claim(view, task)
        if entry is not None:
            entry.done.wait()
            if entry.ok:
                entry.log.replay(config)
                self._adopted[task.id] = entry
                return entry.output
            if self.closing:
                raise concurrent.futures.CancelledError("the run is closing")
        token = current_branch.set(self._branch(view, task))
        clocks = _clocks()
        try:
            return node.inner.invoke(input, config, **kw)
        finally:
            current_branch.reset(token)
            self._observe(task.name, clocks)

    async def acall(self, node: AdoptingNode, input: Any, config: RunnableConfig, kw: Any) -> Any:
        """A real task calls a speculable node (async, on the run's loop)."""
        seen, spec = self.see(config), self.speculator
        if seen is None or spec is None:
            return await node.inner.ainvoke(input, config, **kw)
        view, task = seen
        self._starts.setdefault(task.id, self.clock())
        entry = spec.claim(view, task)
        if entry is not None:
            if await spec.wait(entry):
                await entry.log.areplay(config)
                self._adopted[task.id] = entry
                return entry.output
            if self.closing:
                raise asyncio.CancelledError("the run is closing")
        token = current_branch.set(self._branch(view, task))
        clocks = _clocks()
        try:
            return await node.inner.ainvoke(input, config, **kw)
        finally:
            current_branch.reset(token)
            # The loop's CPU over the call: other tasks' too, so an upper bound of its own.
            self._observe(task.name, clocks, own_wall=_coroutine(node))

    def _observe(self, node: str, since: tuple[float, float, float], own_wall: bool = True) -> None:
        """What a committed run of ``node`` cost since ``since`` (``_clocks``): what running
        it ahead would save on a hit and waste on a miss (the speculation rule weighs both).
        ``own_wall``: the wall seconds are the node's own (not a sync function's wait for a
        worker thread of an async run, which is this process's contention)."""
        wall, cpu, process = (now - then for now, then in zip(_clocks(), since, strict=True))
        # Wall seconds in which the whole process computed nothing: the node waited on
        # something outside it (a server, an API, a sleep), which a miss holds as long.
        # Waiting for this process's own work (the GIL, a busy loop) is not counted.
        away = max(0.0, wall - process) if own_wall else 0.0
        self.plan.slots.observe_node(node, wall, cpu, away)

    def task_done(self, config: RunnableConfig) -> None:
        """A real task's writes are complete (its last writer runs this)."""
        seen = self.see(config)
        if seen is None:
            return
        view, task = seen
        writes = view.finish(task)
        rid = view.rids[task.id]
        entry = self._adopted.get(task.id)
        status: TaskStatus = "adopted" if entry is not None else "committed"
        started = entry.started_s if entry is not None else self._starts.get(task.id)
        with self._lock:
            record = TaskRecord(
                rid,
                task.name,
                view.step,
                self._owners.parent(view.sends, task),
                status,
                view.started_s if started is None else started,
                self.clock(),
            )
            self.records.append(record)
            self._owners.record(writes, rid)
        if self.speculator is not None:
            self._soon(self.speculator.task_done, view)

    def _branch(self, view: StepView, task: PregelExecutableTask) -> BranchContext:
        slots = self.speculator.slots if self.speculator is not None else None
        admission = functools.partial(slots.admit, None, _never) if slots is not None else None
        rid = view.rids[task.id].replace(":", "/")
        return BranchContext(f"{self.prefix}/{rid}", loop=self.loop, admission=admission)

    # -- thread hops ----------------------------------------------------------------------
    def _soon(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.host is None or self.host.on_thread():
            fn(*args)
        else:
            self.host.call_soon(fn, *args)

    # -- the end --------------------------------------------------------------------------
    def _release(self) -> None:
        """Let go of the loop's objects (a task's config reaches the loop: a run kept for its
        figures must not keep LangGraph's loop alive) and leave the plan's table."""
        self._view = None
        loop = self.pregel()
        if loop is not None:
            self.plan.forget(loop)

    async def aclose(self) -> None:
        """Cancel what is still speculative and wait until nothing of it runs."""
        self.closing = True
        self._release()
        spec = self.speculator
        if spec is not None:
            # A thread cannot be interrupted: a cancelled speculative sync call still in
            # one finishes there, detached (its output reaches nothing; its model request
            # was aborted with its branch). The run does not wait for it: that would add
            # the slowest wasted call to every run's latency. ``SharedThreads.drain`` waits.
            self.plan.threads.detach(await spec.close())
        self.plan.totals.add(self.metrics())

    def close(self) -> None:
        """``aclose`` for a sync run (on the run's own loop thread)."""
        self.closing = True
        if self.host is None:
            self._release()
            self.plan.totals.add(self.metrics())
            return
        try:
            self.host.submit(self.aclose()).result()
        finally:
            self.plan.threads.release_host()

    def tasks(self) -> tuple[TaskRecord, ...]:
        spec = self.speculator.records if self.speculator is not None else []
        with self._lock:
            records = [*self.records, *spec]
        return tuple(sorted(records, key=lambda r: (r.step, r.id)))

    def metrics(self) -> LangGraphMetrics:
        records = self.tasks()
        counts = {
            s: sum(r.status == s for r in records)
            for s in ("committed", "adopted", "cancelled", "unused", "failed")
        }
        speculative = sum(counts[s] for s in ("adopted", "cancelled", "unused", "failed"))
        return LangGraphMetrics(
            wall_s=self.clock(),
            steps=len(self._steps),
            committed=counts["committed"],
            speculative=speculative,
            adopted=counts["adopted"],
            cancelled=counts["cancelled"],
            unused=counts["unused"],
            failed=counts["failed"],
        )


def _never() -> bool:
    return False


def _clocks() -> tuple[float, float, float]:
    """(wall, this thread's CPU, the process's CPU) now."""
    return time.perf_counter(), time.thread_time(), time.process_time()


def _coroutine(node: Any) -> bool:
    """Whether ``node`` runs as a coroutine on the run's loop; a sync function's
    ``ainvoke`` first waits for a worker thread (LangGraph's ``run_in_executor``)."""
    return getattr(node.inner, "func", None) is None
