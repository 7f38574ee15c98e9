"""REST-MCTS* (Zhang et al. 2024): MCTS with greedy rollouts and a weighted quality value;
see ``RestMCTS``. The shared MCTS machinery (statistics, selection, SPEX prediction) is in
``spec_tot.policies.mcts``."""

from __future__ import annotations

import math
from collections.abc import Sequence

from spec_tot.errors import ConfigError
from spec_tot.policies.base import Answer, Expansion
from spec_tot.policies.checks import check_finite, check_nonnegative, check_range
from spec_tot.policies.mcts import MCTS
from spec_tot.policies.ranking import rank, vote_answer
from spec_tot.tree import Node, NodeStatus, SearchTree

__all__ = ["RestMCTS"]


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
    _explore_scale = 2.0  # UCT = V + c * sqrt(2 ln N / n)

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
        self._finals: list[Node] = []  # terminal nodes delivered scored (the stop rule's)

    def on_reward(self, tree: SearchTree, scored: Sequence[Node]) -> list[Expansion]:
        self._finals.extend(n for n in scored if n.terminal and n.status is NodeStatus.SCORED)
        return super().on_reward(tree, scored)

    def _copy_state(self) -> None:
        super()._copy_state()
        self._finals = list(self._finals)

    def _set_v(self, node: Node, v: float) -> None:
        self.set_value_sum(node, v * self.visits(node))

    def _backprop(self, path: list[Node]) -> None:
        # (One pass per node over its children: a shadow runs this for every prediction.)
        visits, value_sum, seen = self.visits, self.value_sum, self.seen
        for node in reversed(path):
            v = self.q(node)
            self.add_stats(node, 1, 0.0)
            total, weighted = 0, 0.0
            for c in node.children:
                n = visits(c)
                if n and seen(c):
                    total += n
                    weighted += value_sum(c) / n * n  # q x n, rounded as the paper's code
            self._set_v(node, weighted / total if total else v)

    def _finish_rollout(self) -> None:
        roll = self._roll
        assert roll is not None  # only called while a rollout is open
        v = self.q(roll)
        r = self._best if self._best > -math.inf else v
        self.add_stats(roll, 1, 0.0)
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
        if cur.terminal or self._steps >= self.rollout_depth or not self.expandable(cur):
            self._finish_rollout()
            return None
        self._path.append(cur)  # so that on_reward finds the rollout step's parent
        return Expansion(cur.id, self.width)

    def _dead_end(self, path: list[Node]) -> None:
        self._backprop(path)

    def _stop(self, tree: SearchTree) -> bool:
        # The terminal SCORED nodes (kept as they arrive: the whole tree is not scanned at
        # every selection).
        finals = (n for n in self._finals if n.status is NodeStatus.SCORED)
        gated = [n for n in finals if self.q(n) >= self.end_gate]
        if gated:
            self.solution = rank(gated, self.q)[0]
        return self.solution is not None

    def answer(self, tree: SearchTree) -> Answer | None:
        if self.solution is not None:
            node = self.solution
            return Answer(node.answer, node.id, self.q(node), {})
        return vote_answer(tree.terminals(), "best", self.q)
