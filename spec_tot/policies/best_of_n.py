"""Best-of-N: ``n`` independent full traces, then a vote.

A trace is a chain of nodes: the root is expanded once with ``n`` children (the ``n`` first
steps); afterwards every scored, non-terminal node below ``max_depth`` is extended with one
child, at once (traces are independent, so there is no round barrier). A trace ends at a
terminal node, at ``max_depth``, or when its step fails. The answer is a vote over the
terminal SCORED nodes: ``majority`` (one vote per trace), ``weighted`` (sum of the traces'
scores per answer) or ``best`` (the single best-scored trace). Nothing is ever waiting on a
selection, so every step that goes on will be extended: ``predict`` offers each known step
(its reward may be pending) whose continuation has not started; ``keep_count`` is ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence

from spec_tot.policies.base import Answer, Candidate, Expansion, SearchPolicy, startable_width
from spec_tot.policies.checks import check_aggregation, check_positive, check_vote
from spec_tot.policies.outstanding import Outstanding
from spec_tot.policies.ranking import Vote, fit_budget, vote_answer
from spec_tot.tree import Aggregation, Node, SearchTree

__all__ = ["BestOfN"]


class BestOfN(SearchPolicy):
    name = "best_of_n"

    def __init__(
        self,
        n: int = 8,
        vote: str = "majority",
        aggregation: str = "last",
        max_depth: int = 40,
    ) -> None:
        check_positive("n", n)
        check_positive("max_depth", max_depth)
        self.n = n
        self.vote: Vote = check_vote(vote)
        self.aggregation: Aggregation = check_aggregation(aggregation)
        self.max_depth = max_depth
        self._outstanding = Outstanding()
        self._started = False

    def initial(self, tree: SearchTree) -> list[Expansion]:
        if self._started:
            return []
        self._started = True
        out = [Expansion(tree.root.id, self.n)]
        self._outstanding.add(out)
        return out

    def on_reward(self, tree: SearchTree, scored: Sequence[Node]) -> list[Expansion]:
        accepted = self._outstanding.receive(scored)
        self._outstanding.pop_complete()
        out = [Expansion(c.id, 1) for c in accepted if self.expandable(c)]
        self._outstanding.add(out)
        return out

    def predict(self, tree: SearchTree, budget: int) -> list[Candidate]:
        """Every known trace step that goes on (its reward may still be pending; committed
        or speculative, at any depth) will be extended by one child: all are candidates,
        shallowest first."""
        if budget <= 0:
            return []
        shadow = self.shadow()
        out = [
            Candidate(n.id, 1, 1.0 / n.depth)
            for n in tree.nodes()
            if n.parent is not None and shadow.expandable(n) and startable_width(n, 1)
        ]
        out.sort(key=lambda c: (-c.utility, tree[c.parent_id].key))
        return fit_budget(out, budget)

    def done(self, tree: SearchTree) -> bool:
        return self._started and self._outstanding.empty

    def answer(self, tree: SearchTree) -> Answer | None:
        return vote_answer(tree.terminals(), self.vote, self.score)
