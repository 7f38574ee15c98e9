"""The frozen form of a validated ThoughtGraph, and how branches walk it."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from spec_tot.errors import ExecutionError, GraphValidationError
from spec_tot.graph_nodes import END, START, ConditionalEdge, GraphNode, GraphParts, NodeKind, State

__all__ = ["CompiledGraph", "apply_update", "maybe_await"]


def apply_update(state: State, update: Mapping[str, Any] | None, node: str) -> State:
    if update is None:
        return state
    if not isinstance(update, Mapping):
        raise ExecutionError(f"node {node!r} returned {type(update).__name__}, expected a dict")
    return {**state, **update}


async def maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


@dataclass(frozen=True, slots=True)
class CompiledGraph:
    nodes: Mapping[str, GraphNode]
    edges: Mapping[str, str]
    branches: Mapping[str, ConditionalEdge]

    @classmethod
    def from_builder(cls, graph: GraphParts) -> CompiledGraph:
        edges: dict[str, str] = {}
        for source, targets in graph.edges.items():
            if len(targets) > 1:
                raise GraphValidationError(
                    source, f"has {len(targets)} plain edges; branch with a conditional edge"
                )
            edges[source] = targets[0]
        return cls(
            nodes=MappingProxyType(dict(graph.nodes)),
            edges=MappingProxyType(edges),
            branches=MappingProxyType(dict(graph.branches)),
        )

    def next(self, name: str, state: State) -> str:
        """The node after ``name`` for this state (routers run here)."""
        branch = self.branches.get(name)
        if branch is None:
            return self.edges[name]
        choice = branch.router(state)
        if branch.path_map is not None:
            if choice not in branch.path_map:
                raise ExecutionError(
                    f"router of node {name!r} returned {choice!r}, not a key of its path map"
                )
            return branch.path_map[choice]
        if not isinstance(choice, str) or (choice != END and choice not in self.nodes):
            raise ExecutionError(f"router of node {name!r} returned unknown node {choice!r}")
        return choice

    def check_steps(self, position: str, steps: int) -> int:
        """One more node in a segment. A segment visits each node at most once unless a
        router without a path map loops it (validation cannot see that): stop it there."""
        steps += 1
        if steps > len(self.nodes):
            raise ExecutionError(
                f"node {position!r} is on a loop with no reward node: a router without a "
                "path map sent the branch round it; give that router a path map"
            )
        return steps

    def entry(self, state: State) -> str:
        return self.next(START, state)

    def kind(self, name: str) -> NodeKind:
        return self.nodes[name].kind

    async def walk_functions(self, position: str, state: State) -> tuple[str | None, State] | None:
        """Like ``walk_to_thought`` but through function nodes only: None when a tool or a
        reward stands in the way (a provisional walk must have no side effect)."""
        return await self._walk(position, state, None)

    async def walk_to_thought(
        self,
        position: str,
        state: State,
        before_tool: Callable[[GraphNode], Any],
    ) -> tuple[str | None, State]:
        """Run function and tool nodes from ``position`` until a thought node (returned) or
        END (None). ``before_tool`` is awaited before each tool: speculative branches wait
        there until committed."""
        walk = await self._walk(position, state, before_tool)
        assert walk is not None  # only a walk without tools stops early
        return walk

    async def _walk(
        self, position: str, state: State, before_tool: Callable[[GraphNode], Any] | None
    ) -> tuple[str | None, State] | None:
        steps = 0
        while position != END:
            steps = self.check_steps(position, steps)
            node = self.nodes[position]
            if node.kind is NodeKind.THOUGHT:
                return position, state
            if node.kind is not NodeKind.FUNCTION and before_tool is None:
                return None
            if node.kind is NodeKind.REWARD:
                # Validation forbids this shape; a router returning a reward node gets here.
                raise ExecutionError(f"reward node {position!r} reached without a new thought")
            if node.kind is NodeKind.TOOL and before_tool is not None:
                await maybe_await(before_tool(node))
            assert node.fn is not None  # set for every function and tool node by the builder
            state = apply_update(state, await maybe_await(node.fn(state)), position)
            position = self.next(position, state)
        return None, state
