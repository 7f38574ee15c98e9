"""One run of a StateGraph: LangGraph's supersteps, with speculative tasks adopted.

The real path is LangGraph's own: tasks prepared from the channels, run with the node's
retry policy, their writes folded by the reducers in path order, the next step triggered
from what changed, ``GraphRecursionError`` past ``recursion_limit``. The only difference is
that a task may already have run speculatively (``Speculator``) on an equal input, in which
case its writes are taken instead of running it again. Tasks that side-effect run here only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from langchain_core.runnables import RunnableConfig

import spec_tot.langgraph._pregel as pregel
from spec_tot.branch import BranchContext, current_branch
from spec_tot.langgraph._pregel import PregelExecutableTask, World
from spec_tot.langgraph.entries import Entry, SendOwners
from spec_tot.langgraph.results import LangGraphMetrics, LangGraphResult, TaskRecord, TaskStatus
from spec_tot.langgraph.roles import NodeRole
from spec_tot.langgraph.speculation import Speculator

__all__ = ["GraphRun", "Sink"]

Sink = Callable[[str, Any], None]  # (stream mode, chunk)


@dataclass
class GraphRun:
    """``speculator`` is None in baseline mode (LangGraph's schedule exactly)."""

    compiled: Any
    config: RunnableConfig
    recursion_limit: int
    prefix: str
    output_keys: str | Sequence[str]
    stream_keys: str | Sequence[str]
    make_speculator: Callable[[SendOwners, Callable[[], float]], Speculator] | None = None
    sink: Sink | None = None
    manager: Any = None
    pool: Executor | None = None  # sync runs: tasks on worker threads
    # Given to real tasks' branches: a model call reports its spec-tot backend (its budget).
    admission: Callable[[Any, int], AbstractAsyncContextManager[None]] | None = None
    roles: Mapping[str, NodeRole] = field(default_factory=dict)
    records: list[TaskRecord] = field(default_factory=list)
    latest: Any = None
    steps: int = 0

    async def run(self, value: Any) -> LangGraphResult:
        loop = asyncio.get_running_loop()
        started = loop.time()

        def clock() -> float:
            return loop.time() - started

        owners = SendOwners()
        spec = self.make_speculator(owners, clock) if self.make_speculator else None
        world = World.start(self.compiled, value, self.recursion_limit)
        try:
            while True:
                if world.step > world.stop:
                    raise pregel.recursion_error(self.recursion_limit)
                tasks = world.prepare(self.config, self.manager)
                if not tasks:
                    break
                await self._step(world, tasks, spec, owners, clock)
                writes = [w for t in tasks for w in t.writes]
                world.apply(tasks)
                self.steps += 1
                for chunk in pregel.map_output_values(self.output_keys, writes, world.channels):
                    self.latest = chunk
                    self._emit("values", chunk)
        finally:
            if spec is not None:
                await spec.close()
        spec_records = spec.records if spec is not None else []
        records = sorted([*self.records, *spec_records], key=lambda r: (r.step, r.id))
        return LangGraphResult(self.latest, tuple(records), self._metrics(records, clock()))

    async def _step(
        self,
        world: World,
        tasks: list[PregelExecutableTask],
        spec: Speculator | None,
        owners: SendOwners,
        clock: Callable[[], float],
    ) -> None:
        adopted = spec.begin_step(world, tasks) if spec is not None else {}
        if spec is not None and any(not self._pure(t) for t in tasks if t.id not in adopted):
            spec.before_impure()
        loop = asyncio.get_running_loop()
        running: dict[asyncio.Future[Any], tuple[PregelExecutableTask, str, str | None]] = {}
        starts: dict[str, float] = {}
        for i, task in enumerate(tasks):
            rid = f"{world.step}:{task.name}:{i}"
            entry = adopted.get(task.id)
            if entry is not None:
                starts[rid] = entry.started_s
                coro = self._adopt(task, entry, rid)
            else:
                starts[rid] = clock()
                coro = self._execute(task, rid)
            running[loop.create_task(coro)] = (task, rid, owners.parent(world, task))
        pending = set(running)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: pregel.path_key(running[f][0])):
                    error = future.exception()
                    if error is not None:
                        raise error
                    task, rid, parent = running[future]
                    status: TaskStatus = "adopted" if task.id in adopted else "committed"
                    self.records.append(
                        TaskRecord(rid, task.name, world.step, parent, status, starts[rid], clock())
                    )
                    owners.record(task, rid)
                    for chunk in pregel.map_output_updates(self.stream_keys, [(task, task.writes)]):
                        self._emit("updates", chunk)
                    if spec is not None:
                        spec.task_done(task)
        except BaseException:
            for future in pending:
                future.cancel()
            if pending:
                await asyncio.wait(pending)
            raise
        finally:
            if spec is not None:
                spec.end_step()

    def _pure(self, task: PregelExecutableTask) -> bool:
        role = self.roles.get(task.name)
        return task.name == pregel.START or (role is not None and role.pure)

    async def _execute(self, task: PregelExecutableTask, rid: str) -> None:
        branch = BranchContext(
            f"{self.prefix}/{rid.replace(':', '/')}",
            loop=asyncio.get_running_loop(),
            admission=self.admission,
        )
        await pregel.execute(task, branch, self.pool)

    async def _adopt(self, task: PregelExecutableTask, entry: Entry, rid: str) -> None:
        future = entry.future
        if future is None:  # pragma: no cover - every entry gets its future at launch
            raise RuntimeError(f"speculative task {entry.id} never started")
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            future.cancel()  # the real step failed or the run was cancelled
            await asyncio.wait([future])
            raise
        if not entry.ok:  # it failed: the real step runs the task itself
            await self._execute(task, rid)
            return
        task.writes.extend(entry.task.writes)
        for chunk in entry.branch.custom:
            self._emit("custom", chunk)

    def _emit(self, mode: str, chunk: Any) -> None:
        if self.sink is not None:
            self.sink(mode, chunk)

    def custom_writer(self, chunk: Any) -> None:
        """The runtime's stream writer: a speculative branch buffers until adopted."""
        branch = current_branch.get()
        if branch is not None and branch.speculative:
            branch.custom.append(chunk)
        else:
            self._emit("custom", chunk)

    def _metrics(self, records: list[TaskRecord], wall: float) -> LangGraphMetrics:
        counts: Mapping[str, int] = {
            s: sum(r.status == s for r in records)
            for s in ("committed", "adopted", "cancelled", "unused", "failed")
        }
        speculative = sum(counts[s] for s in ("adopted", "cancelled", "unused", "failed"))
        return LangGraphMetrics(
            wall_s=wall,
            steps=self.steps,
            committed=counts["committed"],
            speculative=speculative,
            adopted=counts["adopted"],
            cancelled=counts["cancelled"],
            unused=counts["unused"],
            failed=counts["failed"],
        )
