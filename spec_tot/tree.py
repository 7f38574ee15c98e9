"""The search tree: one ``Node`` per thought, and the ``SearchTree`` that owns them.

Node ids are hierarchical: the root is the query id (``q3``), child ``i`` of node ``x`` is
``x/i``. A backend request for a node's children uses the node id as its prefix, so
``abort(node.id)`` cancels the whole subtree under it in one call.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from spec_tot.errors import ConfigError, IllegalTransition
from spec_tot.tree_node import (
    Aggregation,
    Node,
    NodeStatus,
    aggregate_scores,
    node_dict,
    predicted_reward,
)

__all__ = [
    "Aggregation",
    "Node",
    "NodeStatus",
    "SearchTree",
    "aggregate_scores",
    "predicted_reward",
]


class SearchTree:
    """All nodes of one query. ``snapshot()`` is a structural copy (statistics included) for
    callers that want to experiment on a tree without touching it.

    The tree owns its nodes' lifecycle: a node's ``status`` and ``speculative`` flag change
    only through its transitions (``start``, ``add_child(speculative=True)``, ``adopt``,
    ``score``, ``prune``, ``cancel``, ``revive``), each of which refuses a move its node's
    state does not allow (``IllegalTransition``). A node is speculative from its creation
    until adopted, whatever its status (``SPECULATIVE`` while it runs or waits, ``CANCELLED``
    once cancelled): ``speculative`` says which search it belongs to, ``status`` where it is.

    Every other field is the tree's to assign too: what a node's run finds (``generated``,
    ``discard_tokens``, ``set_reward``, ``walked``, ``derive_from``), the root's entry walk
    (``set_entry``) and MCTS statistics (``add_visits``, ``set_value_sum``). Executors and
    policies report; they never write a node (``tests/core/test_ownership.py`` guards it).
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

    # -- what a node's run finds (the executor reports it, the tree records it) -----------
    def set_entry(self, resume: str | None, state: dict[str, Any]) -> None:
        """The root's walk from the graph's entry reached ``resume`` with ``state``."""
        self.root.state, self.root.resume_at = state, resume

    def derive_from(self, node: Node, version: int) -> None:
        """``node``'s run derives from its parent's walk ``version``."""
        node.base_version = version

    def generated(self, node: Node, tokens: int, first: tuple[str, tuple[int, ...]] | None) -> None:
        """One request of ``node``'s run returned ``tokens`` tokens; ``first``: the text and
        token ids of its first thought (the node's own)."""
        node.num_tokens += tokens
        if first is not None:
            node.text, node.token_ids = first

    def discard_tokens(self, node: Node, tokens: int) -> None:
        """``tokens`` generated for a prompt that changed (wasted, generated again)."""
        node.discarded_tokens += tokens

    def set_reward(
        self, node: Node, step_scores: tuple[float, ...] | None, how: Aggregation
    ) -> None:
        """``node``'s reward: its scores aggregated, or none (None: it waits for one)."""
        node.step_scores = step_scores or ()
        node.reward = None if step_scores is None else aggregate_scores(step_scores, how)

    def walked(
        self,
        node: Node,
        resume: str | None,
        state: dict[str, Any],
        answer: str | None,
        *,
        provisional: float | None = None,
    ) -> None:
        """``node``'s walk past its reward edge reached ``resume`` (None: terminal) with
        ``state``; a walk ahead of the real score carries its ``provisional`` guess. It is
        final once the real reward is in and it derives from its parent's final walk."""
        node.state, node.resume_at, node.terminal = state, resume, resume is None
        node.answer = answer if node.terminal else None
        node.walk_version += 1
        if provisional is not None:
            node.provisional = provisional
        parent = node.parent
        node.final = (
            provisional is None
            and node.reward is not None
            and (parent is None or (node.current and parent.final))
        )

    def add_visits(self, node: Node, visits: int, value: float) -> None:
        """MCTS statistics: ``visits`` more visits worth ``value`` in all."""
        node.visits += visits
        node.value_sum += value

    def set_value_sum(self, node: Node, value_sum: float) -> None:
        node.value_sum = value_sum

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
            "nodes": [node_dict(n) for n in self._nodes.values()],
        }
