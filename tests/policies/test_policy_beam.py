"""Beam search and DVTS (and the round policies' shared prediction) against hand-computed
selections."""

from __future__ import annotations

import pytest
from policy_harness import Outcome, drive, table

from spec_tot.policies.base import Expansion
from spec_tot.policies.beam import BeamSearch
from spec_tot.policies.breadth import BreadthPolicy
from spec_tot.policies.dvts import DVTS
from spec_tot.policies.tot_bfs import ToTBFS
from spec_tot.tree import NodeStatus, SearchTree


def test_beam_keeps_top_n_over_width_and_stops_at_n_completed() -> None:
    # n=4, width=2 -> keep 2 per round. Root round: [.5, .9, .5, .7] -> q/1, q/3.
    # Round 2: q/1/0 T.8, q/1/1 .3, q/3/0 .6, q/3/1 T.95 -> 2 completed; keep q/3/0, q/1/1
    # (by score). Round 3: all four children terminal -> 6 completed >= 4 -> stop.
    outcomes = table(
        {
            "q/0": 0.5,
            "q/1": 0.9,
            "q/2": 0.5,
            "q/3": 0.7,
            "q/1/0": Outcome(0.8, True, "a"),
            "q/1/1": 0.3,
            "q/3/0": 0.6,
            "q/3/1": Outcome(0.95, True, "b"),
        },
        default=Outcome(0.1, True, "c"),
    )
    policy = BeamSearch(n=4, width=2)
    run = drive(policy, outcomes, chunk=1)
    assert run.batches[0] == [Expansion("q", 4)]
    nonempty = [b for b in run.batches if b]
    assert nonempty[1] == [Expansion("q/1", 2), Expansion("q/3", 2)]
    assert nonempty[2] == [Expansion("q/3/0", 2), Expansion("q/1/1", 2)]
    assert len(nonempty) == 3
    assert policy.keep_count(run.tree) == 2
    ans = policy.answer(run.tree)
    assert ans is not None and ans.text == "b" and ans.node_id == "q/3/1"


def test_beam_ties_go_to_lower_seq() -> None:
    policy = BeamSearch(n=4, width=2, max_depth=1)
    tree_run = drive(policy, table({"q/0": 0.9, "q/1": 0.5, "q/2": 0.9, "q/3": 0.9}))
    # max_depth=1: depth-1 nodes cannot be expanded -> nothing kept, done, no answer.
    assert tree_run.expansions == [Expansion("q", 4)]
    assert policy.answer(tree_run.tree) is None
    policy = BeamSearch(n=4, width=2, max_depth=2)
    run = drive(policy, table({"q/0": 0.9, "q/1": 0.5, "q/2": 0.9, "q/3": 0.9}))
    assert run.expansions[1:3] == [Expansion("q/0", 2), Expansion("q/2", 2)]


def test_beam_predict_ranks_scored_children_of_open_round() -> None:
    policy = BeamSearch(n=4, width=2)
    tree = SearchTree("q", "?")
    policy.initial(tree)
    kids = [tree.add_child(tree.root) for _ in range(4)]
    for kid, r in zip(kids[:3], [0.2, 0.8, 0.5], strict=True):
        kid.status, kid.reward = NodeStatus.SCORED, r
    assert policy.on_reward(tree, kids[:3]) == []
    before = len(tree)
    cands = policy.predict(tree, 3)
    assert len(tree) == before
    assert [(c.parent_id, c.width, c.utility) for c in cands] == [("q/1", 2, 1.0), ("q/2", 1, 0.5)]


@pytest.mark.parametrize(
    "policy",
    [BeamSearch(n=2, width=2), ToTBFS(breadth=1, width=2), DVTS(n=2, width=2)],
    ids=["beam", "tot_bfs", "dvts"],
)
def test_round_policies_predict_past_one_level(policy: BreadthPolicy) -> None:
    # The open round: q/0 (.2) received, q/1 (.8) scored but not yet received. q/1 is the
    # one selected, but it already has its two speculative children, generated with a
    # provisional reward and not scored: the chain goes on to select among them, as the
    # predictive view treats a known node as seen (a filter on SCORED stopped it here).
    tree = SearchTree("q", "?")
    policy.initial(tree)
    kids = [tree.add_child(tree.root) for _ in range(2)]
    for kid, r in zip(kids, [0.2, 0.8], strict=True):
        kid.status, kid.reward = NodeStatus.SCORED, r
    kids[1].walk_version = 1
    assert policy.on_reward(tree, kids[:1]) == []
    for _ in range(2):
        grandchild = tree.add_child(kids[1], speculative=True)
        grandchild.walk_version, grandchild.provisional = 1, 0.5
    cands = policy.predict(tree, 4)
    assert [(c.parent_id, c.width) for c in cands] == [("q/1/0", 2)]


def test_dvts_greedy_per_subtree() -> None:
    # n=4, width=2 -> subtrees {q/0, q/1} and {q/2, q/3}.
    # Round 1: subtree 0 best q/1 (.7) -> expand; subtree 1 best q/3 (.95) -> expand
    # (q/2 is terminal but worse). Round 2: subtree 0: q/1/1 (.9) beats terminal q/1/0 (.8)
    # -> expand; subtree 1: best is terminal q/3/0 (.99) -> subtree complete.
    # Round 3: q/1/1/* terminal -> subtree 0 complete -> done.
    outcomes = table(
        {
            "q/0": 0.2,
            "q/1": 0.7,
            "q/2": Outcome(0.9, True, "x"),
            "q/3": 0.95,
            "q/1/0": Outcome(0.8, True, "y"),
            "q/1/1": 0.9,
            "q/3/0": Outcome(0.99, True, "z"),
            "q/3/1": 0.1,
        },
        default=Outcome(0.3, True, "w"),
    )
    policy = DVTS(n=4, width=2)
    run = drive(policy, outcomes, seed=3, chunk=1)
    assert [b for b in run.batches if b] == [
        [Expansion("q", 4)],
        [Expansion("q/1", 2), Expansion("q/3", 2)],
        [Expansion("q/1/1", 2)],
    ]
    assert policy.subtree_of(run.tree["q/3/0"]) == 1
    assert policy.keep_count(run.tree) is None
    ans = policy.answer(run.tree)
    assert ans is not None and ans.text == "z"


def test_dvts_subtree_with_all_children_failed_ends() -> None:
    outcomes = table({"q/0": Outcome(None, failed=True), "q/1": Outcome(None, failed=True)})
    policy = DVTS(n=4, width=2, max_depth=2)
    run = drive(policy, outcomes)
    assert [b for b in run.batches if b][1] == [Expansion("q/2", 2)]
