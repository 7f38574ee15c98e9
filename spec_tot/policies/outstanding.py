"""The bookkeeping of committed expansions whose children are still out, and the shadow
feed that runs a one-expansion-at-a-time policy forward over known children."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from spec_tot.policies.base import Expansion
from spec_tot.tree import Node, NodeStatus, SearchTree

__all__ = [
    "Outstanding",
    "feed_known",
]


@dataclass
class Outstanding:
    """Committed expansions whose children have not all come back through ``on_reward``.

    Children are counted by id (a repeated delivery counts once); nodes whose parent has no
    outstanding expansion (late, speculative, unknown) are ignored.
    """

    pending: dict[str, int] = field(default_factory=dict)  # parent id -> width
    received: dict[str, set[str]] = field(default_factory=dict)

    def add(self, expansions: Iterable[Expansion]) -> None:
        for exp in expansions:
            self.pending[exp.parent_id] = exp.width
            self.received[exp.parent_id] = set()

    def receive(self, nodes: Iterable[Node]) -> list[Node]:
        """Record ``nodes``; returns those that were newly accepted, in delivery order."""
        accepted: list[Node] = []
        for node in nodes:
            parent = node.parent
            if parent is None or parent.id not in self.pending:
                continue
            got = self.received[parent.id]
            if node.id in got or len(got) >= self.pending[parent.id]:
                continue
            got.add(node.id)
            accepted.append(node)
        return accepted

    def complete(self, parent_id: str) -> bool:
        return len(self.received.get(parent_id, ())) >= self.pending.get(parent_id, 0)

    def pop_complete(self) -> list[str]:
        """Drop and return the parents whose children are all resolved."""
        done = [p for p in self.pending if self.complete(p)]
        for p in done:
            del self.pending[p]
            del self.received[p]
        return done

    @property
    def empty(self) -> bool:
        return not self.pending


def feed_known(
    outstanding: Outstanding,
    fed: set[str],
    tree: SearchTree,
    on_reward: Callable[[SearchTree, Sequence[Node]], object],
    *,
    partial: bool = False,
) -> tuple[Node, int, bool] | None:
    """Run a shadow of a one-expansion-at-a-time policy (MCTS, ToT DFS) forward: while
    every child of the expansion in flight is known (scored or with a provisional reward)
    or failed, feed them to ``on_reward`` as if scored. With ``partial``, an expansion whose
    children all exist and at least one is known is fed too, the rest as if failed (the
    best *known* child goes on: a guess that does not wait for the slowest sibling).
    Returns the first expansion that cannot be fed, as (parent, width, guessed: whether a
    partial feed led there), or None when nothing is in flight."""
    guessed = False
    while outstanding.pending:
        parent_id, width = next(iter(outstanding.pending.items()))
        parent = tree[parent_id]
        kids = parent.children[:width]
        done = sum(1 for k in kids if k.known or k.status is NodeStatus.CANCELLED)
        if len(kids) < width or done < width:
            if not (partial and len(kids) == width and any(k.known for k in kids)):
                return parent, width, guessed
            guessed = True
        fed.update(k.id for k in kids if k.known)
        on_reward(tree, kids)
    return None
