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
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from langchain_core.runnables import RunnableConfig

from spec_tot._private.threads import LoopThread
from spec_tot.branch import BranchContext, current_branch
from spec_tot.langgraph._pregel import (
    PregelExecutableTask,
    PregelLoop,
    PregelNode,
    World,
    is_async,
    loop_of,
    on_exit,
    path_key,
    pending_sends,
    speculative_base,
    task_id_of,
)
from spec_tot.langgraph.entries import Entry, SendOwners
from spec_tot.langgraph.results import LangGraphMetrics, TaskRecord, TaskStatus
from spec_tot.langgraph.roles import NodeRole
from spec_tot.langgraph.slots import SpeculationSlots
from spec_tot.langgraph.speculation import Speculator
from spec_tot.langgraph.steps import StepView

if TYPE_CHECKING:
    from spec_tot.langgraph.adoption import AdoptingNode

__all__ = ["GraphRun", "RunClaim", "RunTotals", "SharedThreads", "SpeculationPlan", "run_claim"]


@dataclass(eq=False)
class RunClaim:
    """Where ``arun`` finds the run its ``ainvoke`` started: the first run of ``plan``."""

    plan: SpeculationPlan
    run: GraphRun | None = None


run_claim: contextvars.ContextVar[RunClaim | None] = contextvars.ContextVar(
    "spec_tot_lg_claim", default=None
)


@dataclass(eq=False)
class SharedThreads:
    """An app's threads for speculation, shared by its runs: the event loop its sync runs
    speculate on (started with the first such run, stopped with the last) and the pool its
    speculative sync node functions run in (never LangGraph's: a committed task never waits
    for a thread speculation holds). The pool has as many threads as the app may run
    speculative tasks at once."""

    size: Callable[[], int]
    _host: LoopThread | None = None
    _users: int = 0
    _pool: ThreadPoolExecutor | None = None
    _detached: list[Future[Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire_host(self) -> LoopThread:
        with self._lock:
            if self._host is None:
                self._host = LoopThread("spec-tot-speculation")
            self._users += 1
            return self._host

    def release_host(self) -> None:
        with self._lock:
            self._users -= 1
            host, last = self._host, self._users == 0
            if last:
                self._host = None
        if last and host is not None:
            host.close()

    def detach(self, calls: Iterable[Future[Any]]) -> None:
        """Calls of ended runs still on a thread (cancelled speculative work)."""
        with self._lock:
            self._detached = [f for f in [*self._detached, *calls] if not f.done()]

    def detached(self) -> int:
        with self._lock:
            return sum(not f.done() for f in self._detached)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no detached call is still running; False on timeout."""
        with self._lock:
            calls = list(self._detached)
        _, pending = concurrent.futures.wait(calls, timeout=timeout)
        return not pending

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.size(), thread_name_prefix="spec-tot-spec")
            return self._pool


@dataclass(eq=False)
class RunTotals:
    """What an app's runs have done so far, summed (every run adds its figures when it
    ends): ``speculative`` tasks launched, ``adopted`` by a real task, and the rest."""

    runs: int = 0
    committed: int = 0
    speculative: int = 0
    adopted: int = 0
    cancelled: int = 0
    unused: int = 0
    failed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, m: LangGraphMetrics) -> None:
        with self._lock:
            self.runs += 1
            self.committed += m.committed
            self.speculative += m.speculative
            self.adopted += m.adopted
            self.cancelled += m.cancelled
            self.unused += m.unused
            self.failed += m.failed

    def to_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


@dataclass(frozen=True, eq=False)
class SpeculationPlan:
    """What an app's runs share: the nodes' roles, whether to speculate, the slots (one
    pool per app), how deep a prediction may build on partial steps, the graph's nodes as
    given and as predictions run them (speculable ones logging into their entry), and the
    run of each loop running the graph now."""

    roles: Mapping[str, NodeRole]
    speculate: bool
    slots: SpeculationSlots
    max_depth: int
    strict: bool
    timeout_s: float | None
    base_nodes: Mapping[str, PregelNode]
    fork_nodes: dict[str, PregelNode] = field(default_factory=dict)
    threads: SharedThreads = field(init=False)
    totals: RunTotals = field(default_factory=RunTotals)
    _runs: weakref.WeakKeyDictionary[PregelLoop, GraphRun] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        object.__setattr__(self, "threads", SharedThreads(self.slots.threads))

    def forget(self, loop: PregelLoop) -> None:
        with self._lock:
            self._runs.pop(loop, None)

    def run_for(self, config: RunnableConfig | None) -> GraphRun | None:
        """The run of the loop whose task this config is (started on first sight)."""
        loop = loop_of(config)
        if loop is None:
            return None
        run = self._runs.get(loop)
        if run is None:
            with self._lock:
                run = self._runs.get(loop)
                if run is None:
                    run = self._runs[loop] = GraphRun.bind(self, loop)
        return run


@dataclass(eq=False)
class GraphRun:
    plan: SpeculationPlan
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
    def bind(cls, plan: SpeculationPlan, pregel: PregelLoop) -> GraphRun:
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
                slots=plan.slots.for_run(run.prefix),
                max_depth=plan.max_depth,
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
        try:
            return node.inner.invoke(input, config, **kw)
        finally:
            current_branch.reset(token)

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
        try:
            return await node.inner.ainvoke(input, config, **kw)
        finally:
            current_branch.reset(token)

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
