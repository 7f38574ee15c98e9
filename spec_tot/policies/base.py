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
- ``predict(tree, budget)`` is side-effect free: it may use ``tree.snapshot()`` to simulate
  its own future picks. It returns at most ``budget`` children's worth of candidates.
- ``keep_count(tree)`` is the k of the current round for early pruning: after k children of
  the round are scored, any scored child strictly below the k-th best cannot be selected.
  ``None`` when the policy's selection is not a top-k (REBASE, MCTS, best-of-N).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from spec_tot.tree import Aggregation, Node, NodeStatus, SearchTree

__all__ = ["Answer", "Candidate", "Expansion", "SearchPolicy"]


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
    # True when a node of a finished round that the round did not expand is never expanded
    # later (BFS policies): the executor then cancels speculative work under it at once.
    discards_unselected: ClassVar[bool] = False

    @abstractmethod
    def initial(self, tree: SearchTree) -> list[Expansion]: ...

    @abstractmethod
    def on_reward(self, tree: SearchTree, scored: Sequence[Node]) -> list[Expansion]: ...

    @abstractmethod
    def predict(self, tree: SearchTree, budget: int) -> list[Candidate]: ...

    @abstractmethod
    def done(self, tree: SearchTree) -> bool: ...

    @abstractmethod
    def answer(self, tree: SearchTree) -> Answer | None: ...

    def keep_count(self, tree: SearchTree) -> int | None:
        return None

    def score(self, node: Node) -> float:
        """The node's score as this policy ranks it (aggregated step scores)."""
        return node.reward if node.reward is not None else float("-inf")

    @staticmethod
    def resolved(node: Node) -> bool:
        return node.status in (NodeStatus.SCORED, NodeStatus.PRUNED, NodeStatus.CANCELLED)
