"""A tiny stand-in for the executor, to drive a search policy against a ``SearchTree``.

For every ``Expansion`` it creates ``width`` children (status RUNNING) at once; it then
resolves the in-flight children in chunks, in FIFO or random order, from an outcome function
(reward, terminal flag, answer, or failure), and feeds each chunk to ``on_reward``. Contract
checks run on the way: expansions only of SCORED, non-terminal, never-expanded nodes, width
>= 1; ``predict`` within budget and side-effect free; ``done()`` at the end.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from spec_tot.policies.base import Expansion, SearchPolicy
from spec_tot.tree import Node, NodeStatus, SearchTree, aggregate_scores

__all__ = ["Outcome", "Run", "drive", "fingerprint", "random_outcomes", "table"]


@dataclass(frozen=True)
class Outcome:
    reward: float | None = 0.0
    terminal: bool = False
    answer: str | None = None
    failed: bool = False  # the child arrives CANCELLED, without a reward
    text: str | None = None  # defaults to the node id (every text its own ETS cluster)


OutcomeFn = Callable[[Node], Outcome]


def table(outcomes: Mapping[str, Outcome | float], default: Outcome | None = None) -> OutcomeFn:
    """Outcomes by node id; a bare float is a non-terminal reward."""
    fallback = default or Outcome(0.0)

    def fn(node: Node) -> Outcome:
        got = outcomes.get(node.id, fallback)
        return Outcome(float(got)) if isinstance(got, int | float) else got

    return fn


def random_outcomes(seed: int, p_terminal: float, p_fail: float) -> OutcomeFn:
    """A reproducible random outcome per node id."""

    def fn(node: Node) -> Outcome:
        rng = random.Random(f"{seed}:{node.id}")
        if rng.random() < p_fail:
            return Outcome(None, failed=True)
        terminal = rng.random() < p_terminal
        reward = round(rng.random(), 3)
        return Outcome(reward, terminal, str(rng.randrange(3)) if terminal else None)

    return fn


@dataclass
class Run:
    tree: SearchTree
    batches: list[list[Expansion]] = field(default_factory=list)  # one per policy call
    calls: int = 0
    max_outstanding: int = 0  # most expansions with unresolved children at one time

    @property
    def expansions(self) -> list[Expansion]:
        return [e for batch in self.batches for e in batch]


def fingerprint(tree: SearchTree) -> list[tuple[object, ...]]:
    return [
        (n.id, n.status, n.reward, n.visits, n.value_sum, n.terminal, len(n.children))
        for n in tree.nodes()
    ]


def _resolve(node: Node, outcome: Outcome, policy: SearchPolicy) -> None:
    node.text = outcome.text if outcome.text is not None else node.id
    if outcome.failed or outcome.reward is None:
        node.status = NodeStatus.CANCELLED
        return
    node.step_scores = (outcome.reward,)
    node.reward = aggregate_scores(node.step_scores, policy.aggregation)
    node.terminal = outcome.terminal
    node.answer = outcome.answer
    node.status = NodeStatus.SCORED


def drive(
    policy: SearchPolicy,
    outcome: OutcomeFn,
    *,
    seed: int | None = None,
    chunk: int = 0,
    predict_budget: int = 0,
    max_calls: int = 10_000,
) -> Run:
    """Run the search to the end. ``chunk`` = children per ``on_reward`` call (0: every
    child of the oldest expansion at once); ``seed`` picks children in random order;
    ``predict_budget`` > 0 checks ``predict`` before every delivery."""
    tree = SearchTree("q", "question")
    run = Run(tree)
    rng = random.Random(seed) if seed is not None else None
    inflight: list[Node] = []

    def accept(batch: list[Expansion]) -> None:
        run.batches.append(batch)
        for exp in batch:
            parent = tree[exp.parent_id]
            assert exp.width >= 1, exp
            assert parent.status is NodeStatus.SCORED, (exp, parent.status)
            assert not parent.terminal, f"expanded terminal node {parent.id}"
            assert not parent.children, f"expanded {parent.id} twice"
            for _ in range(exp.width):
                child = tree.add_child(parent)
                child.status = NodeStatus.RUNNING
                inflight.append(child)
        parents = {c.parent.id for c in inflight if c.parent is not None}
        run.max_outstanding = max(run.max_outstanding, len(parents))

    accept(policy.initial(tree))
    while inflight:
        run.calls += 1
        assert run.calls <= max_calls, "search did not terminate"
        assert not policy.done(tree) or not inflight
        if predict_budget:
            _check_predict(policy, tree, predict_budget)
        if rng is not None:
            rng.shuffle(inflight)
        size = chunk or sum(1 for c in inflight if c.parent is inflight[0].parent)
        batch, inflight[:size] = inflight[:size], []
        for node in batch:
            _resolve(node, outcome(node), policy)
        accept(policy.on_reward(tree, batch))
    assert policy.done(tree), "nothing in flight but the policy is not done"
    return run


def _check_predict(policy: SearchPolicy, tree: SearchTree, budget: int) -> None:
    before = fingerprint(tree)
    cands = policy.predict(tree, budget)
    assert fingerprint(tree) == before, "predict mutated the tree"
    assert sum(c.width for c in cands) <= budget
    assert len({c.parent_id for c in cands}) == len(cands), "duplicate candidate"
    for cand in cands:
        node = tree[cand.parent_id]
        assert cand.width >= 1
        assert node.status is NodeStatus.SCORED and not node.terminal and not node.children
