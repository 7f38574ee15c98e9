"""Monte-Carlo tree search over thoughts: plain UCT and rStar (REST-MCTS* in ``rest_mcts``).

One iteration = selection -> expansion of the selected leaf with ``width`` children -> (for
the variants) a rollout -> backup; exactly one iteration is in flight at a time (the DFS
reward barrier). Statistics live on the tree nodes (``visits``, ``value_sum``); a prediction
keeps its own in an overlay over them. A node's value estimate ``q`` is
``value_sum / visits`` once visited, else its reward (the PRM's prior).

Selection descends from the root through SCORED children only (running, speculative,
cancelled and pruned nodes are never picked): unvisited children first (the best-scored, then
the smaller id path), otherwise the highest UCT value (ties: higher ``q``, then smaller id path).
A selected leaf that cannot be expanded (terminal, at ``max_depth``, or already expanded with
every child failed) is a dead end: the iteration backs up without an expansion. The search
ends after ``iterations`` iterations, so it always terminates.

``predict(budget)`` is SPEX T1: a shadow of the policy (its small control state copied, its
statistics in an overlay, no tree copy) runs forward on the *predictive view*: every known
node (generated, its reward real or predicted) counts as scored once fed to it. It feeds the
expansion in flight its children as they become known (or, to avoid waiting for the slowest
sibling, the known ones alone: a guess), follows the policy's own next steps (rStar's and
REST-MCTS*'s rollouts included) down through speculative nodes, and stops at the first
expansion whose children are unknown: a candidate if it can start. Then the shadow's path
takes a visit at its predicted value (the leaf's mean value) and a fresh selection goes on,
up to ``budget`` children. Candidates' utility falls with their pick order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from spec_tot.policies.base import Answer, Candidate, Expansion, SearchPolicy, startable_width
from spec_tot.policies.checks import (
    check_aggregation,
    check_nonnegative,
    check_positive,
    check_vote,
)
from spec_tot.policies.outstanding import Outstanding, feed_known
from spec_tot.policies.ranking import Vote, vote_answer
from spec_tot.tree import Aggregation, Node, NodeStatus, SearchTree

__all__ = ["MCTS", "RStarMCTS"]

# Candidates one prediction offers at most: further picks of the simulation are ever less
# likely, and each costs a selection from the root (the prediction runs every loop tick).
_MAX_CANDIDATES = 6


class MCTS(SearchPolicy):
    """Plain UCT: ``UCT(child) = q(child) + c * sqrt(ln N_parent / n_child)``.

    Backup after an expansion: each scored child gets one visit worth its reward, and every
    node on the selected path (root included) gets one visit per scored child plus their
    rewards (the children are ``m`` evaluated simulations). A dead end backs up its ``q`` if
    terminal, else 0 (no answer below it).
    """

    name = "mcts"
    _explore_scale = 1.0  # UCT's exploration term: c * sqrt(scale * ln N / n)

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
        # A shadow (prediction) keeps its statistics here, over the nodes' own, and sees the
        # known nodes it was fed as scored.
        self._overlay: dict[str, list[float]] | None = None
        self._tree: SearchTree | None = None  # the real search's tree, once it started
        self._fed: set[str] = set()

    # -- statistics -----------------------------------------------------------------------
    def visits(self, node: Node) -> int:
        if self._overlay is not None and node.id in self._overlay:
            return int(self._overlay[node.id][0])
        return node.visits

    def value_sum(self, node: Node) -> float:
        if self._overlay is not None and node.id in self._overlay:
            return self._overlay[node.id][1]
        return node.value_sum

    def add_stats(self, node: Node, visits: int, value: float) -> None:
        if self._overlay is None:
            assert self._tree is not None  # statistics change only once the search started
            self._tree.add_visits(node, visits, value)
            return
        entry = self._overlay.setdefault(node.id, [node.visits, node.value_sum])
        entry[0] += visits
        entry[1] += value

    def set_value_sum(self, node: Node, value_sum: float) -> None:
        if self._overlay is None:
            assert self._tree is not None  # statistics change only once the search started
            self._tree.set_value_sum(node, value_sum)
        else:
            self._overlay.setdefault(node.id, [node.visits, node.value_sum])[1] = value_sum

    def q(self, node: Node) -> float:
        visits = self.visits(node)
        return self.value_sum(node) / visits if visits else self.score(node)

    def explore(self, parent: Node, child: Node) -> float:
        log_n = self._explore_scale * math.log(max(self.visits(parent), 1))
        return self.c * math.sqrt(log_n / self.visits(child))

    def uct(self, parent: Node, child: Node) -> float:
        if self.visits(child) == 0:
            return math.inf
        return self.q(child) + self.explore(parent, child)

    def seen(self, node: Node) -> bool:
        """Scored; in a shadow also a known node it was fed (its reward may be predicted)."""
        if node.status is NodeStatus.SCORED:
            return True
        return self._predictive and node.id in self._fed and node.known

    def best_child(self, parent: Node, kids: Sequence[Node]) -> Node:
        """The highest UCT; ties: the higher ``q``, then the smaller id path. (``uct`` and
        ``q`` inlined: this runs for every step of every simulated selection.)"""
        log_n = self._explore_scale * math.log(max(self.visits(parent), 1))
        best: tuple[float, float, tuple[int, ...]] | None = None
        chosen = kids[0]
        for child in kids:
            visits = self.visits(child)
            if visits:
                q = self.value_sum(child) / visits
                u = q + self.c * math.sqrt(log_n / visits)
            else:
                q, u = self.score(child), math.inf
            rank = (-u, -q, child.key)
            if best is None or rank < best:
                best, chosen = rank, child
        return chosen

    def select(self, root: Node) -> list[Node]:
        path = [root]
        node = root
        while True:
            kids = [c for c in node.children if self.seen(c)]
            if not kids:
                return path
            node = self.best_child(node, kids)
            path.append(node)

    def backup(self, path: Sequence[Node], reward: float, visits: int = 1) -> None:
        for node in path:
            self.add_stats(node, visits, reward)

    # -- variant hooks --------------------------------------------------------------------
    def _expanded(self, tree: SearchTree, kids: list[Node]) -> Expansion | None:
        """All children of ``self._path[-1]`` are resolved; ``kids`` are the scored ones.
        Returns a rollout continuation, or ``None`` when the iteration is over."""
        for kid in kids:
            self.add_stats(kid, 1, self.score(kid))
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
        self._tree = tree  # the owner of the nodes' statistics
        return self._run(tree)

    def on_reward(self, tree: SearchTree, scored: Sequence[Node]) -> list[Expansion]:
        self._tree = tree
        if self._finished or not self._outstanding.receive(scored):
            return []
        if not self._outstanding.pop_complete():
            return []  # wait for every child of the expansion
        parent = self._path[-1]
        kids = [c for c in parent.children if self.seen(c)]
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
            if self.expandable(leaf):
                self._path = path
                return self._commit(Expansion(leaf.id, self.width))
            if leaf is tree.root:
                break  # the root cannot be expanded (again): nothing is left to search
            self._dead_end(path)
        self._finished = True
        self._path = []
        return []

    def predict(self, tree: SearchTree, budget: int) -> list[Candidate]:
        """SPEX T1 for DFS: a shadow of this policy runs forward on the known nodes (fed as
        scored, pending rewards predicted), through the in-flight expansion and any chain of
        speculative expansions whose children are all known, until it needs an expansion
        whose children are not: that leaf is a candidate if it can start. Then the shadow's
        path takes a visit at its predicted value and a fresh selection goes on, up to
        ``budget`` children. Statistics live in the shadow's overlay: no tree copy."""
        return list(self.predictions(tree, budget))

    def predictions(self, tree: SearchTree, budget: int) -> Iterator[Candidate]:
        """``predict``'s candidates as they are pulled: each further one costs simulated
        selections from the root, and later ones are ever less likely to be launched."""
        if budget <= 0 or self._finished or not self._started:
            return
        shadow = self.shadow()
        given: set[str] = set()
        left = budget
        wanted = min(_MAX_CANDIDATES, -(-budget // self.width))
        for _ in range(3 * wanted + 3):  # bounded: blocked picks still take a visit
            if shadow._finished:
                return
            step = feed_known(
                shadow._outstanding, shadow._fed, tree, shadow.on_reward, partial=True
            )
            if step is None:
                return
            node, width, guessed = step
            room = min(startable_width(node, width), left)
            if room > 0 and node.id not in given:
                utility = (0.5 if guessed else 1.0) / (1 + len(given))
                given.add(node.id)
                yield Candidate(node.id, room, utility)
                left -= room
                if left <= 0 or len(given) >= wanted:
                    return
            shadow._virtual_visit()
            shadow._run(tree)

    def _copy_state(self) -> None:
        self._outstanding = Outstanding(
            dict(self._outstanding.pending),
            {k: set(v) for k, v in self._outstanding.received.items()},
        )
        self._path = list(self._path)
        self._overlay = {}
        self._fed = set()

    def _virtual_visit(self) -> None:
        """(A shadow.) Abandon the iteration in flight as if it came back at its predicted
        value: its path takes a visit worth the leaf's mean value (the nearest finite one
        up the path; 0 when none is). The next simulated selection is then the one the
        real search most likely makes next, not one steered off a path it would keep."""
        value = next((v for n in reversed(self._path) if math.isfinite(v := self.q(n))), 0.0)
        self.backup(self._path, value)
        self._outstanding = Outstanding()
        self._path = []

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
        if self.expandable(nxt):
            return Expansion(nxt.id, self.width)  # the rollout goes on (same iteration)
        self.backup(self._path, 0.0)
        return None
