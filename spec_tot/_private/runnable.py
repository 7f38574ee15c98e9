"""What ``ToTApp``'s Runnable methods need: RunnableConfig -> per-call app, search events ->
LangChain custom events (``astream_events(version="v2")``, LangGraph ``stream_mode="custom"``),
and the depth bound that ``recursion_limit`` sets.

- ``configurable["spec_tot"]`` (a dict of ``ExecutorConfig`` fields: mode, seed, max_nodes,
  query_timeout_s, speculation_overrides, ...) overrides the app's executor config per call.
- ``recursion_limit``, when the caller sets it explicitly (not LangChain's or LangGraph's
  default), bounds the tree depth: no node deeper than it is ever expanded.
- ``max_concurrency`` bounds the queries in flight; callbacks, tags, metadata and run names
  go to the callback manager as for any Runnable.
"""

from __future__ import annotations

import asyncio
import copy
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from langchain_core.callbacks import AsyncCallbackManagerForChainRun, adispatch_custom_event
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import (
    ensure_config,
    get_async_callback_manager_for_config,
    patch_config,
)

from spec_tot.config import ExecutorConfig
from spec_tot.errors import ConfigError
from spec_tot.events import ToTEvent
from spec_tot.policies.base import Answer, Candidate, Expansion, SearchPolicy
from spec_tot.tree import Node, SearchTree

if TYPE_CHECKING:
    from spec_tot.executor.hub import QueryInput
    from spec_tot.results import ToTResult

__all__ = [
    "CONFIGURABLE_KEY",
    "ChainRuns",
    "DepthBound",
    "EventPump",
    "configured_app",
]

CONFIGURABLE_KEY = "spec_tot"
_EXECUTOR_FIELDS = frozenset(f.name for f in fields(ExecutorConfig) if f.init)


class DepthBound(SearchPolicy):
    """Wraps a policy so that no node deeper than ``max_depth`` is expanded or speculated."""

    def __init__(self, inner: SearchPolicy, max_depth: int) -> None:
        self.inner = inner
        self.max_depth = max_depth
        self.aggregation = inner.aggregation
        self.name = inner.name  # type: ignore[misc]
        self.discards_unselected = inner.discards_unselected  # type: ignore[misc]

    def _fits(self, tree: SearchTree, parent_id: str) -> bool:
        parent = tree.get(parent_id)
        return parent is not None and parent.depth < self.max_depth

    def initial(self, tree: SearchTree) -> list[Expansion]:
        return [e for e in self.inner.initial(tree) if self._fits(tree, e.parent_id)]

    def on_reward(self, tree: SearchTree, scored: Sequence[Node]) -> list[Expansion]:
        return [e for e in self.inner.on_reward(tree, scored) if self._fits(tree, e.parent_id)]

    def predict(self, tree: SearchTree, budget: int) -> list[Candidate]:
        return [c for c in self.inner.predict(tree, budget) if self._fits(tree, c.parent_id)]

    def done(self, tree: SearchTree) -> bool:
        return self.inner.done(tree)

    def answer(self, tree: SearchTree) -> Answer | None:
        return self.inner.answer(tree)

    def keep_count(self, tree: SearchTree) -> int | None:
        return self.inner.keep_count(tree)

    def score(self, node: Node) -> float:
        return self.inner.score(node)


def _explicit_recursion_limit(config: Mapping[str, Any] | None) -> int | None:
    """The caller's own recursion_limit; LangGraph's default is an int subclass, skipped."""
    if config is None:
        return None
    value = config.get("recursion_limit")
    if type(value) is not int:
        return None
    if value < 1:
        raise ConfigError("recursion_limit", f"must be >= 1, got {value}")
    return value


class ConfigurableApp(Protocol):
    """What a per-call copy changes of an app (``ToTApp``)."""

    config: ExecutorConfig
    policy_factory: Callable[[], SearchPolicy]

    @property
    def backend(self) -> Any: ...


App = TypeVar("App", bound=ConfigurableApp)


def configured_app(app: App, config: Mapping[str, Any] | None) -> App:
    """``app`` itself, or a shallow copy sharing its backend with the per-call settings."""
    overrides = dict(((config or {}).get("configurable") or {}).get(CONFIGURABLE_KEY) or {})
    limit = _explicit_recursion_limit(config)
    if not overrides and limit is None:
        return app
    unknown = sorted(set(overrides) - _EXECUTOR_FIELDS)
    if unknown:
        raise ConfigError(
            f"configurable.{CONFIGURABLE_KEY}",
            f"unknown keys {unknown}; known: {sorted(_EXECUTOR_FIELDS)}",
        )
    _ = app.backend  # create a named backend once, so the copy shares it
    out = copy.copy(app)
    if overrides:
        current = {f: getattr(app.config, f) for f in _EXECUTOR_FIELDS}
        out.config = ExecutorConfig(**{**current, **overrides})
    if limit is not None:
        factory = app.policy_factory
        out.policy_factory = lambda: DepthBound(factory(), limit)
    return out


class EventPump:
    """A sync ``on_event`` sink that forwards each event, in order, as a LangChain custom
    event under the run of its query, and to LangGraph's stream writer when the app runs as
    a node of a LangGraph graph."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[ToTEvent | None] = asyncio.Queue()
        self._runs: dict[str, tuple[AsyncCallbackManagerForChainRun, RunnableConfig]] = {}
        self._task: asyncio.Task[None] | None = None
        # LangGraph's stream writer of the node running the app, if it runs as one (taken
        # where the app is called: the node's context holds it).
        self._writer = _langgraph_stream_writer()

    def bind(
        self, query_id: str, run: AsyncCallbackManagerForChainRun, config: RunnableConfig
    ) -> None:
        self._runs[query_id] = (run, patch_config(config, callbacks=run.get_child()))

    def __call__(self, event: ToTEvent) -> None:
        self._queue.put_nowait(event)

    def start(self) -> None:
        self._task = asyncio.create_task(self._drain())

    async def stop(self) -> None:
        if self._task is not None:
            self._queue.put_nowait(None)
            await asyncio.shield(self._task)

    async def _drain(self) -> None:
        while (event := await self._queue.get()) is not None:
            bound = self._runs.get(event.query_id)
            if bound is None:
                continue
            _run, config = bound
            payload = event.payload()
            await adispatch_custom_event(event.kind, payload, config=config)
            if self._writer is not None:
                self._writer({"event": event.kind, **payload})


def _langgraph_stream_writer() -> Callable[[Any], None] | None:
    """LangGraph's public ``get_stream_writer()`` inside a LangGraph node, else None. A run
    of LangGraph has imported it: an app used without LangGraph never imports it here."""
    config_module = sys.modules.get("langgraph.config")
    if config_module is None:
        return None
    try:
        writer: Callable[[Any], None] = config_module.get_stream_writer()
    except (RuntimeError, KeyError):  # not inside a LangGraph run (or no runnable at all)
        return None
    return writer


class ChainRuns:
    """One LangChain chain run per query of a call, its search events forwarded to that run
    (``EventPump``): started before the batch, ended with each query's result, or all
    failed with the batch's exception."""

    def __init__(self, pump: EventPump, runs: list[AsyncCallbackManagerForChainRun]) -> None:
        self.pump = pump
        self._runs = runs

    @classmethod
    async def start(
        cls,
        name: str,
        inputs: Sequence[Any],
        queries: Sequence[QueryInput],
        configs: Sequence[RunnableConfig | None],
    ) -> ChainRuns:
        pump, runs = EventPump(), []
        for value, query, raw in zip(inputs, queries, configs, strict=True):
            cfg = ensure_config(raw)
            manager = get_async_callback_manager_for_config(cfg)
            run = await manager.on_chain_start(
                None, value, name=cfg.get("run_name") or name, run_id=cfg.pop("run_id", None)
            )
            pump.bind(query.query_id, run, cfg)
            runs.append(run)
        pump.start()
        return cls(pump, runs)

    async def end(self, results: Sequence[ToTResult]) -> None:
        await self.pump.stop()
        for run, result in zip(self._runs, results, strict=True):
            await run.on_chain_end(result)

    async def fail(self, exc: BaseException) -> None:
        await self.pump.stop()
        for run in self._runs:
            await run.on_chain_error(exc)
