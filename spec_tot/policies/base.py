"""The one protocol every search policy implements.

A policy is tree-level control and nothing else: it never talks to a backend. The executor
asks it which expansions are *committed* (``initial``, ``on_reward``), which are worth doing
*speculatively* (``predict``), whether the search is over (``done``) and what it answers.

Contract:
- An ``Expansion(parent_id, width)`` asks the executor for ``width`` new children of a node
  whose status is SCORED (the root counts as scored). The executor creates the children (ids
  ``parent/0``, ``parent/1``, ...), generates and scores them, then calls ``on_reward`` with
  the newly scored nodes, in one or several batches, in any order.
- Children that fail or are cancelled arrive in ``on_reward`` too, with status CANCELLED or
  PRUNED and no reward: a policy counts them as resolved and never selects them.
- A policy never returns an expansion of a terminal node, nor two expansions of one node in
  one round. ``answer`` only ever comes from terminal SCORED nodes.
- ``predict(tree, budget)`` is side-effect free. It sees the tree through the *predictive
  view* (``shadow()``): besides SCORED nodes, every node whose walk past its reward edge is
  known (committed or speculative, scored or with a provisional reward) counts as scored,
  with ``predicted_reward`` as its score, so a prediction may chain several levels below the
  committed frontier. It returns at most ``budget`` children's worth of candidates, only on
  nodes whose continuation can start (``startable``), for the children they lack.
  ``predictions(tree, budget)`` gives the same candidates one at a time, best first: the
  executor stops pulling once the next one is not worth its cost, so a policy whose
  prediction costs CPU per candidate (MCTS's simulated selections) computes lazily.
- ``keep_count(tree)`` is the k of the current round for early pruning: after k children of
  the round are scored, any scored child strictly below the k-th best cannot be selected.
  ``None`` when the policy's selection is not a top-k (REBASE, MCTS, best-of-N).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Self

from spec_tot.tree import Aggregation, Node, NodeStatus, SearchTree, predicted_reward

__all__ = ["Answer", "Candidate", "Expansion", "SearchPolicy", "startable_width"]


@dataclass(frozen=True, slots=True)
class Expansion:
    parent_id: str
    width: int


@dataclass(frozen=True, slots=True)
class Candidate:
    """A speculative expansion and how much it is expected to be worth (higher = better)."""

    parent_id: str
    width: int
    utility: float


@dataclass(frozen=True, slots=True)
class Answer:
    text: str | None
    node_id: str | None
    score: float
    votes: dict[str, float]


class SearchPolicy(ABC):
    """Base class; see the module docstring for the contract."""

    name: ClassVar[str]
    aggregation: Aggregation = "last"
    max_depth: int = 1 << 30
    # True on a shadow copy (``shadow()``) that predicts on the predictive view.
    _predictive: bool = False
    # (A shadow.) Placeholder scores of round siblings still generating: the prediction
    # ranks the whole round, so a known node's predicted width is what the real round would
    # give it, not the whole width shared among the few nodes known so far.
    _placeholders: Mapping[str, float] = MappingProxyType({})
    # True when a node of a finished round that the round did not expand is never expanded
    # later (BFS policies): the executor then cancels speculative work under it at once.
    discards_unselected: ClassVar[bool] = False

    @abstractmethod
    def initial(self, tree: SearchTree) -> list[Expansion]: ...

    @abstractmethod
    def on_reward(self, tree: SearchTree, scored: Sequence[Node]) -> list[Expansion]: ...

    @abstractmethod
    def predict(self, tree: SearchTree, budget: int) -> list[Candidate]: ...

    def predictions(self, tree: SearchTree, budget: int) -> Iterator[Candidate]:
        """``predict``'s candidates, best first, computed as they are pulled (this default
        computes them all at once)."""
        yield from self.predict(tree, budget)

    @abstractmethod
    def done(self, tree: SearchTree) -> bool: ...

    @abstractmethod
    def answer(self, tree: SearchTree) -> Answer | None: ...

    def keep_count(self, tree: SearchTree) -> int | None:
        return None

    def score(self, node: Node) -> float:
        """The node's score as this policy ranks it (aggregated step scores); on the
        predictive view a pending reward is predicted."""
        if node.reward is not None:
            return node.reward
        if self._predictive and node.known:
            return predicted_reward(node)
        if self._predictive and node.id in self._placeholders:
            return self._placeholders[node.id]
        return float("-inf")

    def seen(self, node: Node) -> bool:
        """Scored (predictive view: known, or a placeholder) and neither pruned nor
        cancelled."""
        if self._predictive:
            return node.known or node.id in self._placeholders
        return node.status is NodeStatus.SCORED

    def expandable(self, node: Node) -> bool:
        """A seen, non-terminal node below the depth limit with no committed children yet
        (speculative children may exist: the executor adopts them when it is expanded)."""
        return (
            self.seen(node)
            and not node.terminal
            and node.depth < self.max_depth
            and all(child.speculative for child in node.children)
        )

    def shadow(self) -> Self:
        """A copy of this policy on the predictive view, for ``predict`` to run forward on
        the predicted rewards; policies copy their own mutable control state in
        ``_copy_state``. The real policy is never touched."""
        twin = copy.copy(self)
        twin._predictive = True
        twin._copy_state()
        return twin

    def _copy_state(self) -> None:  # noqa: B027 - optional hook
        """Replace the mutable containers of this (shadow) copy by copies of their own."""

    @staticmethod
    def resolved(node: Node) -> bool:
        return node.status in (NodeStatus.SCORED, NodeStatus.PRUNED, NodeStatus.CANCELLED)


def startable_width(node: Node, width: int) -> int:
    """How many more children a prediction may start under ``node`` for an expansion of
    ``width``: 0 unless its walk is known and goes on and it was never expanded. Every
    existing child counts (a failed one too: its id is taken, and the committed expansion
    adopts it as the failure the baseline would also have had)."""
    if not node.known or node.terminal or not all(c.speculative for c in node.children):
        return 0
    return max(0, width - len(node.children))
