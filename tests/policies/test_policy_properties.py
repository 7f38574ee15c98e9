"""Property tests: over random rewards, terminal flags, failures and delivery orders, every
policy keeps the contract (the harness asserts it on every step) and its own width budget."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from policy_harness import drive, random_outcomes

from spec_tot.policies import create_policy
from spec_tot.tree import NodeStatus

PARAMS: dict[str, dict[str, Any]] = {
    "best_of_n": {"n": 4, "max_depth": 5},
    "beam": {"n": 4, "width": 2, "max_depth": 5},
    "dvts": {"n": 4, "width": 2, "max_depth": 5},
    "rebase": {"width": 6, "max_depth": 5},
    "ets": {"width": 5, "max_depth": 4},
    "mcts": {"width": 3, "iterations": 8, "max_depth": 5},
    "rstar": {"width": 2, "iterations": 6, "max_depth": 5},
    "rest_mcts": {"width": 2, "iterations": 6, "max_depth": 5},
    "tot_bfs": {"breadth": 2, "width": 3, "max_depth": 4},
    "tot_dfs": {"width": 3, "threshold": 0.4, "max_depth": 4},
}

runs = st.fixed_dictionaries(
    {
        "name": st.sampled_from(sorted(PARAMS)),
        "seed": st.integers(0, 10_000),
        "p_terminal": st.sampled_from([0.0, 0.2, 0.5]),
        "p_fail": st.sampled_from([0.0, 0.2, 0.6]),
        "order": st.one_of(st.none(), st.integers(0, 100)),
        "chunk": st.integers(0, 3),
        "budget": st.integers(1, 6),
    }
)


@settings(max_examples=120, deadline=None)
@given(runs)
def test_policies_keep_the_contract(r: dict[str, Any]) -> None:
    params = PARAMS[r["name"]]
    policy = create_policy(r["name"], **params)
    outcome = random_outcomes(r["seed"], r["p_terminal"], r["p_fail"])
    run = drive(policy, outcome, seed=r["order"], chunk=r["chunk"], predict_budget=r["budget"])
    tree = run.tree
    max_depth = params["max_depth"]
    for exp in run.expansions:
        assert tree[exp.parent_id].depth < max_depth
    # Each policy's own budget.
    name = r["name"]
    if name == "best_of_n":
        assert all(e.width == 1 for e in run.expansions[1:])
    elif name in ("beam", "dvts"):
        for batch in run.batches:
            assert sum(e.width for e in batch) <= params["n"]
        assert all(e.width == params["width"] for e in run.expansions[1:])
    elif name in ("rebase", "ets"):
        for batch in run.batches:
            assert sum(e.width for e in batch) <= params["width"]
    elif name == "tot_bfs":
        assert all(len(b) <= params["breadth"] for b in run.batches[1:])
    else:  # MCTS family and DFS: one expansion at a time, fixed width
        assert run.max_outstanding <= 1
        assert all(e.width == params["width"] for e in run.expansions)
    if name in ("mcts", "rstar", "rest_mcts"):
        assert policy.iterations_run <= params["iterations"]  # type: ignore[attr-defined]
    ans = policy.answer(tree)
    if ans is not None and ans.node_id is not None:
        node = tree[ans.node_id]
        assert node.terminal and node.status is NodeStatus.SCORED
    elif not tree.terminals():
        assert ans is None


@settings(max_examples=40, deadline=None)
@given(runs)
def test_predict_does_not_change_the_search(r: dict[str, Any]) -> None:
    """Calling predict at every step leaves the committed expansions unchanged."""
    outcome = random_outcomes(r["seed"], r["p_terminal"], r["p_fail"])
    plain = drive(create_policy(r["name"], **PARAMS[r["name"]]), outcome, chunk=r["chunk"])
    probed = drive(
        create_policy(r["name"], **PARAMS[r["name"]]),
        outcome,
        chunk=r["chunk"],
        predict_budget=r["budget"],
    )
    assert plain.expansions == probed.expansions
    assert plain.tree.to_dict() == probed.tree.to_dict()
