"""Compile-time checks of a ThoughtGraph. Each error names the node at fault."""

from __future__ import annotations

from collections.abc import Iterable

from spec_tot.errors import GraphValidationError
from spec_tot.graph_nodes import END, START, GraphParts, NodeKind

__all__ = ["successors", "validate_graph"]


def successors(graph: GraphParts, name: str, *, opaque: bool = True) -> list[str]:
    """Possible next nodes. A router without a path map may return any node or END when
    ``opaque``; with ``opaque=False`` its edges are left out (the checks that would only
    produce false alarms then run at run time instead)."""

    if name in graph.branches:
        branch = graph.branches[name]
        if branch.path_map is None:
            return [*graph.nodes, END] if opaque else []
        return branch.targets()
    return list(graph.edges.get(name, []))


def validate_graph(graph: GraphParts, *, has_default_reward: bool) -> None:

    known = set(graph.nodes)
    for source in (*graph.edges, *graph.branches):
        if source != START and source not in known:
            raise GraphValidationError(source, "edge from an unknown node")
        for target in successors(graph, source):
            if target != END and target not in known:
                raise GraphValidationError(target, f"unknown node (edge from {source!r})")

    if not successors(graph, START):
        raise GraphValidationError(START, "no entry point: add an edge from START")

    for node in graph.nodes.values():
        if node.kind is NodeKind.TOOL and node.speculable and not node.pure:
            raise GraphValidationError(
                node.name, "a tool marked speculable must declare itself pure (pure=True)"
            )
        if node.kind is NodeKind.REWARD and node.scorer is None and not has_default_reward:
            raise GraphValidationError(
                node.name, "reward node has no scorer and compile() got no reward backend"
            )
        if not successors(graph, node.name):
            raise GraphValidationError(node.name, "dead end: no outgoing edge (add one to END)")

    reachable = _reach(graph, [START])
    for name in graph.nodes:
        if name not in reachable:
            raise GraphValidationError(name, "unreachable from START")
    if not any(graph.nodes[n].kind is NodeKind.THOUGHT for n in reachable if n in known):
        raise GraphValidationError(START, "no thought node is reachable from START")

    for name in graph.nodes:
        if END not in _reach(graph, [name]):
            raise GraphValidationError(name, "no path to END")

    _check_cycles(graph)
    _check_reward_placement(graph)


def _reach(
    graph: GraphParts,
    start: Iterable[str],
    stop_at: frozenset[str] = frozenset(),
    *,
    opaque: bool = True,
) -> set[str]:
    """Nodes reachable from ``start`` (exclusive of start unless revisited), not walking past
    nodes in ``stop_at``."""

    seen: set[str] = set()
    stack = [t for s in start for t in successors(graph, s, opaque=opaque)]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name != END and name not in stop_at:
            stack.extend(successors(graph, name, opaque=opaque))
    return seen


def _check_cycles(graph: GraphParts) -> None:
    """Every cycle must cross a reward node, or the executor would loop with no barrier."""

    rewards = frozenset(n for n, node in graph.nodes.items() if node.kind is NodeKind.REWARD)
    for name in sorted(graph.nodes):
        if name in rewards:
            continue
        if name in _reach(graph, [name], stop_at=rewards, opaque=False) - rewards:
            raise GraphValidationError(name, "is on a cycle with no reward node on it")


def _check_reward_placement(graph: GraphParts) -> None:
    """A thought must be scored before END, and a reward needs a thought before it."""

    rewards = frozenset(n for n, node in graph.nodes.items() if node.kind is NodeKind.REWARD)
    thoughts = frozenset(n for n, node in graph.nodes.items() if node.kind is NodeKind.THOUGHT)
    for name in sorted(thoughts):
        if END in _reach(graph, [name], stop_at=rewards, opaque=False) - rewards:
            raise GraphValidationError(name, "can reach END without passing a reward node")
    before_thought = _reach(graph, [START], stop_at=thoughts, opaque=False)
    for name in sorted(rewards & before_thought):
        raise GraphValidationError(name, "reward node reachable from START before any thought")
    for name in sorted(rewards):
        rescored = _reach(graph, [name], stop_at=thoughts, opaque=False) & rewards
        if rescored:
            other = sorted(rescored)[0]
            raise GraphValidationError(
                other,
                f"scored twice: reachable from reward {name!r} without a thought node in between",
            )
