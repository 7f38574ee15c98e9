"""REBASE allocation and ETS selection against hand-computed cases."""

from __future__ import annotations

import math

import pytest
from policy_harness import Outcome, drive, table

from spec_tot.policies.base import Expansion
from spec_tot.policies.ets import ETS, default_cluster, solve_keep
from spec_tot.policies.rebase import Rebase
from spec_tot.tree import Node, NodeStatus, SearchTree

# With T = 0.2 / ln 2, rewards .6/.4/.2 give softmax weights 4:2:1 = [4/7, 2/7, 1/7].
T = 0.2 / math.log(2)


def test_rebase_allocation_by_hand() -> None:
    # Root width 4 -> q/0 .6, q/1 .4, q/2 .2, q/3 terminal .9 (1 completed) -> W = 3.
    # 3 * [4/7, 2/7, 1/7] = [1.714, 0.857, 0.429] -> floors [1, 0, 0], 2 units left, to the
    # largest remainders .857 (q/1) and .714 (q/0) -> [2, 1, 0]: q/2 is dropped.
    # Round 2: the 3 children: q/0/0 terminal, q/0/1 .5, q/1/0 terminal -> W = 4 - 3 = 1;
    # the single candidate q/0/1 takes it. Round 3: terminal -> W = 0 -> stop.
    outcomes = table(
        {
            "q/0": 0.6,
            "q/1": 0.4,
            "q/2": 0.2,
            "q/3": Outcome(0.9, True, "7"),
            "q/0/0": Outcome(0.8, True, "7"),
            "q/0/1": 0.5,
            "q/1/0": Outcome(0.85, True, "8"),
        },
        default=Outcome(0.3, True, "8"),
    )
    policy = Rebase(width=4, temperature=T)
    run = drive(policy, outcomes, seed=1, chunk=2)
    assert [b for b in run.batches if b] == [
        [Expansion("q", 4)],
        [Expansion("q/0", 2), Expansion("q/1", 1)],
        [Expansion("q/0/1", 1)],
    ]
    assert policy.completed == 4 and policy.done(run.tree)
    ans = policy.answer(run.tree)  # weighted: "7" .9+.8 = 1.7 vs "8" .85+.3 = 1.15
    assert ans is not None and ans.text == "7"
    assert ans.votes["8"] == 1.15


def test_rebase_allocation_all_nonterminal() -> None:
    # q/3..q/6 fail (never selected); W = 7 over [4/7, 2/7, 1/7] is exact: [4, 2, 1].
    policy = Rebase(width=7, temperature=T, max_depth=2)
    fail = Outcome(None, failed=True)
    run = drive(policy, table({"q/0": 0.6, "q/1": 0.4, "q/2": 0.2}, default=fail))
    assert run.batches[1] == [Expansion("q/0", 4), Expansion("q/1", 2), Expansion("q/2", 1)]


def _half_scored_round(failed_rest: bool) -> tuple[SearchTree, Rebase]:
    tree = SearchTree("q", "?")
    policy = Rebase(width=4, temperature=T)
    policy.initial(tree)
    kids = [tree.add_child(tree.root) for _ in range(4)]
    for kid, r in zip(kids[:2], [0.6, 0.4], strict=True):
        kid.status, kid.reward = NodeStatus.SCORED, r
    if failed_rest:
        for kid in kids[2:]:
            kid.status = NodeStatus.CANCELLED
    policy.on_reward(tree, kids[:2])  # the round stays open
    return tree, policy


def test_rebase_predict_uses_softmax_share() -> None:
    # The other two failed: over the scored round, [2/3, 1/3] * 4 = [2.67, 1.33] -> [3, 1].
    tree, policy = _half_scored_round(failed_rest=True)
    cands = policy.predict(tree, 10)
    assert [(c.parent_id, c.width) for c in cands] == [("q/0", 3), ("q/1", 1)]
    assert [c.utility for c in cands] == pytest.approx([2 / 3, 1 / 3])
    assert [(c.parent_id, c.width) for c in policy.predict(tree, 2)] == [("q/0", 2)]
    assert policy.keep_count(tree) is None


def test_rebase_predict_ranks_the_whole_round() -> None:
    # q/2 and q/3 still generating stand in at the known mean 0.5: the softmax over
    # [0.6, 0.5, 0.5, 0.4] allocates [1, 1, 1, 1], so q/0 is predicted its real-round width
    # (1), not 3 of the 4 as if the round were the two nodes known so far.
    tree, policy = _half_scored_round(failed_rest=False)
    cands = policy.predict(tree, 10)
    assert [(c.parent_id, c.width) for c in cands] == [("q/0", 1), ("q/1", 1)]
    assert cands[0].utility > cands[1].utility


def _ets_tree() -> tuple[SearchTree, list[Node]]:
    # root -> A -> {A1 "x", A2 " X "}; root -> B -> {B1 "y"}: A1 and A2 share cluster "x".
    tree = SearchTree("q", "?")
    a, b = tree.add_child(tree.root), tree.add_child(tree.root)
    a1, a2, b1 = tree.add_child(a), tree.add_child(a), tree.add_child(b)
    for node, text in ((a, "a"), (b, "b"), (a1, "x"), (a2, " X "), (b1, "y")):
        node.text, node.status = text, NodeStatus.SCORED
    return tree, [a1, a2, b1]


def test_ets_milp_by_hand() -> None:
    _, cands = _ets_tree()
    w = [0.5, 0.3, 0.2]
    # Objective = sum o - l_cost * |path nodes| + l_cover * |clusters|:
    # l_cost .15, l_cover .05: {A1}=.5-.30+.05=.25, {A1,A2}=.8-.45+.05=.40,
    # {A1,B1}=.7-.60+.10=.20, {A1,A2,B1}=1-.75+.10=.35 -> keep {A1, A2}.
    assert solve_keep(cands, w, 0.15, 0.05, default_cluster) == [True, True, False]
    # l_cover .2: {A1,A2}=.8-.45+.2=.55, all=1-.75+.4=.65, {A1,B1}=.7-.6+.4=.5 -> all.
    assert solve_keep(cands, w, 0.15, 0.2, default_cluster) == [True, True, True]
    # l_cost 1: every node costs more than any weight; at least one is kept: the best, A1.
    assert solve_keep(cands, w, 1.0, 0.0, default_cluster) == [True, False, False]
    # No costs: keep everything.
    assert solve_keep(cands, w, 0.0, 0.0, default_cluster) == [True, True, True]


def test_ets_end_to_end_ties_and_reallocation() -> None:
    # Three equal depth-1 candidates, o = 1/3 each, one path node each. l_cost .4 > 1/3: every
    # kept node loses .067, so only one is kept (>= 1), the lowest seq (q/0), and it gets
    # the whole budget W = 3.
    policy = ETS(width=3, lambda_cost=0.4, lambda_cover=0.0, max_depth=2)
    run = drive(policy, table({}, default=Outcome(0.5)))
    assert run.batches[1] == [Expansion("q/0", 3)]
    # l_cost .2 < 1/3: all kept; equal shares -> [1, 1, 1].
    policy = ETS(width=3, lambda_cost=0.2, lambda_cover=0.0, max_depth=2)
    run = drive(policy, table({}, default=Outcome(0.5)))
    assert run.batches[1] == [Expansion("q/0", 1), Expansion("q/1", 1), Expansion("q/2", 1)]


def test_ets_custom_cluster_fn_rewards_coverage() -> None:
    # Candidates q/0 (.6) and q/1 (.4) at T: o = [2/3, 1/3]. l_cost .4: q/1 alone is worth
    # 1/3 - .4 < 0, unless it covers a new cluster worth .2: 1/3 - .4 + .2 > 0 -> kept.
    def by_id(node: Node) -> str:
        return node.id

    outcomes = table({"q/0": 0.6, "q/1": 0.4}, default=Outcome(0.0))
    same = ETS(
        width=2,
        temperature=T,
        lambda_cost=0.4,
        lambda_cover=0.2,
        max_depth=2,
        cluster_fn=lambda n: "one",
    )
    assert drive(same, outcomes).batches[1] == [Expansion("q/0", 2)]
    split = ETS(
        width=2, temperature=T, lambda_cost=0.4, lambda_cover=0.2, max_depth=2, cluster_fn=by_id
    )
    # Both kept; re-allocation of W=2 over [2/3, 1/3] -> [1.33, .67] -> [1, 1].
    assert drive(split, outcomes).batches[1] == [Expansion("q/0", 1), Expansion("q/1", 1)]
