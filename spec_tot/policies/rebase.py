"""REBASE: reward-balanced search (Wu et al. 2024, "Inference Scaling Laws: An Empirical
Analysis of Compute-Optimal Inference for Problem-Solving with Language Models").

Round 0 expands the root with ``width`` children. At the end of every round:
- ``W = width - C`` where ``C`` counts the terminal SCORED nodes so far (finished solutions
  use up the budget); stop when ``W <= 0``;
- the candidates are the round's scored non-terminal nodes below ``max_depth``, ranked by
  ``(-score, id path)``; ``p_i = softmax(score_i / temperature)``;
- ``w_i = allocate(p, W)``: the largest-remainder rounding of ``W * p_i`` (floors first, the
  units left go to the largest fractional parts, ties to the better-ranked node), so
  ``sum(w_i) == W`` exactly; nodes with ``w_i == 0`` are dropped, the rest expanded ``w_i``.
``keep_count`` is ``None``: the allocation is not a top-k. ``predict`` applies the same rule
to the known part of the unfinished round and of the rounds below it (SPEX T1: REBASE keeps
its softmax), utility ``p_i`` per level.
"""

from __future__ import annotations

from spec_tot.policies.base import Expansion
from spec_tot.policies.breadth import BreadthPolicy
from spec_tot.policies.checks import check_positive, check_positive_float
from spec_tot.policies.ranking import allocate, rank, softmax
from spec_tot.tree import Node, SearchTree

__all__ = ["Rebase"]


class Rebase(BreadthPolicy):
    name = "rebase"

    def __init__(
        self,
        width: int = 16,
        temperature: float = 0.2,
        max_depth: int = 40,
        aggregation: str = "last",
        vote: str = "weighted",
    ) -> None:
        check_positive("width", width)
        check_positive_float("temperature", temperature)
        super().__init__(max_depth, aggregation, vote)
        self.width = width
        self.temperature = float(temperature)

    def _root_width(self) -> int:
        return self.width

    @property
    def remaining(self) -> int:
        return self.width - self.completed

    def allocation(self, nodes: list[Node]) -> list[tuple[Node, int, float]]:
        """``(node, w_i, p_i)`` for ``nodes`` ranked best first; ``sum(w_i) == remaining``."""
        ranked = rank(nodes, self.score)
        shares = softmax([self.score(n) for n in ranked], self.temperature)
        widths = allocate(shares, self.remaining)
        return list(zip(ranked, widths, shares, strict=True))

    def _select(self, tree: SearchTree, round_nodes: list[Node]) -> list[Expansion]:
        if self.remaining <= 0:
            return []
        active = [c for c in round_nodes if self.expandable(c)]
        return [Expansion(n.id, w) for n, w, _ in self.allocation(active) if w > 0]

    def _predict_select(self, tree: SearchTree, nodes: list[Node]) -> list[tuple[Expansion, float]]:
        """REBASE's own rule on the (partly predicted) round; utility ``p_i``."""
        if self.remaining <= 0:
            return []
        active = [c for c in nodes if self.expandable(c)]
        return [(Expansion(n.id, w), p) for n, w, p in self.allocation(active) if w > 0]
