"""The search tree: one ``Node`` per thought, and the ``SearchTree`` that owns them.

Node ids are hierarchical: the root is the query id (``q3``), child ``i`` of node ``x`` is
``x/i``. A backend request for a node's children uses the node id as its prefix, so
``abort(node.id)`` cancels the whole subtree under it in one call.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from spec_tot.errors import ConfigError

__all__ = ["Aggregation", "Node", "NodeStatus", "SearchTree", "aggregate_scores"]

Aggregation = Literal["last", "min", "prod"]


class NodeStatus(Enum):
    PENDING = "pending"  # created, not yet sent to a backend
    RUNNING = "running"  # committed generation in flight
    SPECULATIVE = "speculative"  # speculative generation in flight or finished, not adopted
    DONE = "done"  # generated, waiting for its reward
    SCORED = "scored"  # reward known
    PRUNED = "pruned"  # dropped by the policy or by early pruning
    CANCELLED = "cancelled"  # aborted (failed, cancelled or mis-speculated)

    @property
    def final(self) -> bool:
        return self in (NodeStatus.SCORED, NodeStatus.PRUNED, NodeStatus.CANCELLED)


def aggregate_scores(step_scores: Sequence[float], how: Aggregation) -> float:
    """Collapse a PRM's per-step scores into one node score (search-and-learn's options)."""
    if not step_scores:
        return 0.0
    if how == "last":
        return float(step_scores[-1])
    if how == "min":
        return float(min(step_scores))
    if how == "prod":
        return float(math.prod(step_scores))
    raise ConfigError("aggregation", f"must be 'last', 'min' or 'prod', got {how!r}")


@dataclass(slots=True, eq=False)
class Node:
    id: str
    parent: Node | None
    depth: int
    status: NodeStatus = NodeStatus.PENDING
    text: str = ""
    token_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    step_scores: tuple[float, ...] = ()
    reward: float | None = None
    terminal: bool = False
    answer: str | None = None
    # Graph state after this node's segment, and the graph node to resume from.
    state: dict[str, Any] = field(default_factory=dict)
    resume_at: str | None = None
    speculative: bool = False
    # MCTS statistics.
    visits: int = 0
    value_sum: float = 0.0
    children: list[Node] = field(default_factory=list)
    # The canonical tie key: the child indices along the id path (``q/0/3`` -> (0, 3)).
    # Ties break on it, never on creation order, which speculation changes.
    key: tuple[int, ...] = ()

    @property
    def value(self) -> float:
        return self.value_sum / self.visits if self.visits else 0.0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def live_children(self) -> list[Node]:
        return [
            c for c in self.children if c.status not in (NodeStatus.PRUNED, NodeStatus.CANCELLED)
        ]

    def path(self) -> list[Node]:
        """Nodes from the root's first child down to this node (the root holds no thought)."""
        out: list[Node] = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def steps(self) -> tuple[str, ...]:
        return tuple(n.text for n in self.path())

    def subtree(self) -> Iterator[Node]:
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))


class SearchTree:
    """All nodes of one query. ``snapshot()`` copies the statistics cheaply so that SPEX can
    simulate selections (visits, virtual losses) without touching the real tree."""

    def __init__(self, query_id: str, question: str, state: dict[str, Any] | None = None) -> None:
        if not query_id or "/" in query_id:
            raise ConfigError("query_id", f"must be non-empty and contain no '/', got {query_id!r}")
        self.query_id = query_id
        self.question = question
        self.root = Node(id=query_id, parent=None, depth=0, status=NodeStatus.SCORED)
        self.root.state = dict(state or {})
        self._nodes: dict[str, Node] = {query_id: self.root}
        self._next_child: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def __getitem__(self, node_id: str) -> Node:
        return self._nodes[node_id]

    def get(self, node_id: str) -> Node | None:
        return self._nodes.get(node_id)

    def nodes(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def add_child(self, parent: Node, *, speculative: bool = False) -> Node:
        index = self._next_child.get(parent.id, 0)
        self._next_child[parent.id] = index + 1
        child = Node(
            id=f"{parent.id}/{index}",
            parent=parent,
            depth=parent.depth + 1,
            status=NodeStatus.SPECULATIVE if speculative else NodeStatus.PENDING,
            speculative=speculative,
            key=(*parent.key, index),
        )
        parent.children.append(child)
        self._nodes[child.id] = child
        return child

    def terminals(self) -> list[Node]:
        return [n for n in self._nodes.values() if n.terminal and n.status is NodeStatus.SCORED]

    def by_status(self, *statuses: NodeStatus) -> list[Node]:
        return [n for n in self._nodes.values() if n.status in statuses]

    def snapshot(self) -> SearchTree:
        """A structural copy: new Node objects with the same ids, statuses and statistics
        (state dicts and texts are shared, read-only by convention)."""
        copy = SearchTree.__new__(SearchTree)
        copy.query_id = self.query_id
        copy.question = self.question
        copy._next_child = dict(self._next_child)
        copy._nodes = {}
        for node in self._nodes.values():  # insertion order: parents before children
            parent = copy._nodes[node.parent.id] if node.parent is not None else None
            clone = Node(
                id=node.id,
                parent=parent,
                depth=node.depth,
                status=node.status,
                text=node.text,
                token_ids=node.token_ids,
                num_tokens=node.num_tokens,
                step_scores=node.step_scores,
                reward=node.reward,
                terminal=node.terminal,
                answer=node.answer,
                state=node.state,
                resume_at=node.resume_at,
                speculative=node.speculative,
                visits=node.visits,
                value_sum=node.value_sum,
                key=node.key,
            )
            if parent is not None:
                parent.children.append(clone)
            copy._nodes[node.id] = clone
        copy.root = copy._nodes[self.query_id]
        return copy

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view (for metadata, visualisation and debugging)."""
        return {
            "query_id": self.query_id,
            "question": self.question,
            "nodes": [
                {
                    "id": n.id,
                    "parent": n.parent.id if n.parent else None,
                    "depth": n.depth,
                    "status": n.status.value,
                    "text": n.text,
                    "reward": n.reward,
                    "terminal": n.terminal,
                    "answer": n.answer,
                    "visits": n.visits,
                    "value": n.value,
                    "speculative": n.speculative,
                }
                for n in self._nodes.values()
            ],
        }
