"""Monte-Carlo tree search over thoughts: plain UCT, REST-MCTS* and rStar.

One iteration = selection -> expansion of the selected leaf with ``width`` children -> (for
the variants) a rollout -> backup; exactly one iteration is in flight at a time (the DFS
reward barrier). Statistics live on the tree nodes (``visits``, ``value_sum``), so SPEX can
simulate on ``tree.snapshot()``. A node's value estimate ``q`` is ``value_sum / visits`` once
visited, else its reward (the PRM's prior).

Selection descends from the root through SCORED children only (running, speculative,
cancelled and pruned nodes are never picked): unvisited children first (the best-scored, then
the smaller id path), otherwise the highest UCT value (ties: higher ``q``, then smaller id path).
A selected leaf that cannot be expanded (terminal, at ``max_depth``, or already expanded with
every child failed) is a dead end: the iteration backs up without an expansion. The search
ends after ``iterations`` iterations, so it always terminates.

``predict(budget)`` is SPEX T1: on a snapshot, the in-flight iteration's path takes a virtual
loss, then up to ``budget`` further selections are simulated; after each simulated pick the
picked path takes a virtual loss (``visits + 1``, value ``+ 0``: pessimistic). Picks that are
not expandable (terminal, running, speculative, already expanded) are skipped. Utility of a
pick is its finite UCT value ``q + c * sqrt(ln(N_parent + 1) / (n + 1))`` at pick time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from spec_tot.errors import ConfigError
from spec_tot.policies._common import (
    Outstanding,
    Vote,
    check_aggregation,
    check_finite,
    check_nonnegative,
    check_positive,
    check_range,
    check_vote,
    expandable,
    rank,
    vote_answer,
)
from spec_tot.policies.base import Answer, Candidate, Expansion, SearchPolicy
from spec_tot.tree import Aggregation, Node, NodeStatus, SearchTree

__all__ = ["MCTS", "RStarMCTS", "RestMCTS"]


class MCTS(SearchPolicy):
    """Plain UCT: ``UCT(child) = q(child) + c * sqrt(ln N_parent / n_child)``.

    Backup after an expansion: each scored child gets one visit worth its reward, and every
    node on the selected path (root included) gets one visit per scored child plus their
    rewards (the children are ``m`` evaluated simulations). A dead end backs up its ``q`` if
    terminal, else 0 (no answer below it).
    """

    name = "mcts"

    def __init__(
        self,
        width: int = 4,
        c: float = 1.4,
        iterations: int = 40,
        max_depth: int = 40,
        aggregation: str = "last",
        vote: str = "best",
    ) -> None:
        check_positive("width", width)
        check_nonnegative("c", c)
        check_positive("iterations", iterations)
        check_positive("max_depth", max_depth)
        self.width = width
        self.c = float(c)
        self.iterations = iterations
        self.max_depth = max_depth
        self.aggregation: Aggregation = check_aggregation(aggregation)
        self.vote: Vote = check_vote(vote)
        self._outstanding = Outstanding()
        self._path: list[Node] = []  # root .. node whose expansion is in flight
        self._started = False
        self._finished = False
        self.iterations_run = 0

    # -- statistics -----------------------------------------------------------------------
    def q(self, node: Node) -> float:
        return node.value if node.visits else self.score(node)

    def explore(self, parent: Node, child: Node) -> float:
        return self.c * math.sqrt(math.log(max(parent.visits, 1)) / child.visits)

    def uct(self, parent: Node, child: Node) -> float:
        if child.visits == 0:
            return math.inf
        return self.q(child) + self.explore(parent, child)

    def best_child(self, parent: Node, kids: Sequence[Node]) -> Node:
        """The highest UCT; ties: the higher ``q``, then the smaller id path."""
        return min(kids, key=lambda ch: (-self.uct(parent, ch), -self.q(ch), ch.key))

    def select(self, root: Node) -> list[Node]:
        path = [root]
        node = root
        while True:
            kids = [c for c in node.children if c.status is NodeStatus.SCORED]
            if not kids:
                return path
            node = self.best_child(node, kids)
            path.append(node)

    @staticmethod
    def backup(path: Sequence[Node], reward: float, visits: int = 1) -> None:
        for node in path:
            node.visits += visits
            node.value_sum += reward

    # -- variant hooks --------------------------------------------------------------------
    def _expanded(self, tree: SearchTree, kids: list[Node]) -> Expansion | None:
        """All children of ``self._path[-1]`` are resolved; ``kids`` are the scored ones.
        Returns a rollout continuation, or ``None`` when the iteration is over."""
        for kid in kids:
            kid.visits += 1
            kid.value_sum += self.score(kid)
        if kids:
            self.backup(self._path, sum(self.score(k) for k in kids), visits=len(kids))
        else:
            self.backup(self._path, 0.0)
        return None

    def _dead_end(self, path: list[Node]) -> None:
        leaf = path[-1]
        self.backup(path, self.q(leaf) if leaf.terminal else 0.0)

    def _stop(self, tree: SearchTree) -> bool:
        return False

    # -- the protocol ---------------------------------------------------------------------
    def initial(self, tree: SearchTree) -> list[Expansion]:
        if self._started:
            return []
        self._started = True
        return self._run(tree)

    def on_reward(self, tree: SearchTree, scored: Sequence[Node]) -> list[Expansion]:
        if self._finished or not self._outstanding.receive(scored):
            return []
        if not self._outstanding.pop_complete():
            return []  # wait for every child of the expansion
        parent = self._path[-1]
        kids = [c for c in parent.children if c.status is NodeStatus.SCORED]
        nxt = self._expanded(tree, kids)
        if nxt is not None:
            return self._commit(nxt)
        return self._run(tree)

    def _commit(self, expansion: Expansion) -> list[Expansion]:
        self._outstanding.add([expansion])
        return [expansion]

    def _run(self, tree: SearchTree) -> list[Expansion]:
        """Start iterations until one needs an expansion, or the search is over."""
        while not self._stop(tree) and self.iterations_run < self.iterations:
            path = self.select(tree.root)
            self.iterations_run += 1
            leaf = path[-1]
            if expandable(leaf, self.max_depth):
                self._path = path
                return self._commit(Expansion(leaf.id, self.width))
            if leaf is tree.root:
                break  # the root cannot be expanded (again): nothing is left to search
            self._dead_end(path)
        self._finished = True
        self._path = []
        return []

    def predict(self, tree: SearchTree, budget: int) -> list[Candidate]:
        if budget <= 0 or self._finished or not self._started:
            return []
        snap = tree.snapshot()
        for node in self._path:  # the in-flight iteration, as a pessimistic visit
            snap[node.id].visits += 1
        out: list[Candidate] = []
        left = budget
        for _ in range(4 * budget + 4):  # bounded: skipped picks still take a virtual loss
            path = self.select(snap.root)
            leaf = path[-1]
            if expandable(leaf, self.max_depth) and all(c.parent_id != leaf.id for c in out):
                parent = path[-2] if len(path) > 1 else leaf
                util = self.q(leaf) + self.c * math.sqrt(
                    math.log(parent.visits + 1) / (leaf.visits + 1)
                )
                out.append(Candidate(leaf.id, min(self.width, left), util))
                left -= out[-1].width
                if left <= 0:
                    break
            elif len(path) == 1:
                break  # the root itself is blocked: no selection can go anywhere
            self.backup(path, 0.0)
        return out

    def done(self, tree: SearchTree) -> bool:
        return self._finished

    def answer(self, tree: SearchTree) -> Answer | None:
        return vote_answer(tree.terminals(), self.vote, self.score)


class RStarMCTS(MCTS):
    """rStar (Qi et al. 2024, "Mutual Reasoning Makes Smaller LLMs Stronger Problem-Solvers";
    zhentingqi/rStar ``MCTS_backbone.py``): ``UCT = Q/N + c * sqrt(ln N_parent / N)``,
    ``c = 2``. Only terminal rewards are backed up: after the selected leaf is expanded, the
    rollout keeps descending (unvisited child first: the best-scored, ties smaller id path) and
    expanding until it reaches a terminal node; then every node of the rollout path, root
    included, gets ``N += 1, Q += r_terminal``. A rollout that dies (all children failed, or
    ``max_depth`` without a terminal) backs up 0. Answer: majority vote over terminals.
    """

    name = "rstar"

    def __init__(
        self,
        width: int = 4,
        c: float = 2.0,
        iterations: int = 32,
        max_depth: int = 40,
        aggregation: str = "last",
        vote: str = "majority",
    ) -> None:
        super().__init__(width, c, iterations, max_depth, aggregation, vote)

    def _expanded(self, tree: SearchTree, kids: list[Node]) -> Expansion | None:
        if not kids:
            self.backup(self._path, 0.0)
            return None
        nxt = self.best_child(self._path[-1], kids)
        self._path.append(nxt)
        if nxt.terminal:
            self.backup(self._path, self.score(nxt))
            return None
        if expandable(nxt, self.max_depth):
            return Expansion(nxt.id, self.width)  # the rollout goes on (same iteration)
        self.backup(self._path, 0.0)
        return None


class RestMCTS(MCTS):
    """REST-MCTS* (Zhang et al. 2024, "ReST-MCTS*: LLM Self-Training via Process Reward
    Guided Tree Search"; THUDM/ReST-MCTS ``MCTS/mcts.py``). ``V`` is the weighted quality
    value: a new node's ``V`` is its reward; ``UCT = V + c * sqrt(2 ln N_parent / n)``.

    After the selected leaf ``L`` is expanded, the roll node ``R`` = the best child by UCT
    (all unvisited: the best-scored) is rolled out greedily for up to ``rollout_depth`` steps:
    expand with ``width``, follow the best-scored child, stop at a terminal; ``r`` = the best
    reward seen (``V(R)`` if no step ran). Then ``V(R) <- (1 - alpha) V(R) + alpha r`` and
    ``n(R) += 1``; backup from ``L`` to the root: ``n += 1`` and, where visited children
    exist, ``V = sum(V_c n_c) / sum(n_c)``. Rollout nodes stay in the tree (a later
    selection reuses them). The search stops as soon as a terminal SCORED node has
    ``V >= end_gate`` (it is the answer); otherwise the answer is the best terminal by ``V``.
    """

    name = "rest_mcts"

    def __init__(
        self,
        width: int = 4,
        c: float = 0.5,
        alpha: float = 0.5,
        end_gate: float = 0.9,
        rollout_depth: int = 2,
        iterations: int = 40,
        max_depth: int = 40,
        aggregation: str = "last",
    ) -> None:
        super().__init__(width, c, iterations, max_depth, aggregation, "best")
        check_range("alpha", alpha, 0.0, 1.0)
        check_finite("end_gate", end_gate)
        if isinstance(rollout_depth, bool) or not isinstance(rollout_depth, int):
            raise ConfigError("rollout_depth", f"must be an integer, got {rollout_depth!r}")
        check_nonnegative("rollout_depth", rollout_depth)
        self.alpha = float(alpha)
        self.end_gate = float(end_gate)
        self.rollout_depth = rollout_depth
        self._roll: Node | None = None
        self._best = -math.inf
        self._steps = 0
        self._leaf_len = 0  # length of the selected path while its rollout runs
        self.solution: Node | None = None

    def explore(self, parent: Node, child: Node) -> float:
        return self.c * math.sqrt(2 * math.log(max(parent.visits, 1)) / child.visits)

    def _set_v(self, node: Node, v: float) -> None:
        node.value_sum = v * node.visits

    def _backprop(self, path: list[Node]) -> None:
        for node in reversed(path):
            v = self.q(node)
            node.visits += 1
            seen = [c for c in node.children if c.status is NodeStatus.SCORED and c.visits]
            total = sum(c.visits for c in seen)
            self._set_v(node, sum(self.q(c) * c.visits for c in seen) / total if total else v)

    def _finish_rollout(self) -> None:
        roll = self._roll
        assert roll is not None  # only called while a rollout is open
        v = self.q(roll)
        r = self._best if self._best > -math.inf else v
        roll.visits += 1
        self._set_v(roll, (1 - self.alpha) * v + self.alpha * r)
        self._roll = None
        self._path = self._path[: self._leaf_len]
        self._backprop(self._path)

    def _expanded(self, tree: SearchTree, kids: list[Node]) -> Expansion | None:
        if self._roll is None:  # the selected leaf's expansion came back
            if not kids:
                self._backprop(self._path)
                return None
            self._leaf_len = len(self._path)
            leaf = self._path[-1]
            self._roll = self.best_child(leaf, kids)
            self._best, self._steps, cur = -math.inf, 0, self._roll
        else:  # a greedy rollout step came back
            self._steps += 1
            if not kids:
                self._finish_rollout()
                return None
            cur = rank(kids, self.score)[0]
            self._best = max(self._best, self.score(cur))
        if cur.terminal or self._steps >= self.rollout_depth or not expandable(cur, self.max_depth):
            self._finish_rollout()
            return None
        self._path.append(cur)  # so that on_reward finds the rollout step's parent
        return Expansion(cur.id, self.width)

    def _dead_end(self, path: list[Node]) -> None:
        self._backprop(path)

    def _stop(self, tree: SearchTree) -> bool:
        gated = [n for n in tree.terminals() if self.q(n) >= self.end_gate]
        if gated:
            self.solution = rank(gated, self.q)[0]
        return self.solution is not None

    def answer(self, tree: SearchTree) -> Answer | None:
        if self.solution is not None:
            node = self.solution
            return Answer(node.answer, node.id, self.q(node), {})
        return vote_answer(tree.terminals(), "best", self.q)
