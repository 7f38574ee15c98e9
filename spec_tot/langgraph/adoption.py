"""The runnables spec-tot puts into a compiled graph's nodes.

LangGraph's loop runs the graph; these only stand at two seams of each node:

- ``AdoptingNode`` replaces a speculable node's runnable in the graph the loop runs. Called
  by a real task, it asks the run's speculator for a speculative run of the same node on an
  equal input; if there is one, it waits for it and returns its return value (the node's
  writers, conditional edges included, then run as LangGraph runs them), after replaying
  what the run showed (callbacks, custom stream chunks); otherwise it calls the node.
- ``SpeculativeNode`` replaces it in the copy of the graph a prediction prepares tasks
  from: it runs the node inside its speculative entry (callbacks and stream writer go to
  the entry's log, sync functions to the run's own threads) and keeps a private copy of
  what it returned.
- ``TaskObserver`` is appended to every node's writers: it tells the run a real task has
  finished and what it wrote.

Each knows its app's ``SpeculationPlan``, which finds (or starts) the run of the LangGraph
loop calling it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import set_config_context

from spec_tot.langgraph._pregel import has_native_async, private_copy, with_stream_writer
from spec_tot.langgraph.roles import NodeRole

if TYPE_CHECKING:
    from spec_tot.langgraph.entries import Entry

__all__ = ["AdoptingNode", "RunFinder", "SpeculativeNode", "TaskObserver", "speculating"]


class RunCalls(Protocol):
    """What a wrapped node asks of the run its loop is (``GraphRun``)."""

    def call(self, node: AdoptingNode, input: Any, config: RunnableConfig, kw: Any) -> Any: ...
    async def acall(
        self, node: AdoptingNode, input: Any, config: RunnableConfig, kw: Any
    ) -> Any: ...
    def task_done(self, config: RunnableConfig) -> None: ...


class RunFinder(Protocol):
    """Where a wrapped node finds that run (``SpeculationPlan.run_for``)."""

    def run_for(self, config: RunnableConfig | None) -> RunCalls | None: ...


# The speculative entry whose task is running (set by the speculator for its tasks).
speculating: ContextVar[Entry | None] = ContextVar("spec_tot_lg_entry", default=None)


class _Wrapper(Runnable[Any, Any]):
    def __init__(self, inner: Runnable[Any, Any], role: NodeRole, plan: RunFinder) -> None:
        self.inner = inner
        self.role = role
        self.plan = plan
        self.name = getattr(inner, "name", None) or role.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def sync_only(self) -> bool:
        """Sync code only (LangGraph's async path would run it on the event loop's default
        executor): speculation runs it on the run's own threads instead."""
        return not has_native_async(self.inner)


class AdoptingNode(_Wrapper):
    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        run = self.plan.run_for(config)
        if run is None or config is None:
            return self.inner.invoke(input, config, **kwargs)
        return run.call(self, input, config, kwargs)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        run = self.plan.run_for(config)
        if run is None or config is None:
            return await self.inner.ainvoke(input, config, **kwargs)
        return await run.acall(self, input, config, kwargs)


class SpeculativeNode(_Wrapper):
    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        raise RuntimeError("speculative tasks run on the speculator's event loop")

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        entry = speculating.get()
        if entry is None or config is None:  # not one of this graph's predictions
            return await self.inner.ainvoke(input, config, **kwargs)
        config = with_stream_writer(entry.log.configure(config), entry.log.stream_writer)
        # As LangGraph's own node runner does: the node's code sees this config as the
        # current one (a model called without a config logs into the entry too).
        with set_config_context(config) as context:
            if self.sync_only and entry.pool is not None:
                call: Callable[[], Any] = lambda: self.inner.invoke(input, config, **kwargs)  # noqa: E731
                # a copy: a cancelled run's thread may still be inside it when we leave
                thread = entry.pool.submit(context.copy().run, call)
                entry.threads.append(thread)
                out = await asyncio.wrap_future(thread)
            else:
                coro = self.inner.ainvoke(input, config, **kwargs)
                out = await asyncio.create_task(coro, context=context)
        entry.output = private_copy(out)
        entry.has_output = True
        return out


class TaskObserver(Runnable[Any, Any]):
    """The last writer of a node: passes its input on, and tells the run the task's writes
    are complete."""

    def __init__(self, node: str, plan: RunFinder) -> None:
        self.node = node
        self.plan = plan
        self.name = f"{node}:observer"

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        run = self.plan.run_for(config)
        if run is not None and config is not None:
            run.task_done(config)
        return input

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        run = self.plan.run_for(config)
        if run is not None and config is not None:
            run.task_done(config)
        return input
