"""The statistics of ``spec-tot bench --rounds`` and the benchmark scripts: a seeded shuffled
schedule after a dropped warm-up, per-round ratios against a control, a bootstrap interval."""

from __future__ import annotations

import pytest

from spec_tot.errors import ConfigError
from spec_tot.rounds import (
    Run,
    bootstrap_interval,
    schedule_rounds,
    summarize_rounds,
    summary_line,
)


def test_schedule_has_a_warmup_then_every_cell_once_per_round_shuffled() -> None:
    cells = ["a", "b", "c", "d"]
    plan = schedule_rounds(cells, rounds=6, seed=1)
    assert plan[0] == (0, "a") and len(plan) == 1 + 6 * 4
    orders = [[c for r, c in plan if r == k] for k in range(1, 7)]
    assert all(sorted(o) == cells for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # shuffled per round
    assert schedule_rounds(cells, rounds=6, seed=1) == plan  # seeded
    assert schedule_rounds(cells, 2, 0, warmup=False)[0][0] == 1


@pytest.mark.parametrize(("cells", "rounds", "field"), [([], 2, "cells"), (["a", "a"], 2, "cells"),
                                                        (["a"], 0, "rounds")])  # fmt: skip
def test_schedule_refuses_bad_input(cells: list[str], rounds: int, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        schedule_rounds(cells, rounds)


def test_bootstrap_interval_holds_the_median_and_shrinks_to_a_constant() -> None:
    assert bootstrap_interval([2.0] * 5) == (2.0, 2.0)
    values = [0.9, 1.0, 1.1, 1.2, 1.3, 0.95, 1.05]
    lo, hi = bootstrap_interval(values, 0.9)
    assert lo <= 1.05 <= hi and lo < hi
    wide = bootstrap_interval(values, 0.99)
    assert wide[0] <= lo and hi <= wide[1]
    with pytest.raises(ConfigError, match="level"):
        bootstrap_interval(values, 1.0)
    with pytest.raises(ConfigError, match="values"):
        bootstrap_interval([])


def test_ratios_are_taken_within_a_round_and_the_warmup_is_dropped() -> None:
    def run(rnd: int, cell: str, qps: float, **more: int) -> Run:
        return Run(rnd, cell, {"queries_per_s": qps, "solved": 7, **more})

    runs = [
        run(0, "dedup", 100.0),  # warm-up: would skew everything
        run(1, "dedup", 10.0), run(1, "full", 20.0, speculative_nodes=5, speculative_hits=4),
        run(2, "full", 6.0, speculative_nodes=3, speculative_hits=1), run(2, "dedup", 4.0),
        run(3, "dedup", 8.0), run(3, "full", 10.0),
    ]  # fmt: skip
    cells = summarize_rounds(runs, lambda c: None if c == "dedup" else "dedup")
    full = cells["full"]
    assert full.ratios == (2.0, 1.5, 1.25) and full.ratio == 1.5
    assert full.interval is not None and full.interval[0] <= 1.5 <= full.interval[1]
    assert (full.launched, full.adopted, full.wasted) == (8, 5, 3)
    assert full.solved == (7,) and full.median == 10.0
    assert cells["dedup"].values == (10.0, 4.0, 8.0) and cells["dedup"].ratio is None
    assert summary_line(cells).startswith("dedup 8 queries/s; full 10 queries/s = 1.50x dedup [")


def test_a_round_missing_its_control_gives_no_ratio() -> None:
    runs = [Run(1, "full", {"queries_per_s": 2.0}), Run(2, "full", {"queries_per_s": 3.0}),
            Run(2, "dedup", {"queries_per_s": 1.5})]  # fmt: skip
    full = summarize_rounds(runs, lambda c: "dedup")["full"]
    assert full.ratios == (2.0,)
