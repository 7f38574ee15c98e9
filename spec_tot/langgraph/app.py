"""``from_langgraph``: an unmodified LangGraph ``StateGraph`` run speculatively.

The returned ``SpeculativeGraph`` is a Runnable that answers as the graph's compiled form
does (``invoke`` returns the final state; ``stream`` yields ``values``/``updates``/``custom``
chunks; ``context=`` and ``RunnableConfig`` reach the nodes; ``recursion_limit`` raises
``GraphRecursionError``), while pure nodes run ahead of the superstep barrier (see
``spec_tot.langgraph.speculation``). ``arun`` also returns the run's task tree and figures.
What spec-tot cannot honour (checkpointers, stores, caches, interrupts, thread ids) is
refused with an error naming the option.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import is_dataclass
from typing import Any

from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import ensure_config, get_async_callback_manager_for_config
from pydantic import BaseModel

import spec_tot.langgraph._pregel as pregel
from spec_tot._private.threads import iterate_in_thread, run_in_thread_if_needed
from spec_tot.config import MODES, ExecutorConfig
from spec_tot.errors import ConfigError, QueryTimeoutError, UnknownNameError
from spec_tot.langgraph.entries import SendOwners
from spec_tot.langgraph.results import LangGraphResult
from spec_tot.langgraph.roles import NodeRole, roles_of
from spec_tot.langgraph.runner import GraphRun, Sink
from spec_tot.langgraph.slots import SpeculationSlots
from spec_tot.langgraph.speculation import SPECULATIVE_TAG, Speculator

__all__ = ["SpeculativeGraph", "from_langgraph"]

STREAM_MODES = ("values", "updates", "custom")
# Options of LangGraph's invoke/stream that need its checkpointing runtime.
_REFUSED = {
    "interrupt_before": "interrupts need a checkpointer",
    "interrupt_after": "interrupts need a checkpointer",
    "durability": "spec-tot runs keep no checkpoints",
    "checkpoint_during": "spec-tot runs keep no checkpoints",
    "control": "drain control is part of LangGraph's own loop",
    "subgraphs": "subgraph streaming is not supported",
    "print_mode": "print_mode is not supported; use stream_mode",
    "debug": "debug output is not supported; use stream_mode='updates'",
}
_THREAD_KEYS = ("thread_id", "checkpoint_id", "checkpoint_ns", "checkpoint_map")


def _check_kwargs(kwargs: Mapping[str, Any]) -> None:
    for key, value in kwargs.items():
        if key in _REFUSED:
            if value in (None, False, (), []):
                continue  # the default value asks for nothing
            raise ConfigError(key, _REFUSED[key])
        if key == "version" and value == "v1":
            continue
        raise ConfigError(key, "not an option spec-tot's LangGraph runner takes")


def _check_config(config: RunnableConfig) -> None:
    configurable = config.get("configurable") or {}
    for key in _THREAD_KEYS:
        if configurable.get(key) is not None:
            raise ConfigError(
                f"configurable.{key}",
                "spec-tot runs keep no checkpoints, so there is no thread to address",
            )
    if config["recursion_limit"] < 1:
        raise ConfigError("recursion_limit", "must be at least 1")


def _coerce_context(schema: Any, context: Any) -> Any:
    if context is None or schema is None or not isinstance(context, dict):
        return context
    if isinstance(schema, type) and (issubclass(schema, BaseModel) or is_dataclass(schema)):
        return schema(**context)
    return context


def _modes(stream_mode: str | Sequence[str] | None) -> tuple[list[str], bool]:
    single = stream_mode is None or isinstance(stream_mode, str)
    modes = [str(stream_mode or "values")] if single else [str(m) for m in stream_mode or ()]
    for mode in modes:
        if mode not in STREAM_MODES:
            raise ConfigError("stream_mode", f"{mode!r} is unsupported; use one of {STREAM_MODES}")
    return modes, single


class SpeculativeGraph(Runnable[Any, Any]):
    """A compiled ``StateGraph`` run by spec-tot; build it with ``from_langgraph``."""

    def __init__(
        self,
        compiled: Any,
        roles: Mapping[str, NodeRole],
        *,
        speculate: bool,
        max_speculative: int | None,
        max_depth: int,
        timeout_s: float | None,
        backend: Any = None,
    ) -> None:
        if max_depth < 0:
            raise ConfigError("max_depth", f"must be >= 0, got {max_depth}")
        self.compiled = compiled
        self.roles = dict(roles)
        self.speculate = speculate
        self.slots = SpeculationSlots(max_speculative)
        for generation_backend in _backends(backend):
            self.slots.learn(generation_backend)
        self.max_depth = max_depth
        self.timeout_s = timeout_s
        selects = [r for r in self.roles.values() if r.select]
        self.strict = bool(selects) and all(r.top_k for r in selects)
        self.name = compiled.get_name()

    # -- what LangGraph users look at -------------------------------------------------------
    def get_graph(self, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        """The user's graph (LangGraph's own drawing of it)."""
        return self.compiled.get_graph(config, **kwargs)

    def get_input_schema(self, config: RunnableConfig | None = None) -> type[BaseModel]:
        schema: type[BaseModel] = self.compiled.get_input_schema(config)
        return schema

    def get_output_schema(self, config: RunnableConfig | None = None) -> type[BaseModel]:
        schema: type[BaseModel] = self.compiled.get_output_schema(config)
        return schema

    def get_input_jsonschema(self, config: RunnableConfig | None = None) -> dict[str, Any]:
        schema: dict[str, Any] = self.compiled.get_input_jsonschema(config)
        return schema

    def get_output_jsonschema(self, config: RunnableConfig | None = None) -> dict[str, Any]:
        schema: dict[str, Any] = self.compiled.get_output_jsonschema(config)
        return schema

    # -- running --------------------------------------------------------------------------
    async def arun(
        self,
        input: Any,
        config: RunnableConfig | None = None,
        *,
        context: Any = None,
        output_keys: str | Sequence[str] | None = None,
        sink: Sink | None = None,
        stream_keys: str | Sequence[str] | None = None,
        threads: bool = False,
    ) -> LangGraphResult:
        """One run: the graph's output, its task tree and its figures. ``threads``: run the
        nodes on worker threads, as LangGraph's sync ``invoke`` does (the sync twins set
        it, so that a step's sync nodes run in parallel)."""
        if isinstance(input, pregel.Command):
            raise ConfigError("input", "Command input resumes a checkpointed thread: unsupported")
        config = ensure_config(config)
        _check_config(config)
        manager = get_async_callback_manager_for_config(config)
        run_manager = await manager.on_chain_start(
            None, input, name=config.get("run_name") or self.get_name(), run_id=config.get("run_id")
        )
        pools = (
            (
                ThreadPoolExecutor(config.get("max_concurrency")),
                ThreadPoolExecutor(self.slots.threads()),
            )
            if threads
            else None
        )
        run = self._new_run(config, context, output_keys, stream_keys, sink, run_manager, pools)
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await run.run(input)
        except TimeoutError as exc:
            error = QueryTimeoutError(f"graph run exceeded {self.timeout_s}s")
            await run_manager.on_chain_error(error)
            raise error from exc
        except BaseException as exc:
            await asyncio.shield(run_manager.on_chain_error(exc))
            raise
        finally:
            for pool in pools or ():
                # Threads cannot be interrupted: wait for what still runs (cancelled
                # speculative work included), so that nothing outlives the run.
                shutdown = functools.partial(pool.shutdown, wait=True, cancel_futures=True)
                await asyncio.get_running_loop().run_in_executor(None, shutdown)
        await run_manager.on_chain_end(result.state)
        return result

    def _new_run(
        self,
        config: RunnableConfig,
        context: Any,
        output_keys: str | Sequence[str] | None,
        stream_keys: str | Sequence[str] | None,
        sink: Sink | None,
        run_manager: Any,
        pools: tuple[Executor, Executor] | None,
    ) -> GraphRun:
        compiled = self.compiled
        run = GraphRun(
            compiled=compiled,
            config=config,
            recursion_limit=config["recursion_limit"],
            prefix=f"lg-{uuid.uuid4().hex[:12]}",
            output_keys=output_keys if output_keys is not None else compiled.output_channels,
            stream_keys=stream_keys if stream_keys is not None else compiled.stream_channels_asis,
            sink=sink,
            manager=run_manager,
            pool=pools[0] if pools else None,
            roles=self.roles,
        )
        runtime = pregel.Runtime(
            context=_coerce_context(compiled.context_schema, context),
            stream_writer=run.custom_writer,
        )
        configurable = {**(config.get("configurable") or {}), pregel.CONFIG_KEY_RUNTIME: runtime}
        run.config = {**config, "configurable": configurable}
        if not self.speculate:
            return run
        tags = [*(run.config.get("tags") or []), SPECULATIVE_TAG]
        spec_config: RunnableConfig = {**run.config, "tags": tags}

        slots = self.slots.for_run(run.prefix)
        run.admission = functools.partial(slots.admit, None, _never)

        def make(owners: SendOwners, clock: Callable[[], float]) -> Speculator:
            return Speculator(
                roles=self.roles,
                config=spec_config,
                manager=run.manager,
                slots=slots,
                max_depth=self.max_depth,
                strict=self.strict,
                prefix=run.prefix,
                clock=clock,
                owners=owners,
                pool=pools[1] if pools else None,
            )

        run.make_speculator = make
        return run

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return await self._ainvoke(input, config, False, **kwargs)

    async def _ainvoke(
        self, input: Any, config: RunnableConfig | None, threads: bool, **kwargs: Any
    ) -> Any:
        context = kwargs.pop("context", None)
        output_keys = kwargs.pop("output_keys", None)
        stream_mode = kwargs.pop("stream_mode", "values")
        _check_kwargs(kwargs)
        if stream_mode != "values":
            stream = self._astream(input, config, threads, stream_mode=stream_mode)
            return [c async for c in stream]
        result = await self.arun(
            input, config, context=context, output_keys=output_keys, threads=threads
        )
        return result.state

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return run_in_thread_if_needed(self._ainvoke(input, config, True, **kwargs))

    def run(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        """Sync twin of ``arun`` (nodes on worker threads)."""
        return run_in_thread_if_needed(self.arun(input, config, threads=True, **kwargs))

    def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        return self._astream(input, config, False, **kwargs)

    async def _astream(
        self, input: Any, config: RunnableConfig | None, threads: bool, **kwargs: Any
    ) -> AsyncIterator[Any]:
        context = kwargs.pop("context", None)
        output_keys = kwargs.pop("output_keys", None)
        # As LangGraph's stream: every state key unless output_keys says otherwise.
        keys = output_keys if output_keys is not None else self.compiled.stream_channels_asis
        modes, single = _modes(kwargs.pop("stream_mode", None))
        _check_kwargs(kwargs)
        queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()

        def sink(mode: str, chunk: Any) -> None:
            if mode in modes:
                queue.put_nowait((mode, chunk))

        async def drive() -> None:
            try:
                await self.arun(
                    input,
                    config,
                    context=context,
                    sink=sink,
                    output_keys=keys,
                    stream_keys=keys,
                    threads=threads,
                )
            finally:
                queue.put_nowait(None)

        task = asyncio.ensure_future(drive())
        try:
            while (item := await queue.get()) is not None:
                yield item[1] if single else item
            await task  # raises the run's error, if any
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait([task])

    def stream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[Any]:
        yield from iterate_in_thread(self._astream(input, config, True, **kwargs))


def _never() -> bool:
    return False


def _compiled(graph: Any) -> Any:
    from langgraph.graph import StateGraph
    from langgraph.graph.state import CompiledStateGraph

    if isinstance(graph, StateGraph):
        return graph.compile()
    if isinstance(graph, CompiledStateGraph):
        for option, value in (
            ("checkpointer", graph.checkpointer),
            ("store", graph.store),
            ("cache", graph.cache),
            ("interrupt_before", graph.interrupt_before_nodes),
            ("interrupt_after", graph.interrupt_after_nodes),
        ):
            if value:
                raise ConfigError(
                    option,
                    "spec-tot runs keep no checkpoints, stores or caches and never "
                    "interrupt; compile the graph without it",
                )
        return graph
    raise ConfigError("graph", f"expected a langgraph StateGraph or its compiled graph: {graph!r}")


def _backends(backend: Any) -> list[Any]:
    """The spec-tot backends named by ``from_langgraph(backend=...)``."""
    from spec_tot.backends import GenerationBackend
    from spec_tot.chat_spec_tot import ChatSpecTot

    if backend is None:
        return []
    items = list(backend) if isinstance(backend, list | tuple) else [backend]
    out = []
    for item in items:
        if isinstance(item, ChatSpecTot):
            item = item.generation_backend
        if not isinstance(item, GenerationBackend):
            raise ConfigError(
                "backend",
                "expected a spec-tot GenerationBackend or a ChatSpecTot (or a list of them), "
                f"got {type(item).__name__}; a graph over other LangChain models speculates "
                "in the app's own pool (max_speculative), with no backend given",
            )
        out.append(item)
    return out


def from_langgraph(
    graph: Any,
    *,
    mode: str | None = None,
    config: ExecutorConfig | None = None,
    backend: Any = None,
    max_speculative: int | None = None,
    max_depth: int = 2,
) -> SpeculativeGraph:
    """Run a LangGraph ``StateGraph`` (or its compiled graph) speculatively.

    The graph runs as it is; ``metadata={"spec_tot": {...}}`` on its nodes marks what may
    run ahead (see ``spec_tot.langgraph.roles``). ``mode``: ``"full"`` (default: speculate)
    or ``"baseline"`` (LangGraph's schedule exactly); ``config``: an ``ExecutorConfig`` whose
    mode and ``query_timeout_s`` apply.

    Speculative tasks take their slots from the speculation budget of the spec-tot backends
    the graph's model calls go to (``ChatSpecTot``'s backend, learnt at its first call, or
    ``backend``: a ``GenerationBackend``, a ``ChatSpecTot``, or a list of them), the budget
    every ToT app and LangGraph app on that backend shares. A graph over other LangChain
    models has no such budget: its speculative tasks share the app's own pool.
    ``max_speculative``: a cap on the app's speculative tasks at once (default: 16 for the
    own pool, none beyond the budgets once a backend is known). ``max_depth``: how many
    partial speculative supersteps a prediction may build on.
    """
    if mode is not None and config is not None and mode != config.mode:
        raise ConfigError("mode", f"{mode!r} disagrees with config.mode {config.mode!r}")
    mode = mode or (config.mode if config is not None else "full")
    if mode not in MODES:
        raise UnknownNameError("executor mode", mode, list(MODES))
    compiled = _compiled(graph)
    return SpeculativeGraph(
        compiled,
        roles_of(compiled.builder),
        speculate=mode not in ("baseline", "dedup"),
        max_speculative=max_speculative,
        max_depth=max_depth,
        timeout_s=config.query_timeout_s if config is not None else None,
        backend=backend,
    )
