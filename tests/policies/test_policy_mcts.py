"""UCT, rStar and REST-MCTS* selections and backups against hand-computed cases."""

from __future__ import annotations

import math

import pytest
from policy_harness import Outcome, drive, fingerprint, table

from spec_tot.policies.base import Expansion
from spec_tot.policies.mcts import MCTS, RStarMCTS
from spec_tot.policies.rest_mcts import RestMCTS
from spec_tot.tree import NodeStatus, SearchTree


def test_uct_picks_by_hand() -> None:
    # Iter 1 expands the root: q/0 .2, q/1 .6; each child 1 visit; root N=2, sum .8.
    # Iter 2: UCT q/0 = .2 + sqrt(ln 2) = 1.033, q/1 = .6 + sqrt(ln 2) = 1.433 -> q/1.
    #   Children .9 and .1: q/1 N=3 sum 1.6 (q .533), root N=4 sum 1.8.
    # Iter 3: q/0 = .2 + sqrt(ln 4 / 1) = 1.377, q/1 = .533 + sqrt(ln 4 / 3) = 1.213 -> q/0.
    outcomes = table({"q/0": 0.2, "q/1": 0.6, "q/1/0": 0.9, "q/1/1": 0.1})
    policy = MCTS(width=2, c=1.0, iterations=3)
    run = drive(policy, outcomes)
    assert run.expansions == [Expansion("q", 2), Expansion("q/1", 2), Expansion("q/0", 2)]
    tree = run.tree
    assert (tree["q/1"].visits, tree["q/1"].value_sum) == (3, pytest.approx(1.6))
    assert tree.root.visits == 6  # + the two children of q/0 in iteration 3
    assert run.max_outstanding == 1  # one selection at a time


def test_mcts_dead_end_terminal_and_answer() -> None:
    # Root children: q/0 terminal .9 "a", q/1 .1. Iter 2 picks by UCT with c=0:
    # q/0 (.9) is terminal -> dead end backs up .9; iter 3 the same; no more expansions.
    outcomes = table({"q/0": Outcome(0.9, True, "a"), "q/1": 0.1})
    policy = MCTS(width=2, c=0.0, iterations=3)
    run = drive(policy, outcomes)
    assert run.expansions == [Expansion("q", 2)]
    assert run.tree["q/0"].visits == 3 and run.tree["q/0"].value == pytest.approx(0.9)
    ans = policy.answer(run.tree)
    assert ans is not None and ans.text == "a"


def test_rstar_backs_up_terminal_rewards_only() -> None:
    # Iter 1: root -> q/0 .3, q/1 .7 (not backed up); rollout goes on into the best unvisited,
    # q/1 -> q/1/0 terminal .8, q/1/1 .9 -> q/1/1 (best) -> q/1/1/0 T.4, q/1/1/1 T.6 -> the
    # terminal q/1/1/1 ends the rollout: root, q/1, q/1/1, q/1/1/1 get N=1, Q=.6.
    # Iter 2: q/0 is unvisited -> first -> expanded.
    outcomes = table(
        {
            "q/0": 0.3,
            "q/1": 0.7,
            "q/1/0": Outcome(0.8, True, "8"),
            "q/1/1": 0.9,
            "q/1/1/0": Outcome(0.4, True, "4"),
            "q/1/1/1": Outcome(0.6, True, "6"),
        },
        default=Outcome(0.5, True, "5"),
    )
    policy = RStarMCTS(width=2, iterations=2)
    run = drive(policy, outcomes)
    assert run.expansions == [
        Expansion("q", 2),
        Expansion("q/1", 2),
        Expansion("q/1/1", 2),
        Expansion("q/0", 2),
    ]
    tree = run.tree
    for node_id in ("q/1", "q/1/1", "q/1/1/1"):
        assert (tree[node_id].visits, tree[node_id].value_sum) == (1, pytest.approx(0.6))
    assert tree["q/1/0"].visits == 0 and tree["q/1/1/0"].visits == 0  # not backed up
    # Iter 2: q/0 -> children terminal .5 -> rollout picks q/0/0 (seq tie), backs up .5.
    assert tree["q/0"].visits == 1 and tree.root.visits == 2
    assert tree.root.value_sum == pytest.approx(1.1)
    ans = policy.answer(tree)  # majority: "5" has 2 votes
    assert ans is not None and ans.text == "5"


def test_rstar_selection_formula() -> None:
    policy = RStarMCTS(c=2.0)
    tree = SearchTree("q", "?")
    a = tree.add_child(tree.root)
    tree.root.visits, a.visits, a.value_sum = 4, 2, 1.0
    assert policy.uct(tree.root, a) == pytest.approx(0.5 + 2 * math.sqrt(math.log(4) / 2))


def test_rest_mcts_rollout_alpha_and_weighted_backup() -> None:
    # Iter 1: root -> q/0 .4, q/1 .6; roll node q/1 (unvisited, higher V); 1 rollout step:
    #   q/1 -> q/1/0 .8, q/1/1 .5 -> r = .8; V(q/1) = .5*.6 + .5*.8 = .7, n=1; root n=1, V=.7.
    # Iter 2: q/0 unvisited -> expanded: q/0/0 T.95, q/0/1 .3 -> roll q/0/0 (terminal, so
    #   r = V = .95, unchanged, n=1); backup q/0: n=1, V=.95; root: n=2, V=(.95+.7)/2=.825.
    # .95 >= end_gate .9 -> stop with q/0/0.
    outcomes = table(
        {
            "q/0": 0.4,
            "q/1": 0.6,
            "q/1/0": 0.8,
            "q/1/1": 0.5,
            "q/0/0": Outcome(0.95, True, "42"),
            "q/0/1": 0.3,
        }
    )
    policy = RestMCTS(width=2, alpha=0.5, end_gate=0.9, rollout_depth=1)
    run = drive(policy, outcomes)
    assert run.expansions == [Expansion("q", 2), Expansion("q/1", 2), Expansion("q/0", 2)]
    tree = run.tree
    assert policy.q(tree["q/1"]) == pytest.approx(0.7) and tree["q/1"].visits == 1
    assert policy.q(tree["q/0"]) == pytest.approx(0.95)
    assert tree.root.visits == 2 and policy.q(tree.root) == pytest.approx(0.825)
    ans = policy.answer(tree)
    assert ans is not None and ans.node_id == "q/0/0" and ans.text == "42"
    assert policy.iterations_run == 2


def test_rest_mcts_uct_has_factor_two() -> None:
    policy = RestMCTS(c=0.5)
    tree = SearchTree("q", "?")
    a = tree.add_child(tree.root)
    tree.root.visits, a.visits, a.value_sum = 3, 1, 0.4
    assert policy.uct(tree.root, a) == pytest.approx(0.4 + 0.5 * math.sqrt(2 * math.log(3)))


def test_mcts_predict_simulates_with_a_visit_at_the_predicted_value() -> None:
    # After iter 1 (root -> q/0 .2, q/1 .6) and iter 2 in flight on q/1, the copy of the UCT
    # choice skips q/1 (running) and picks q/0; with budget 4 and width 2 that is all: q/1's
    # children are not scored and q/0 cannot be picked twice.
    tree = SearchTree("q", "?")
    policy = MCTS(width=2, c=1.0, iterations=5)
    (exp,) = policy.initial(tree)
    kids = [tree.add_child(tree.root) for _ in range(2)]
    for kid, r in zip(kids, [0.2, 0.6], strict=True):
        kid.status, kid.reward = NodeStatus.SCORED, r
    assert policy.on_reward(tree, kids) == [Expansion("q/1", 2)]
    for _ in range(2):
        tree.add_child(tree["q/1"]).status = NodeStatus.RUNNING
    before = fingerprint(tree)
    cands = policy.predict(tree, 4)
    assert fingerprint(tree) == before
    assert [(c.parent_id, c.width) for c in cands] == [("q/0", 2)]
    assert math.isfinite(cands[0].utility)
    assert policy.predict(tree, 1)[0].width == 1
    assert exp == Expansion("q", 2)
