"""The original Tree-of-Thoughts BFS (Yao et al. 2023, Algorithm 1): every kept state is
expanded with ``width`` samples, every new state is valued (the value prompt's score is the
node's reward), and the ``breadth`` best states of the level are kept (ties to the smaller
id path), terminal or not. Kept non-terminal states below ``max_depth`` are expanded next;
the search stops when no kept state can be expanded. The answer is the best terminal state.
``keep_count`` is ``breadth``; ``predict`` (``BreadthPolicy``'s chained prediction) keeps the
currently top-``breadth`` known states of the unfinished level, and of the levels below it,
with utility ``(breadth - rank) / breadth``.
"""

from __future__ import annotations

from spec_tot.policies.base import Expansion
from spec_tot.policies.breadth import BreadthPolicy
from spec_tot.policies.checks import check_positive
from spec_tot.policies.ranking import rank
from spec_tot.tree import Node, SearchTree

__all__ = ["ToTBFS"]


class ToTBFS(BreadthPolicy):
    name = "tot_bfs"

    def __init__(
        self,
        breadth: int = 5,
        width: int = 8,
        max_depth: int = 4,
        aggregation: str = "last",
        vote: str = "best",
    ) -> None:
        check_positive("breadth", breadth)
        check_positive("width", width)
        super().__init__(max_depth, aggregation, vote)
        self.breadth = breadth
        self.width = width

    def _root_width(self) -> int:
        return self.width

    def keep_count(self, tree: SearchTree) -> int | None:
        return self.breadth

    def _select(self, tree: SearchTree, round_nodes: list[Node]) -> list[Expansion]:
        scored = [c for c in round_nodes if self.seen(c)]
        kept = rank(scored, self.score)[: self.breadth]
        return [Expansion(c.id, self.width) for c in kept if self.expandable(c)]
