"""One prediction pass: the supersteps after a partial pool, as LangGraph would run them.

A pass forks the state the real superstep started from, applies the writes of its tasks
that have finished (or whose adopted speculative run has returned: what they will write is
known), and prepares the steps that would follow with LangGraph's own ``prepare_next_tasks``.
Each pure task of a prepared step is matched to a live speculative run on an equal input,
or launched; runs that need no I/O (a scorer, a select) are given a few event-loop turns to
finish, so a chain of cheap pure steps is one pass. The pass goes on while every task of a
step is ready, and through up to ``max_depth`` steps that are only partly ready; a step
with an impure task, or one whose runs are not ready, ends it. Before any task of the real
step finishes, the pool is the step's *null step*: its tasks as if they had returned no
update (the ToT tutorial keeps the parents in the pool, so the select already has
something to keep).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

from langchain_core.runnables import RunnableConfig

from spec_tot.langgraph._pregel import PregelExecutableTask, World
from spec_tot.langgraph.entries import Entry, EntryTable, SendOwners, match_key
from spec_tot.langgraph.roles import NodeRole
from spec_tot.langgraph.slots import RunSlots
from spec_tot.langgraph.steps import StepView

__all__ = ["Prediction", "PredictionHost", "predict"]


class PredictionHost(Protocol):
    """What a prediction pass reads of the run's speculative side (``Speculator``), and
    the one thing it does through it: ``launch`` a predicted task."""

    @property
    def roles(self) -> Mapping[str, NodeRole]: ...
    @property
    def config(self) -> RunnableConfig: ...
    @property
    def slots(self) -> RunSlots: ...
    @property
    def owners(self) -> SendOwners: ...
    @property
    def table(self) -> EntryTable: ...
    @property
    def closed(self) -> bool: ...

    def launch(
        self, world: World, task: PregelExecutableTask, key: Any, exact: bool
    ) -> Entry | None: ...


_SETTLE_TURNS = 4  # event-loop turns a pass waits for runs it has just started

Writes = list[tuple[PregelExecutableTask, list[Any]]]


class Prediction:
    """What a pass saw: the runs it used or wants, and how far it looked."""

    def __init__(self) -> None:
        self.used: set[Entry | None] = set()  # runs whose results it applied
        self.referenced: set[int] = set()  # ids of the runs it matched or launched
        self.reached: dict[int, bool] = {}  # step -> predicted from exact pools only


async def predict(spec: PredictionHost, view: StepView) -> Prediction:
    """One pass over ``view``, the real step running now, launching through ``spec``."""
    out = Prediction()
    if view.world is None:
        return out
    real = view.finished_writes()
    adopted = _adopted_writes(spec, view, {t.id for t, _ in real})
    out.used.update(e for _, _, e in adopted)
    finished: Writes = real + [(t, w) for t, w, _ in adopted]
    if len(real) == len(view.tasks) or (not finished and len(view.tasks) == 1):
        return out  # complete (the loop takes it from here), or nothing to go on
    world = view.world.fork()
    if finished:
        world.apply_writes_of(finished)
    else:
        if view.null is None:
            view.null = _null_step(spec, view.world)
        world.apply(view.null)
    exact, depth = True, 0
    while world.step <= world.stop:
        step_tasks = world.prepare(spec.config)
        if not step_tasks:
            break
        out.reached[world.step] = exact
        pairs, blocked = _runs_for(spec, world, step_tasks, exact, out.referenced)
        if not blocked and pairs:
            await _settle([e for _, e in pairs])
        ready = [(t, e) for t, e in pairs if e.ok]
        out.used.update(e for _, e in ready)
        if blocked or not ready or spec.closed:
            break
        if len(ready) < len(step_tasks):
            depth += 1
            if not spec.slots.reaches(depth):  # the dispatchers' gate
                break
            exact = False
        for _, entry in ready:
            spec.owners.record(entry.task.writes, entry.id)
        # The writes a run made, under the task this pass prepared (which may be the run's
        # own task, if the pass launched it): never extended onto either.
        world.apply_writes_of((t, list(e.task.writes)) for t, e in ready)
    return out


def _runs_for(
    spec: PredictionHost,
    world: World,
    tasks: list[PregelExecutableTask],
    exact: bool,
    referenced: set[int],
) -> tuple[list[tuple[PregelExecutableTask, Entry]], bool]:
    """The run of each task of a prepared step (found or launched); and whether one has
    none (an impure task, or no room to launch)."""
    pairs: list[tuple[PregelExecutableTask, Entry]] = []
    blocked = False
    for task in tasks:
        entry = None
        role = spec.roles.get(task.name)
        if role is not None and role.pure:
            key = match_key(role, task.input)
            entry = spec.table.find(task.name, key, world.step, referenced) or spec.launch(
                world, task, key, exact
            )
        if entry is None:
            blocked = True
            continue
        referenced.add(id(entry))
        pairs.append((task, entry))
    return pairs, blocked


async def _settle(entries: list[Entry]) -> None:
    for _ in range(_SETTLE_TURNS):
        if all(e.future is not None and e.future.done() for e in entries):
            return
        await asyncio.sleep(0)


def _adopted_writes(
    spec: PredictionHost, view: StepView, done: set[str]
) -> list[tuple[PregelExecutableTask, list[Any], Entry]]:
    """The writes of the step's tasks whose adopted run has returned but which have not
    finished yet: what they will write (the same node on an equal input), known now."""
    adopting = spec.table.adopting()
    return [
        (task, list(entry.task.writes), entry)
        for task in view.tasks
        if task.id not in done and (entry := adopting.get(task.id)) is not None and entry.ok
    ]


def _null_step(spec: PredictionHost, real: World) -> list[PregelExecutableTask]:
    out = real.fork().prepare(spec.config)
    try:
        for task in out:
            for writer in task.writers:
                writer.invoke(None, task.config)  # no update (any state schema)
    except Exception:  # a node whose edges cannot take an empty update: no prediction
        return []
    return out
