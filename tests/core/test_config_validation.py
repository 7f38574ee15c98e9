"""``ExecutorConfig``, its speculation switches and lazy-verification settings reject values of
the wrong type with a ConfigError naming the field (never a bare TypeError)."""

from __future__ import annotations

from typing import Any

import pytest

from spec_tot.config import ExecutorConfig, LazyVerification, Speculation
from spec_tot.errors import ConfigError, UnknownNameError

CASES: list[tuple[dict[str, Any], str]] = [
    ({"seed": 1.5}, "seed"),
    ({"seed": "0"}, "seed"),
    ({"max_concurrency": True}, "max_concurrency"),
    ({"max_concurrency": 0}, "max_concurrency"),
    ({"max_concurrency": "4"}, "max_concurrency"),
    ({"query_timeout_s": "3"}, "query_timeout_s"),
    ({"query_timeout_s": float("nan")}, "query_timeout_s"),
    ({"query_timeout_s": 0}, "query_timeout_s"),
    ({"goodput_deadline_s": None}, "goodput_deadline_s"),
    ({"max_nodes": "10"}, "max_nodes"),
    ({"max_nodes": 1}, "max_nodes"),
    ({"speculation_overrides": ["ep"]}, "speculation_overrides"),
    ({"speculation_overrides": {"bogus": 1}}, "speculation.bogus"),
    ({"speculation_overrides": {"tau": 0}}, "speculation.tau"),
    ({"speculation_overrides": {"ep": 1}}, "speculation.ep"),
    ({"speculation_overrides": {"budget": "yes"}}, "speculation.budget"),
    ({"speculation_overrides": {"speculate": "some"}}, "speculation.speculate"),
    ({"speculation_overrides": {"max_spec_depth": 0}}, "speculation.max_spec_depth"),
    ({"speculation_overrides": {"max_spec_depth": 2.0}}, "speculation.max_spec_depth"),
    ({"speculation_overrides": {"et_min_answers": "4"}}, "speculation.et_min_answers"),
    ({"speculation_overrides": {"lv": 5}}, "speculation.lv"),
    ({"speculation_overrides": {"lv": {"bogus": 1}}}, "lv.bogus"),
    ({"speculation_overrides": {"lv": {"token_threshold": "1"}}}, "lv.token_threshold"),
    ({"speculation_overrides": {"lv": {"max_wait_s": -1}}}, "lv.max_wait_s"),
    ({"speculation_overrides": {"lv": {"idle_flush": "no"}}}, "lv.idle_flush"),
]


@pytest.mark.parametrize(("kwargs", "field"), CASES)
def test_bad_executor_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        ExecutorConfig(mode="full", **kwargs)
    assert info.value.field == field


def test_unknown_mode_lists_the_modes() -> None:
    with pytest.raises(UnknownNameError, match="dedup"):
        ExecutorConfig(mode=3)  # type: ignore[arg-type]


def test_switches_and_lv_settings_are_checked_on_their_own_too() -> None:
    with pytest.raises(ConfigError, match="dedup"):
        Speculation(dedup="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"lv\.spec_flush"):
        LazyVerification(spec_flush=0)
    good = ExecutorConfig(mode="full", speculation_overrides={"lv": {"max_wait_s": 0.1}})
    assert good.speculation.lv is not None and good.speculation.lv.max_wait_s == 0.1


@pytest.mark.parametrize(
    "override", [{"lv": "fast"}, {"lv": {"bogus": 1}}, {"tau": "1"}, {"et_alpha": float("nan")}]
)
def test_bad_switch_values_are_config_errors(override: dict) -> None:
    with pytest.raises(ConfigError):
        ExecutorConfig(mode="full", speculation_overrides=override)
