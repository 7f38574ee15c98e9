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

from spec_tot.errors import ConfigError, IllegalTransition

__all__ = [
    "Aggregation",
    "Node",
    "NodeStatus",
    "SearchTree",
    "aggregate_scores",
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


class SearchTree:
    """All nodes of one query. ``snapshot()`` is a structural copy (statistics included) for
    callers that want to experiment on a tree without touching it.

    The tree owns its nodes' lifecycle: a node's ``status`` and ``speculative`` flag change
    only through its transitions (``start``, ``add_child(speculative=True)``, ``adopt``,
    ``score``, ``prune``, ``cancel``, ``revive``), each of which refuses a move its node's
    state does not allow (``IllegalTransition``). A node is speculative from its creation
    until adopted, whatever its status (``SPECULATIVE`` while it runs or waits, ``CANCELLED``
    once cancelled): ``speculative`` says which search it belongs to, ``status`` where it is.
    """

    def __init__(self, query_id: str, question: str, state: dict[str, Any] | None = None) -> None:
        if not query_id or "/" in query_id:
            raise ConfigError("query_id", f"must be non-empty and contain no '/', got {query_id!r}")
        self.query_id = query_id
        self.question = question
        self.root = Node(id=query_id, parent=None, depth=0, status=NodeStatus.SCORED)
        self.root.state = dict(state or {})
        self.root.walk_version, self.root.final = 1, True
        self._nodes: dict[str, Node] = {query_id: self.root}
        self._next_child: dict[str, int] = {}
        # Speculative nodes taken out of the tree (their ids are free again): kept for the
        # wasted-token count.
        self.discarded: list[Node] = []

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

    # -- transitions --------------------------------------------------------------------------
    def start(self, node: Node) -> None:
        """A committed node's generation starts."""
        self._move(node, "start", NodeStatus.RUNNING, {NodeStatus.PENDING}, speculative=False)

    def adopt(self, node: Node, status: NodeStatus) -> None:
        """A speculative node becomes committed: ``RUNNING`` (its run goes on, or derives
        again), ``SCORED`` (its run ended with its real reward) or ``CANCELLED`` (it failed,
        as the baseline's node would have)."""
        if status not in (NodeStatus.RUNNING, NodeStatus.SCORED, NodeStatus.CANCELLED):
            raise IllegalTransition(node.id, f"adopt as {status.value}", node.status.value)
        legal = {NodeStatus.SPECULATIVE, NodeStatus.CANCELLED}
        self._move(node, "adopt", status, legal, speculative=True)
        node.speculative = False

    def score(self, node: Node) -> None:
        """A committed node's run ended with its real reward."""
        self._move(node, "score", NodeStatus.SCORED, {NodeStatus.RUNNING}, speculative=False)

    def prune(self, node: Node) -> None:
        """A scored committed node is dropped (early pruning)."""
        self._move(node, "prune", NodeStatus.PRUNED, {NodeStatus.SCORED}, speculative=False)

    def cancel(self, node: Node) -> None:
        """A node stops: failed, cancelled, mis-speculated, or its query ended. A scored or
        pruned committed node is past cancelling (its result stands); cancelling a
        cancelled node changes nothing."""
        if node.status is NodeStatus.CANCELLED:
            return
        legal = {NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.SPECULATIVE, NodeStatus.DONE}
        self._move(node, "cancel", NodeStatus.CANCELLED, legal)

    def revive(self, node: Node) -> None:
        """A node derives again (its parent's walk changed, or it was adopted stale): a
        cancelled one runs again as what it is; a running one goes on."""
        if node.status in (NodeStatus.RUNNING, NodeStatus.SPECULATIVE):
            return
        to = NodeStatus.SPECULATIVE if node.speculative else NodeStatus.RUNNING
        self._move(node, "revive", to, {NodeStatus.CANCELLED})

    def _move(
        self,
        node: Node,
        move: str,
        to: NodeStatus,
        legal: set[NodeStatus],
        speculative: bool | None = None,
    ) -> None:
        """``node`` goes to ``to`` if its status is in ``legal`` (and, if given, its
        ``speculative`` flag is that): the one place a status changes."""
        if node.status not in legal or (
            speculative is not None and node.speculative != speculative
        ):
            kind = "speculative " if node.speculative else ""
            raise IllegalTransition(node.id, move, f"{kind}{node.status.value}")
        node.status = to

    def detach_children(self, parent: Node) -> list[Node]:
        """Take every child of ``parent`` (all speculative: ``parent`` was never expanded)
        and their subtrees out of the tree; the ids ``parent/0, ...`` are free again, so the
        children a later expansion creates are exactly the baseline's."""
        gone = [sub for child in parent.children for sub in child.subtree()]
        for node in gone:
            if not node.speculative:
                raise ValueError(f"cannot detach committed node {node.id!r}")
        for node in gone:
            del self._nodes[node.id]
            self._next_child.pop(node.id, None)
        parent.children = []
        self._next_child.pop(parent.id, None)
        self.discarded.extend(gone)
        return gone

    def terminals(self) -> list[Node]:
        """Terminal SCORED nodes, in canonical (id path) order."""
        found = [n for n in self._nodes.values() if n.terminal and n.status is NodeStatus.SCORED]
        return sorted(found, key=lambda n: n.key)

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
        copy.discarded = list(self.discarded)
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
                walk_version=node.walk_version,
                base_version=node.base_version,
                final=node.final,
                provisional=node.provisional,
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
