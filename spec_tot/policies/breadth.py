"""``BreadthPolicy``: the shared skeleton of the BFS-style policies (beam, DVTS, REBASE, ETS,
ToT BFS). A round is the set of children of the expansions committed together; the next
selection happens only once every child of the round is resolved (the reward barrier that
speculation runs ahead of). Subclasses supply the root width and the selection rule.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

from spec_tot.policies.base import Answer, Candidate, Expansion, SearchPolicy, startable_width
from spec_tot.policies.checks import (
    check_aggregation,
    check_beam_shape,
    check_positive,
    check_vote,
)
from spec_tot.policies.outstanding import Outstanding
from spec_tot.policies.ranking import Vote, fit_budget, vote_answer
from spec_tot.tree import Aggregation, Node, NodeStatus, SearchTree

__all__ = ["BeamShaped", "BreadthPolicy"]

_MAX_LEVELS = 8  # prediction depth below the open round (the executor caps it further)


def _key(node: Node) -> tuple[int, ...]:
    return node.key


class BreadthPolicy(SearchPolicy):
    discards_unselected = True

    def __init__(self, max_depth: int, aggregation: str, vote: str) -> None:
        check_positive("max_depth", max_depth)
        self.max_depth = max_depth
        self.aggregation: Aggregation = check_aggregation(aggregation)
        self.vote: Vote = check_vote(vote)
        self._outstanding = Outstanding()
        self._round: list[Node] = []  # children of the current round resolved so far
        self._started = False
        self._finished = False
        self.completed = 0  # terminal SCORED nodes seen (finished traces)
        self.rounds = 0

    # -- what subclasses define -------------------------------------------------------------
    @abstractmethod
    def _root_width(self) -> int: ...

    @abstractmethod
    def _select(self, tree: SearchTree, round_nodes: list[Node]) -> list[Expansion]:
        """The next round's expansions, given every resolved child of the finished round
        (in creation order). An empty list ends the search."""

    def _predict_select(self, tree: SearchTree, nodes: list[Node]) -> list[tuple[Expansion, float]]:
        """The selection rule on a (partly) predicted round, each expansion with its utility
        (how likely the real round selects it): by default ``_select``, utility falling with
        rank. Runs on the shadow (predictive view)."""
        exps = self._select(tree, nodes)
        return [(e, (len(exps) - r) / len(exps)) for r, e in enumerate(exps)]

    # -- the protocol ---------------------------------------------------------------------
    def initial(self, tree: SearchTree) -> list[Expansion]:
        if self._started:  # a second call must not expand the root twice
            return []
        self._started = True
        return self._commit([Expansion(tree.root.id, self._root_width())])

    def on_reward(self, tree: SearchTree, scored: Sequence[Node]) -> list[Expansion]:
        accepted = self._outstanding.receive(scored)
        self._round.extend(accepted)
        self.completed += sum(1 for n in accepted if _is_final_answer(n))
        if self._finished or not accepted:
            return []
        if not all(self._outstanding.complete(p) for p in self._outstanding.pending):
            return []  # barrier: wait for the slowest sibling of the round
        round_nodes = sorted(self._round, key=lambda n: n.key)
        self._round = []
        self._outstanding = Outstanding()
        self.rounds += 1
        return self._commit(self._select(tree, round_nodes))

    def predict(self, tree: SearchTree, budget: int) -> list[Candidate]:
        """SPEX T1 for BFS, chained: the open round's known nodes (scored, or generated
        with a provisional reward) are selected by the policy's own rule; the selected
        nodes' known speculative children form the next (predicted) round, selected by the
        same rule, and so on down the chain. A candidate's utility is the product of the
        utilities along its chain."""
        if budget <= 0 or self._finished:
            return []
        shadow = self.shadow()
        received = {n.id for n in self._round}
        level = [
            c for p in self._outstanding.pending for c in tree[p].children if not c.speculative
        ]
        shadow.completed += sum(1 for n in level if n.known and n.terminal and n.id not in received)
        chain: dict[str, float] = {}
        out: list[Candidate] = []
        for _ in range(_MAX_LEVELS):
            level = _with_placeholders(shadow, level)
            if not level:
                break
            next_level: list[Node] = []
            for exp, utility in shadow._predict_select(tree, sorted(level, key=_key)):
                node = tree[exp.parent_id]
                reach = chain.get(node.id, 1.0) * utility
                room = startable_width(node, exp.width)
                if room:
                    out.append(Candidate(node.id, room, reach))
                for child in node.children:
                    chain[child.id] = reach
                    next_level.append(child)
            shadow.completed += sum(1 for n in next_level if n.known and n.terminal)
            level = next_level
        out.sort(key=lambda c: -c.utility)
        return fit_budget(out, budget)

    def done(self, tree: SearchTree) -> bool:
        return self._finished

    def answer(self, tree: SearchTree) -> Answer | None:
        return vote_answer(tree.terminals(), self.vote, self.score)

    # -- helpers --------------------------------------------------------------------------
    def _commit(self, expansions: list[Expansion]) -> list[Expansion]:
        expansions = [e for e in expansions if e.width > 0]
        if expansions:
            self._outstanding.add(expansions)
        else:
            self._finished = True
        return expansions


def _with_placeholders(shadow: BreadthPolicy, level: list[Node]) -> list[Node]:
    """``level``'s known nodes and its live unknown ones (still generating), these with the
    known nodes' mean predicted score as a placeholder on ``shadow``: the round is ranked
    whole. Empty when no node is known (nothing could start below it)."""
    known = [n for n in level if n.known]
    if not known:
        return []
    live = [n for n in level if not n.known and not n.status.final]
    if live:
        mean = sum(shadow.score(n) for n in known) / len(known)
        shadow._placeholders = {**shadow._placeholders, **{n.id: mean for n in live}}
    return known + live


def _is_final_answer(node: Node) -> bool:
    return node.terminal and node.status is NodeStatus.SCORED


class BeamShaped(BreadthPolicy):
    """A breadth policy over ``n`` samples a round in ``n // width`` beams of ``width``
    (beam search keeps the best ``beams`` and expands each ``width`` ways; DVTS grows
    ``beams`` independent subtrees)."""

    def __init__(
        self,
        n: int = 8,
        width: int = 4,
        max_depth: int = 40,
        aggregation: str = "last",
        vote: str = "best",
    ) -> None:
        check_beam_shape(n, width)
        super().__init__(max_depth, aggregation, vote)
        self.n = n
        self.width = width
        self.beams = n // width
