"""ToT BFS/DFS and best-of-N against hand-computed cases."""

from __future__ import annotations

from policy_harness import Outcome, drive, table

from spec_tot.policies.base import Expansion
from spec_tot.policies.best_of_n import BestOfN
from spec_tot.policies.tot_bfs import ToTBFS
from spec_tot.policies.tot_dfs import ToTDFS


def test_tot_bfs_keeps_breadth_best_per_level() -> None:
    # breadth 2, width 3. Level 1: [.5, .9, .7] -> q/1, q/2. Level 2 (6 states): q/1/0 T.99
    # and q/2/1 .8 are the best two: only q/2/1 is expanded. Level 3 at max_depth: stop.
    outcomes = table(
        {"q/0": 0.5, "q/1": 0.9, "q/2": 0.7, "q/1/0": Outcome(0.99, True, "24"), "q/2/1": 0.8},
        default=Outcome(0.1),
    )
    policy = ToTBFS(breadth=2, width=3, max_depth=3)
    run = drive(policy, outcomes, seed=7, chunk=2)
    assert [b for b in run.batches if b] == [
        [Expansion("q", 3)],
        [Expansion("q/1", 3), Expansion("q/2", 3)],
        [Expansion("q/2/1", 3)],
    ]
    assert policy.keep_count(run.tree) == 2
    ans = policy.answer(run.tree)
    assert ans is not None and ans.text == "24"


def test_tot_dfs_backtracks_then_finds() -> None:
    # root -> q/0 .7, q/1 .6 -> descend q/0 -> .3, .4 (below .5) -> backtrack -> q/1 ->
    # q/1/0 terminal .8 >= .5 -> found.
    outcomes = table(
        {"q/0": 0.7, "q/1": 0.6, "q/0/0": 0.3, "q/0/1": 0.4, "q/1/0": Outcome(0.8, True, "x")}
    )
    policy = ToTDFS(width=2, threshold=0.5, max_depth=4)
    run = drive(policy, outcomes)
    assert run.expansions == [Expansion("q", 2), Expansion("q/0", 2), Expansion("q/1", 2)]
    assert policy.backtracks == 1
    ans = policy.answer(run.tree)
    assert ans is not None and ans.node_id == "q/1/0"
    policy = ToTDFS(width=2, threshold=0.5, max_depth=4, max_backtracks=0)
    run = drive(policy, outcomes)
    assert run.expansions == [Expansion("q", 2), Expansion("q/0", 2)]
    assert policy.answer(run.tree) is None


def test_tot_dfs_low_terminal_is_not_accepted_but_is_fallback() -> None:
    outcomes = table({"q/0": Outcome(0.2, True, "low")}, default=Outcome(0.1))
    policy = ToTDFS(width=1, threshold=0.5)
    run = drive(policy, outcomes)
    assert policy.found is None and run.expansions == [Expansion("q", 1)]
    ans = policy.answer(run.tree)
    assert ans is not None and ans.text == "low"


def test_best_of_n_votes() -> None:
    # Traces: q/0 -> q/0/0 T.95 "4"; q/1 T.4 "5"; q/2 -> q/2/0 -> q/2/0/0 T.5 "5".
    outcomes = table(
        {
            "q/0": 0.3,
            "q/0/0": Outcome(0.95, True, "4"),
            "q/1": Outcome(0.4, True, "5"),
            "q/2": 0.2,
            "q/2/0": 0.2,
            "q/2/0/0": Outcome(0.5, True, "5"),
        }
    )
    answers = {}
    for vote in ("majority", "weighted", "best"):
        policy = BestOfN(n=3, vote=vote)
        run = drive(policy, outcomes, seed=5, chunk=1)
        assert sorted(e.parent_id for e in run.expansions) == ["q", "q/0", "q/2", "q/2/0"]
        assert all(e.width == 1 for e in run.expansions[1:])
        ans = policy.answer(run.tree)
        assert ans is not None
        answers[vote] = ans.text
    # majority: "5" 2 votes; weighted: "4" .95 > "5" .9; best: "4" (.95).
    assert answers == {"majority": "5", "weighted": "4", "best": "4"}


def test_best_of_n_failed_and_depth_limited_traces_end() -> None:
    outcomes = table({"q/0": Outcome(None, failed=True)}, default=Outcome(0.3))
    policy = BestOfN(n=2, max_depth=3)
    run = drive(policy, outcomes)
    assert [e.parent_id for e in run.expansions] == ["q", "q/1", "q/1/0"]
    assert policy.answer(run.tree) is None
