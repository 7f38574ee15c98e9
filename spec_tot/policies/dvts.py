"""DVTS: diverse verifier tree search (Beeching et al. 2024, search-and-learn ``dvts``).

The budget ``n`` is split into ``m = n // width`` independent subtrees:
- round 0 expands the root with ``m * width`` children; root child ``i`` (creation order)
  founds subtree ``i // width``, so each subtree starts from ``width`` diverse first steps;
- at the end of every round each live subtree keeps its single best scored child (ties to the
  smaller id path): if that child is terminal, the subtree is complete; if it is expandable it
  is expanded with ``width`` children; otherwise (depth limit, or every child failed) the
  subtree ends. This is greedy beam search of width ``width`` per subtree.
The answer votes over all terminal nodes (default: the best one). ``keep_count`` is ``None``:
the selection is a top-1 per subtree, not a global top-k. ``predict`` (``BreadthPolicy``'s
chained prediction) applies the same rule to the known part of the round and of the rounds
below it; utility falls with rank.
"""

from __future__ import annotations

from spec_tot.policies.base import Expansion
from spec_tot.policies.breadth import BeamShaped
from spec_tot.policies.ranking import rank
from spec_tot.tree import Node, SearchTree

__all__ = ["DVTS"]


class DVTS(BeamShaped):
    name = "dvts"

    def _root_width(self) -> int:
        return self.beams * self.width

    def subtree_of(self, node: Node) -> int:
        """Index of the subtree that ``node`` belongs to (from its depth-1 ancestor)."""
        first = node.path()[0]
        assert first.parent is not None  # a path never contains the root
        return first.parent.children.index(first) // self.width

    def _groups(self, nodes: list[Node]) -> dict[int, list[Node]]:
        groups: dict[int, list[Node]] = {}
        for node in nodes:
            groups.setdefault(self.subtree_of(node), []).append(node)
        return dict(sorted(groups.items()))

    def _select(self, tree: SearchTree, round_nodes: list[Node]) -> list[Expansion]:
        out: list[Expansion] = []
        for group in self._groups(round_nodes).values():
            scored = [c for c in group if self.seen(c)]
            if scored:
                best = rank(scored, self.score)[0]
                if self.expandable(best):
                    out.append(Expansion(best.id, self.width))
        return out
