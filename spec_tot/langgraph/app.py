"""``from_langgraph``: a LangGraph graph run by LangGraph's own loop, speculatively.

The returned graph *is* the compiled LangGraph graph it was given (same class, same
attributes: a ``CompiledStateGraph``, or a ``Pregel`` for the functional API and hand-built
graphs), copied, with two seams in what its nodes' tasks run (``_pregel.SeamedNode``,
``spec_tot.langgraph.adoption``): speculable nodes adopt speculative runs, and every node
tells the run when a task is done. Everything LangGraph does (checkpointers, stores,
caches, ``thread_id``, durability, interrupts and ``Command(resume=...)``, subgraphs, every
``stream_mode``, error handlers, retries and timeouts, ``with_config``, ``max_concurrency``,
the Runtime, drawing) it does here too, because LangGraph runs it: a run's speculation
starts with the loop's first task and ends with the loop (``spec_tot.langgraph.graph_run``).
``arun``/``run`` also return the run's task tree and figures; ``speculation_of`` gives a
graph's roles and slots.
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Mapping
from typing import Any

from langchain_core.runnables import RunnableConfig

from spec_tot.config import MODES, ExecutorConfig
from spec_tot.errors import ConfigError, QueryTimeoutError, UnknownNameError
from spec_tot.langgraph._pregel import Pregel, rewire_nodes
from spec_tot.langgraph.adoption import AdoptingNode, SpeculativeNode, TaskObserver
from spec_tot.langgraph.graph_run import RunClaim, run_claim
from spec_tot.langgraph.plan import SpeculationPlan
from spec_tot.langgraph.results import LangGraphMetrics, LangGraphResult
from spec_tot.langgraph.roles import NodeRole, roles_of
from spec_tot.langgraph.slots import SpeculationSlots

__all__ = ["arun", "from_langgraph", "run", "speculation_of"]


def speculation_of(graph: Any) -> SpeculationPlan:
    """The speculation plan of a graph ``from_langgraph`` made (its roles and slots;
    ``with_config`` copies share it)."""
    for node in getattr(graph, "nodes", {}).values():
        observer = getattr(node, "observer", None)
        if isinstance(observer, TaskObserver) and isinstance(observer.plan, SpeculationPlan):
            return observer.plan
    raise ConfigError("graph", "not a graph made by spec_tot.from_langgraph")


async def arun(
    graph: Any, input: Any, config: RunnableConfig | None = None, **kwargs: Any
) -> LangGraphResult:
    """``graph.ainvoke(input, config, **kwargs)``, and the run's task tree and figures. The
    plan's ``query_timeout_s`` bounds the run (``QueryTimeoutError``)."""
    plan = speculation_of(graph)
    claim = RunClaim(plan)
    token = run_claim.set(claim)
    try:
        async with asyncio.timeout(plan.timeout_s):
            state = await graph.ainvoke(input, config, **kwargs)
    except TimeoutError as exc:
        raise QueryTimeoutError(f"graph run exceeded {plan.timeout_s}s") from exc
    finally:
        run_claim.reset(token)
    return _result(state, claim)


def run(
    graph: Any, input: Any, config: RunnableConfig | None = None, **kwargs: Any
) -> LangGraphResult:
    """Sync twin of ``arun`` (LangGraph's sync loop: nodes on its worker threads). No
    timeout: a sync node cannot be interrupted."""
    claim = RunClaim(speculation_of(graph))
    token = run_claim.set(claim)
    try:
        state = graph.invoke(input, config, **kwargs)
    finally:
        run_claim.reset(token)
    return _result(state, claim)


def _result(state: Any, claim: RunClaim) -> LangGraphResult:
    done = claim.run
    if done is None:  # the graph ran no task
        return LangGraphResult(state, (), LangGraphMetrics(0.0, 0, 0, 0, 0, 0, 0, 0))
    return LangGraphResult(state, done.tasks(), done.metrics())


def _compiled(graph: Any) -> Any:
    from langgraph.graph import StateGraph

    if isinstance(graph, StateGraph):
        return graph.compile()
    if isinstance(graph, Pregel):
        return graph
    raise ConfigError(
        "graph", f"expected a LangGraph StateGraph, its compiled graph or a Pregel: {graph!r}"
    )


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


def _checked_mode(mode: str | None, config: ExecutorConfig | None, max_depth: int) -> str:
    """The run's mode (``mode``, else ``config``'s, else ``full``), every option checked."""
    if mode is not None and config is not None and mode != config.mode:
        raise ConfigError("mode", f"{mode!r} disagrees with config.mode {config.mode!r}")
    mode = mode or (config.mode if config is not None else "full")
    if mode not in MODES:
        raise UnknownNameError("executor mode", mode, list(MODES))
    if max_depth < 0:
        raise ConfigError("max_depth", f"must be >= 0, got {max_depth}")
    return mode


def _plan(
    nodes: Any,
    node_roles: dict[str, NodeRole],
    speculate: bool,
    backend: Any,
    max_speculative: int | None,
    max_depth: int,
    config: ExecutorConfig | None,
) -> SpeculationPlan:
    """The speculation plan every run of the graph shares: its roles, slots and limits."""
    slots = SpeculationSlots(max_speculative, max_level=max_depth)
    for generation_backend in _backends(backend):
        slots.learn(generation_backend)
    selects = [r for r in node_roles.values() if r.select]
    return SpeculationPlan(
        roles=node_roles,
        speculate=speculate,
        slots=slots,
        strict=bool(selects) and all(r.top_k for r in selects),
        timeout_s=config.query_timeout_s if config is not None else None,
        base_nodes=nodes,
    )


def from_langgraph(
    graph: Any,
    *,
    mode: str | None = None,
    config: ExecutorConfig | None = None,
    backend: Any = None,
    max_speculative: int | None = None,
    max_depth: int = 2,
    roles: Mapping[str, Mapping[str, Any]] | None = None,
) -> Any:
    """Run a LangGraph graph speculatively, on LangGraph's own loop.

    ``graph``: a ``StateGraph`` (compiled with defaults), a compiled graph (its name,
    bound config, checkpointer, store, cache and interrupts kept) or any ``Pregel``; the
    result is a graph of the same class. ``metadata={"spec_tot": {...}}`` on its nodes, or
    ``roles={node: {...}}`` here (the same keys), marks what may run ahead (see
    ``spec_tot.langgraph.roles``). ``mode``: ``"full"`` (default: speculate) or
    ``"baseline"``/``"dedup"`` (LangGraph's schedule exactly); ``config``: an
    ``ExecutorConfig`` whose mode and ``query_timeout_s`` (for ``arun``) apply.

    Speculative tasks are admitted by the speculation dispatcher of the spec-tot backends
    the graph's model calls go to (``ChatSpecTot``'s backend, learnt at its first call, or
    ``backend``: a ``GenerationBackend``, a ``ChatSpecTot``, or a list of them), the one
    every ToT app and LangGraph app on that backend shares. A graph over other LangChain
    models has no such backend: its speculative tasks go through the app's own dispatcher
    (16 sequences); a node that makes no model call is run ahead when what it saves (its
    committed runs' seconds, and the model calls it unblocks) outweighs what a miss wastes
    (its CPU). ``max_speculative``: a cap on the app's speculative tasks at once
    (default: none beyond the dispatchers'); sync node functions run
    ahead on threads of their own, as many as that cap, never on LangGraph's. ``max_depth``:
    how many partial speculative supersteps a prediction may build on.
    """
    mode = _checked_mode(mode, config, max_depth)
    compiled = _compiled(graph)
    try:
        nodes = speculation_of(compiled).base_nodes  # a speculative graph: start from its own
    except ConfigError:
        nodes = compiled.nodes
    node_roles = roles_of(nodes, roles)
    # Nothing may run ahead in a graph of impure nodes: its runs need no speculator.
    speculate = mode not in ("baseline", "dedup") and any(r.pure for r in node_roles.values())
    plan = _plan(nodes, node_roles, speculate, backend, max_speculative, max_depth, config)

    def seam(kind: type[AdoptingNode | SpeculativeNode], name: str) -> Any:
        if not (speculate and node_roles[name].pure):
            return None
        return functools.partial(kind, role=node_roles[name], plan=plan)

    plan.fork_nodes.update(rewire_nodes(nodes, functools.partial(seam, SpeculativeNode)))
    out = copy.copy(compiled)  # the same class and attributes: LangGraph's graph, as given
    out.nodes = rewire_nodes(
        nodes,
        functools.partial(seam, AdoptingNode),
        observer=lambda name: TaskObserver(name, plan),
    )
    return out
