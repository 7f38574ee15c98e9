"""SPEX T2 (inter-query speculative budget) and T3 (adaptive early termination), and
SpecScale's early-pruning threshold: small pure pieces the runner calls."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from spec_tot.tree import Node, NodeStatus, SearchTree

__all__ = ["SpeculationBudget", "early_prune_threshold", "should_terminate"]


@dataclass
class SpeculationBudget:
    """A global budget of speculative sequences shared by every query of a run.

    ``capacity`` is the backend's saturation batch: below it a decode step costs about the
    same whatever the batch, so speculation there is nearly free. The speculative room is
    ``capacity - committed`` (committed load always wins, so speculation backs off as the
    engine saturates), shared by softmax(utility / tau) over the queries asking for it, where
    a query's utility is its best candidate's utility times its observed hit rate.
    """

    capacity: int
    tau: float = 1.0
    committed: int = 0
    speculative: dict[str, int] = field(default_factory=dict)
    demand: dict[str, float] = field(default_factory=dict)
    launched: dict[str, int] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)

    def hit_rate(self, query_id: str) -> float:
        # Beta(1, 1) prior: a new query starts at 0.5 and learns from its own adoptions.
        return (self.hits.get(query_id, 0) + 1) / (self.launched.get(query_id, 0) + 2)

    def room(self) -> int:
        return self.capacity - self.committed - sum(self.speculative.values())

    def grant(self, query_id: str, wanted: int, utility: float) -> int:
        """How many speculative sequences ``query_id`` may start now (0..wanted)."""
        self.demand[query_id] = max(utility, 1e-6) * self.hit_rate(query_id)
        free = self.room()
        if wanted <= 0 or free <= 0:
            return 0
        top = max(self.demand.values())
        weights = {q: math.exp((d - top) / self.tau) for q, d in self.demand.items()}
        share = weights[query_id] / sum(weights.values())
        total = self.capacity - self.committed
        # Hit rates steer the split between queries (through ``demand``), not the total:
        # room below saturation left unused is capacity thrown away.
        allowed = math.floor(share * total + 1e-9) - self.speculative.get(query_id, 0)
        if allowed <= 0 and self.demand[query_id] >= top:
            allowed = 1  # the most useful query always gets a slot while the engine has room
        return max(0, min(wanted, allowed, free))

    def started(self, query_id: str, count: int = 1) -> None:
        self.speculative[query_id] = self.speculative.get(query_id, 0) + count
        self.launched[query_id] = self.launched.get(query_id, 0) + count

    def finished(self, query_id: str) -> None:
        self.speculative[query_id] = max(0, self.speculative.get(query_id, 0) - 1)

    def hit(self, query_id: str) -> None:
        self.hits[query_id] = self.hits.get(query_id, 0) + 1

    def forget(self, query_id: str) -> None:
        for table in (self.speculative, self.demand, self.launched, self.hits):
            table.pop(query_id, None)


def early_prune_threshold(candidates: Sequence[Node], keep: int) -> float | None:
    """SpecScale EP: with >= ``keep`` non-terminal candidates scored, the k-th best score.

    A non-terminal candidate strictly below it can never be among the policy's top k, so it
    and its speculative descendants can go. Terminal candidates (finished traces) are never
    pruned: policies count them apart from the top k.
    """
    scores = sorted(
        (
            n.reward
            for n in candidates
            if n.status is NodeStatus.SCORED and not n.terminal and n.reward is not None
        ),
        reverse=True,
    )
    if keep < 1 or len(scores) < keep:
        return None
    return scores[keep - 1]


def should_terminate(tree: SearchTree, min_answers: int, alpha: float) -> bool:
    """SPEX T3: >= ``min_answers`` answers exist and the top answer's cumulative reward leads
    the runner-up's by ``alpha`` times the runner-up's mean weight (an answer with no rival
    needs only the count)."""
    totals: dict[str, list[float]] = {}
    for node in tree.terminals():
        if node.answer is not None and not node.speculative and node.reward is not None:
            totals.setdefault(node.answer, []).append(node.reward)
    count = sum(len(v) for v in totals.values())
    if count < min_answers:
        return False
    ranked = sorted((sum(v), len(v)) for v in totals.values())
    top_sum = ranked[-1][0]
    if len(ranked) == 1:
        return True
    second_sum, second_n = ranked[-2]
    return top_sum - second_sum >= alpha * (second_sum / second_n)
