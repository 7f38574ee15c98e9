"""The original Tree-of-Thoughts DFS (Yao et al. 2023, Algorithm 2): expand a state with
``width`` samples, value them, and descend into the best child whose value is at least
``threshold`` (ties to the smaller id path); the other good children are tried in rank order
after the subtree below the first one fails. A state with no good expandable child is a dead
end: the search backtracks to the next untried sibling (each return to a parent counts as
one backtrack; more than ``max_backtracks`` ends the search). The search also ends at the
first terminal child with value >= ``threshold`` (the answer), or when no state is left.
Without such a terminal, the answer is the best terminal node found (``vote``).

``keep_count`` is ``None``. ``predict`` runs a shadow of DFS forward on the known nodes (see
``predict``): what DFS would expand next, then, as if that subtree dead-ended, what it would
try after it; utility ``1 / (1 + pick)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from spec_tot.errors import ConfigError
from spec_tot.policies.base import Answer, Candidate, Expansion, SearchPolicy, startable_width
from spec_tot.policies.checks import check_aggregation, check_finite, check_positive, check_vote
from spec_tot.policies.outstanding import Outstanding, feed_known
from spec_tot.policies.ranking import Vote, rank, vote_answer
from spec_tot.tree import Aggregation, Node, NodeStatus, SearchTree

__all__ = ["ToTDFS"]


class ToTDFS(SearchPolicy):
    name = "tot_dfs"

    def __init__(
        self,
        width: int = 5,
        threshold: float = 0.5,
        max_depth: int = 4,
        max_backtracks: int = 10,
        aggregation: str = "last",
        vote: str = "best",
    ) -> None:
        check_positive("width", width)
        check_finite("threshold", threshold)
        check_positive("max_depth", max_depth)
        if isinstance(max_backtracks, bool) or not isinstance(max_backtracks, int):
            raise ConfigError("max_backtracks", f"must be an integer, got {max_backtracks!r}")
        if max_backtracks < 0:
            raise ConfigError("max_backtracks", f"must be >= 0, got {max_backtracks}")
        self.width = width
        self.threshold = float(threshold)
        self.max_depth = max_depth
        self.max_backtracks = max_backtracks
        self.aggregation: Aggregation = check_aggregation(aggregation)
        self.vote: Vote = check_vote(vote)
        self._outstanding = Outstanding()
        self._stack: list[list[Node]] = []  # per depth: good children not tried yet
        self._current: Node | None = None  # the state whose expansion is in flight
        self._started = False
        self._finished = False
        self.backtracks = 0
        self.found: Node | None = None
        self._fed: set[str] = set()  # a shadow's known nodes, seen as scored

    def seen(self, node: Node) -> bool:
        if node.status is NodeStatus.SCORED:
            return True
        return self._predictive and node.id in self._fed and node.known

    def _good(self, nodes: Sequence[Node]) -> list[Node]:
        scored = [c for c in nodes if self.seen(c)]
        return [c for c in rank(scored, self.score) if self.score(c) >= self.threshold]

    def initial(self, tree: SearchTree) -> list[Expansion]:
        if self._started:
            return []
        self._started = True
        return self._expand(tree.root)

    def on_reward(self, tree: SearchTree, scored: Sequence[Node]) -> list[Expansion]:
        if self._finished or not self._outstanding.receive(scored):
            return []
        if not self._outstanding.pop_complete():
            return []
        assert self._current is not None  # an expansion was in flight
        good = self._good(self._current.children)
        self._current = None
        hits = [c for c in good if c.terminal]
        if hits:
            self.found = hits[0]
            self._finished = True
            return []
        self._stack.append([c for c in good if self.expandable(c)])
        return self._advance()

    def _advance(self) -> list[Expansion]:
        while self._stack:
            frame = self._stack[-1]
            while frame:
                node = frame.pop(0)
                if self.expandable(node):  # may have been pruned meanwhile
                    return self._expand(node)
            self._stack.pop()
            self.backtracks += 1
            if self.backtracks > self.max_backtracks:
                break
        self._finished = True
        return []

    def _expand(self, node: Node) -> list[Expansion]:
        self._current = node
        out = [Expansion(node.id, self.width)]
        self._outstanding.add(out)
        return out

    def predict(self, tree: SearchTree, budget: int) -> list[Candidate]:
        """A shadow runs DFS forward on the known nodes (pending rewards predicted) to the
        first expansion whose children are not all known: a candidate if it can start.
        Then, as if that subtree dead-ended, the shadow backtracks to what DFS would try
        next, up to ``budget`` children."""
        if budget <= 0 or self._finished or self._current is None:
            return []
        shadow = self.shadow()
        out: list[Candidate] = []
        left = budget
        for _ in range(4 * budget + 4):
            step = feed_known(
                shadow._outstanding, shadow._fed, tree, shadow.on_reward, partial=True
            )
            if step is None or shadow._finished:
                break
            node, width, _ = step
            room = min(startable_width(node, width), left)
            if room > 0 and all(c.parent_id != node.id for c in out):
                out.append(Candidate(node.id, room, 1.0 / (1 + len(out))))
                left -= room
                if left <= 0:
                    break
            shadow._outstanding = Outstanding()
            shadow._current = None
            shadow._stack.append([])  # a dead end: DFS backtracks from here
            shadow._advance()
        return out

    def _copy_state(self) -> None:
        self._outstanding = Outstanding(
            dict(self._outstanding.pending),
            {k: set(v) for k, v in self._outstanding.received.items()},
        )
        self._stack = [list(frame) for frame in self._stack]
        self._fed = set()

    def done(self, tree: SearchTree) -> bool:
        return self._finished

    def answer(self, tree: SearchTree) -> Answer | None:
        if self.found is not None:
            node = self.found
            return Answer(node.answer, node.id, self.score(node), {})
        return vote_answer(tree.terminals(), self.vote, self.score)
