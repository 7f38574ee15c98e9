"""A search tree's node (``Node``), its statuses, and the scores read off it. Only
``SearchTree`` (``spec_tot.tree``) changes a node: its fields are the tree's to assign."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from spec_tot.errors import ConfigError

__all__ = [
    "Aggregation",
    "Node",
    "NodeStatus",
    "aggregate_scores",
    "node_dict",
    "predicted_reward",
]

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


def predicted_reward(node: Node) -> float:
    """``node``'s reward, or while it is pending a prediction: the mean reward of its scored
    siblings, else its parent's (predicted) reward, else 0.5."""
    while True:
        if node.reward is not None:
            return node.reward
        parent = node.parent
        if parent is None:
            return 0.5
        scored = [c.reward for c in parent.children if c.reward is not None]
        if scored:
            return sum(scored) / len(scored)
        node = parent


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
    # Graph state after this node's segment, and the graph node to resume from (its *walk*).
    state: dict[str, Any] = field(default_factory=dict)
    resume_at: str | None = None
    speculative: bool = False
    # The walk past the reward edge. ``walk_version`` counts the walks (0: none yet); a walk
    # may be *provisional* (taken with the predicted reward ``provisional`` while the real
    # score is pending, so that children can start early), and is *final* once the real
    # reward is in and it derives from the parent's final walk (``base_version`` is the
    # parent's walk it derives from). Tools run only on final walks.
    walk_version: int = 0
    base_version: int = 0
    final: bool = False
    provisional: float | None = None
    discarded_tokens: int = 0  # generated for a prompt that changed, then regenerated
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
    def known(self) -> bool:
        """SCORED, or it has a walk (final or provisional) and is neither pruned nor
        cancelled: its continuation could start."""
        return self.status is NodeStatus.SCORED or (
            self.walk_version > 0 and self.status not in (NodeStatus.PRUNED, NodeStatus.CANCELLED)
        )

    @property
    def current(self) -> bool:
        """Its walk derives from its parent's latest walk."""
        return self.parent is None or self.base_version == self.parent.walk_version

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


def node_dict(n: Node) -> dict[str, Any]:
    """``n``'s JSON-able view (a tree's ``to_dict``)."""
    return {
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
