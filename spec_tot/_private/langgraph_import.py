"""``from_langgraph``: a LangGraph ``StateGraph`` annotated for spec-tot, run by spec-tot.

The metadata contract. Every node carries ``metadata={"spec_tot": {"kind": ..., ...}}``:

- ``thought``: ``prompt`` (branch state -> prompt text, required), ``sampling``
  (``SamplingParams`` or a dict of its fields), ``parse`` (branch state, text -> update;
  default: append the text to ``steps``). spec-tot generates through its backend with the
  per-node seed (``ExecutorConfig.seed`` + node id); the node's own function is what LangGraph
  runs and is never called by spec-tot. Thought nodes are always speculable (seeded samples
  make an adopted speculative node identical to the committed one); ``speculable: False`` is
  refused: use ``mode="baseline"``.
- ``reward``: ``scorer`` (a RewardBackend or a callable over RewardItems; default: the
  ``reward``/``backend`` given here), ``reward_input`` (branch state -> (question, steps)).
- ``tool``: ``fn`` (default: the node's own function), ``speculable``/``pure`` (default
  False: the tool runs only on committed branches).
- ``function``: ``fn`` (default: the node's own function), a pure branch-state transform.
- ``select``: the tree-level step of LangGraph's ToT tutorial (``prune``: keep the best
  candidates, ``Send`` one ``expand`` per kept beam, or end). spec-tot replaces it, and the
  Send fan-out of its conditional edge, by the search policy (``search``, default: the
  metadata's ``search``/``search_params``, else ``"beam"``). ``terminal`` (branch state ->
  bool) says when a branch is finished; ``answer`` (branch state -> answer) is the default
  answer extractor. Its only incoming edge comes from the reward node; its conditional edge
  needs a ``path_map`` naming exactly one node besides END (the node it loops back to).

spec-tot calls every callable with the *branch* state: the input dict (``question`` and any
other keys) plus ``steps`` and the updates of the nodes on the branch so far. Routers of
other conditional edges run on the branch state too and must return a path_map key or a node
name (never a ``Send``). Unsupported shapes raise ``GraphValidationError`` naming the node:
nodes without metadata, unknown kinds, deferred nodes, joins (``add_edge([a, b], c)``),
several conditional edges from one node, async-only routers, more than one select node.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

from spec_tot.app import ToTApp
from spec_tot.backends import GenerationBackend, RewardBackend
from spec_tot.config import ExecutorConfig
from spec_tot.errors import ConfigError, GraphValidationError
from spec_tot.graph import END, State, ThoughtGraph

__all__ = ["KINDS", "METADATA_KEY", "from_langgraph"]

METADATA_KEY = "spec_tot"
KINDS = ("thought", "reward", "tool", "function", "select")
_KEYS: dict[str, frozenset[str]] = {
    "thought": frozenset({"prompt", "sampling", "parse", "speculable"}),
    "reward": frozenset({"scorer", "reward_input", "speculable"}),
    "tool": frozenset({"fn", "speculable", "pure"}),
    "function": frozenset({"fn", "speculable", "pure"}),
    "select": frozenset({"terminal", "answer", "search", "search_params"}),
}


def _spec_of(name: str, node: Any) -> dict[str, Any]:
    meta = getattr(node, "metadata", None) or {}
    spec = meta.get(METADATA_KEY)
    if not isinstance(spec, Mapping):
        raise GraphValidationError(
            name, f"has no metadata[{METADATA_KEY!r}] dict; declare kind (one of {KINDS})"
        )
    kind = spec.get("kind")
    if kind not in KINDS:
        raise GraphValidationError(name, f"metadata kind {kind!r} is not one of {KINDS}")
    unknown = sorted(set(spec) - _KEYS[kind] - {"kind"})
    if unknown:
        raise GraphValidationError(name, f"unknown {kind} metadata keys {unknown}")
    if getattr(node, "defer", False):
        raise GraphValidationError(name, "deferred nodes are not supported")
    return dict(spec)


def _node_fn(name: str, node: Any, spec: Mapping[str, Any]) -> Callable[[State], Any]:
    """The callable of a function/tool node: metadata ``fn``, else the node's own runnable."""
    fn = spec.get("fn")
    if fn is not None:
        if not callable(fn):
            raise GraphValidationError(name, f"metadata fn must be callable, got {fn!r}")
        return fn  # type: ignore[no-any-return]
    runnable = node.runnable
    if runnable is None or not hasattr(runnable, "ainvoke"):
        raise GraphValidationError(name, "has no runnable; give metadata fn")

    async def call(state: State) -> Any:
        return await runnable.ainvoke(state)

    return call


def _router(source: str, branch: Any) -> Callable[[State], Hashable]:
    path = branch.path
    func = getattr(path, "func", None)
    if callable(func):
        return func  # type: ignore[no-any-return]
    if getattr(path, "afunc", None) is not None:
        raise GraphValidationError(source, "async routers are not supported; use a sync one")
    return lambda state: path.invoke(state)


def _one_branch(source: str, branches: Mapping[str, Any]) -> Any:
    if len(branches) != 1:
        raise GraphValidationError(source, f"has {len(branches)} conditional edges; one at most")
    return next(iter(branches.values()))


def _source_graph(state_graph: Any) -> Any:
    from langgraph.graph import StateGraph

    if isinstance(state_graph, StateGraph):
        return state_graph
    builder = getattr(state_graph, "builder", None)  # a compiled graph keeps its builder
    if isinstance(builder, StateGraph):
        return builder
    raise ConfigError("state_graph", f"expected a langgraph StateGraph, got {state_graph!r}")


def _add_node(graph: ThoughtGraph, name: str, node: Any, spec: Mapping[str, Any]) -> None:
    kind = spec["kind"]
    if kind == "thought":
        if spec.get("speculable", True) is not True:
            raise GraphValidationError(
                name, "thought nodes are always speculable; run mode='baseline' instead"
            )
        if "prompt" not in spec:
            raise GraphValidationError(name, "thought metadata needs prompt(state) -> str")
        graph.add_thought(
            name, spec["prompt"], sampling=spec.get("sampling"), parse=spec.get("parse")
        )
    elif kind == "reward":
        graph.add_reward(name, spec.get("scorer"), reward_input=spec.get("reward_input"))
    elif kind == "tool":
        speculable, pure = bool(spec.get("speculable", False)), bool(spec.get("pure", False))
        graph.add_tool(name, _node_fn(name, node, spec), speculable=speculable, pure=pure)
    else:
        if spec.get("speculable", True) is not True or spec.get("pure", True) is not True:
            raise GraphValidationError(name, "function nodes are pure; use kind 'tool'")
        graph.add_function(name, _node_fn(name, node, spec))


def _terminal_router(predicate: Callable[[State], Any]) -> Callable[[State], Hashable]:
    return lambda state: "done" if predicate(state) else "more"


def _wire_select(
    graph: ThoughtGraph, lg: Any, select: str, spec: Mapping[str, Any], kinds: Mapping[str, str]
) -> None:
    incoming = sorted(s for s, t in lg.edges if t == select)
    if len(incoming) != 1 or kinds.get(incoming[0]) != "reward":
        raise GraphValidationError(
            select, f"a select node needs exactly one plain edge from a reward node; got {incoming}"
        )
    outgoing = [t for s, t in lg.edges if s == select]
    if select in lg.branches:
        branch = _one_branch(select, lg.branches[select])
        if not branch.ends:
            raise GraphValidationError(
                select, "its conditional edge needs a path_map naming the node it loops back to"
            )
        outgoing += list(dict(branch.ends).values())
    loop = sorted({t for t in outgoing if t != END})
    if len(loop) != 1:
        raise GraphValidationError(select, f"must loop back to exactly one node, got {loop}")
    terminal = spec.get("terminal")
    if END in outgoing and terminal is None:
        raise GraphValidationError(select, "reaches END: metadata needs terminal(state) -> bool")
    if terminal is None:
        graph.add_edge(incoming[0], loop[0])
        return
    if not callable(terminal):
        raise GraphValidationError(select, "metadata terminal must be callable")
    paths: dict[Hashable, str] = {"more": loop[0], "done": END}
    graph.add_conditional_edges(incoming[0], _terminal_router(terminal), paths)


def from_langgraph(
    state_graph: Any,
    *,
    backend: GenerationBackend | str | None = None,
    search: Any = None,
    search_params: Mapping[str, Any] | None = None,
    reward: RewardBackend | Callable[..., Any] | None = None,
    config: ExecutorConfig | None = None,
    backend_options: Mapping[str, Any] | None = None,
    answer: Callable[[State], str | None] | None = None,
    check: Callable[[State, str | None], bool] | None = None,
    input_to_state: Callable[[Any], State] | None = None,
) -> ToTApp:
    """Convert an annotated LangGraph ``StateGraph`` (or its compiled graph) into a
    ``ToTApp`` run by spec-tot's speculative executor; see this module's docstring for the
    metadata contract. The other arguments are those of ``ThoughtGraph.compile``."""
    lg = _source_graph(state_graph)
    if getattr(lg, "waiting_edges", None):
        sources, target = next(iter(lg.waiting_edges))
        raise GraphValidationError(target, f"joins (edges from {list(sources)}) are unsupported")
    graph = ThoughtGraph()
    specs = {name: _spec_of(name, node) for name, node in lg.nodes.items()}
    kinds = {name: spec["kind"] for name, spec in specs.items()}
    selects = sorted(n for n, k in kinds.items() if k == "select")
    if len(selects) > 1:
        raise GraphValidationError(selects[1], f"more than one select node: {selects}")
    for name, node in lg.nodes.items():
        if kinds[name] != "select":
            _add_node(graph, name, node, specs[name])
    select = selects[0] if selects else None
    for source, target in sorted(lg.edges):
        if select not in (source, target):
            graph.add_edge(source, target)
    for source, branches in lg.branches.items():
        if source == select:
            continue
        branch = _one_branch(source, branches)
        ends: dict[Hashable, str] | None = dict(branch.ends) if branch.ends else None
        if select is not None and ends and select in ends.values():
            raise GraphValidationError(select, "only a plain edge from a reward node may reach it")
        graph.add_conditional_edges(source, _router(source, branch), ends)
    select_spec: Mapping[str, Any] = {}
    if select is not None:
        select_spec = specs[select]
        _wire_select(graph, lg, select, select_spec, kinds)
    return graph.compile(
        search=search if search is not None else select_spec.get("search", "beam"),
        search_params=search_params
        if search_params is not None
        else select_spec.get("search_params"),
        backend=backend,
        backend_options=backend_options,
        reward=reward,
        config=config,
        answer=answer or select_spec.get("answer"),
        check=check,
        input_to_state=input_to_state,
    )
