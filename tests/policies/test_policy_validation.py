"""Every constructor rejects a bad value with a ConfigError that names the field."""

from __future__ import annotations

from typing import Any

import pytest

from spec_tot.errors import ConfigError, UnknownNameError
from spec_tot.policies import POLICY_NAMES, create_policy

CASES: list[tuple[str, dict[str, Any], str]] = [
    ("best_of_n", {"n": 0}, "n"),
    ("best_of_n", {"vote": "mode"}, "vote"),
    ("best_of_n", {"aggregation": "mean"}, "aggregation"),
    ("best_of_n", {"max_depth": 0}, "max_depth"),
    ("beam", {"n": 0}, "n"),
    ("beam", {"width": 0}, "width"),
    ("beam", {"n": 2, "width": 4}, "width"),
    ("beam", {"width": 2.5}, "width"),
    ("beam", {"max_depth": -1}, "max_depth"),
    ("beam", {"aggregation": "avg"}, "aggregation"),
    ("beam", {"vote": ""}, "vote"),
    ("dvts", {"n": -3}, "n"),
    ("dvts", {"width": True}, "width"),
    ("dvts", {"n": 3, "width": 4}, "width"),
    ("rebase", {"width": 0}, "width"),
    ("rebase", {"temperature": 0.0}, "temperature"),
    ("rebase", {"temperature": float("inf")}, "temperature"),
    ("rebase", {"max_depth": 0}, "max_depth"),
    ("ets", {"width": 0}, "width"),
    ("ets", {"temperature": -1.0}, "temperature"),
    ("ets", {"lambda_cost": -0.1}, "lambda_cost"),
    ("ets", {"lambda_cover": float("nan")}, "lambda_cover"),
    ("ets", {"cluster_fn": 3}, "cluster_fn"),
    ("mcts", {"width": 0}, "width"),
    ("mcts", {"c": -1.0}, "c"),
    ("mcts", {"iterations": 0}, "iterations"),
    ("mcts", {"max_depth": 0}, "max_depth"),
    ("mcts", {"vote": "x"}, "vote"),
    ("rstar", {"c": float("nan")}, "c"),
    ("rstar", {"iterations": -1}, "iterations"),
    ("rest_mcts", {"alpha": 1.5}, "alpha"),
    ("rest_mcts", {"end_gate": float("inf")}, "end_gate"),
    ("rest_mcts", {"rollout_depth": -1}, "rollout_depth"),
    ("rest_mcts", {"rollout_depth": 1.0}, "rollout_depth"),
    ("rest_mcts", {"width": 0}, "width"),
    ("tot_bfs", {"breadth": 0}, "breadth"),
    ("tot_bfs", {"width": 0}, "width"),
    ("tot_bfs", {"max_depth": 0}, "max_depth"),
    ("tot_dfs", {"width": 0}, "width"),
    ("tot_dfs", {"threshold": float("nan")}, "threshold"),
    ("tot_dfs", {"max_backtracks": -1}, "max_backtracks"),
    ("tot_dfs", {"max_backtracks": 1.5}, "max_backtracks"),
    ("tot_dfs", {"max_depth": 0}, "max_depth"),
]


TYPES: list[tuple[str, dict[str, Any], str]] = [
    ("beam", {"n": "8"}, "n"),
    ("beam", {"vote": ["best"]}, "vote"),
    ("rebase", {"temperature": "hot"}, "temperature"),
    ("mcts", {"c": None}, "c"),
    ("rest_mcts", {"alpha": "0.5"}, "alpha"),
    ("tot_dfs", {"threshold": "high"}, "threshold"),
    ("best_of_n", {"aggregation": 1}, "aggregation"),
    ("beam", {"bogus": 1}, "bogus"),
    ("rstar", {"alpha": 0.5}, "alpha"),  # a REST-MCTS* parameter, not rStar's
]


@pytest.mark.parametrize(("name", "params", "field"), CASES + TYPES)
def test_bad_param_names_field(name: str, params: dict[str, Any], field: str) -> None:
    """A bad value, a wrong type or an unknown keyword: a ConfigError naming the parameter
    and the policy (never a bare TypeError)."""
    with pytest.raises(ConfigError) as info:
        create_policy(name, **params)
    assert info.value.field == field
    assert repr(name) in str(info.value)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_defaults_construct(name: str) -> None:
    policy = create_policy(name)
    assert policy.name == name
    assert policy.aggregation == "last"


def test_unknown_policy() -> None:
    with pytest.raises(UnknownNameError):
        create_policy("a_star")
