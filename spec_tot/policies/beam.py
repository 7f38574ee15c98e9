"""Beam search against a PRM, with search-and-learn semantics (Snell et al. 2024;
huggingface/search-and-learn ``beam_search``).

``n`` is the logical budget of beams and ``width`` the expansion width of each kept beam:
- round 0 expands the root with ``n`` children;
- at the end of every round, terminal SCORED children are completed beams; among the scored
  non-terminal children below ``max_depth``, the top ``k = n // width`` by score (ties to the
  smaller id path) are kept and each is expanded with ``width`` children (<= n per round);
- the search stops once ``n`` beams are completed, or when no child can be kept.
``keep_count`` is ``k`` (the round is a top-k, so early pruning keeps the selection).
``predict`` (``BreadthPolicy``'s chained prediction) applies this rule to the known children of
the unfinished round (scored, or with a predicted reward), then to their known speculative
children, and so on; utility ``(k - rank) / k`` per level: the higher a node ranks now, the
likelier it stays in the top k.
"""

from __future__ import annotations

from spec_tot.policies.base import Expansion
from spec_tot.policies.breadth import BeamShaped
from spec_tot.policies.ranking import rank
from spec_tot.tree import Node, SearchTree

__all__ = ["BeamSearch"]


class BeamSearch(BeamShaped):
    name = "beam"

    def _root_width(self) -> int:
        return self.n

    def keep_count(self, tree: SearchTree) -> int | None:
        return self.beams

    def _select(self, tree: SearchTree, round_nodes: list[Node]) -> list[Expansion]:
        if self.completed >= self.n:
            return []
        active = [c for c in round_nodes if self.expandable(c)]
        return [Expansion(c.id, self.width) for c in rank(active, self.score)[: self.beams]]
