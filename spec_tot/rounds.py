"""Honest ratios from interleaved rounds: the one statistics home of ``spec-tot bench``
and of the scripts in ``benchmarks/``.

A single run on a shared machine moves 0.5x-5x, so a speedup counts only as a ratio taken
within a round against a named control, over several rounds: every round runs every
variant once, in an order shuffled per round (seeded), after one warm-up run that is
dropped (imports, calibration, the page cache). Each variant's ratio to its control is
taken per round, and reported as the median with a bootstrap interval (90% unless asked).

    plan = schedule_rounds(["dedup@32", "full@32"], rounds=5, seed=0)
    runs = [Run(rnd, cell, measure(cell)) for rnd, cell in plan]   # rnd 0: the warm-up
    cells = summarize_rounds(runs, control=lambda cell: "dedup@" + cell.split("@")[1])
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spec_tot.errors import ConfigError

__all__ = [
    "CellSummary",
    "Run",
    "bootstrap_interval",
    "schedule_rounds",
    "summarize_rounds",
    "summary_line",
]

WARMUP = 0  # the round number of the warm-up run


@dataclass(frozen=True, slots=True)
class Run:
    """One measured run: its round (``WARMUP`` = 0 is dropped), its cell and its figures
    (``metric`` and, when the run has them, ``speculative_nodes`` / ``speculative_hits`` /
    ``solved``)."""

    round: int
    cell: str
    figures: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class CellSummary:
    """A cell over its rounds: the median of ``metric``; with a control, the median of the
    per-round ratios and its bootstrap interval; speculation launched / adopted / wasted
    (totals over the rounds); the distinct ``solved`` counts seen (one value: same answers
    in every round)."""

    cell: str
    control: str | None
    values: tuple[float, ...]
    median: float
    ratios: tuple[float, ...] = ()
    ratio: float | None = None
    interval: tuple[float, float] | None = None
    launched: int = 0
    adopted: int = 0
    solved: tuple[int, ...] = ()

    @property
    def wasted(self) -> int:
        return self.launched - self.adopted

    def to_dict(self) -> dict[str, Any]:
        return {
            "cell": self.cell,
            "control": self.control,
            "values": list(self.values),
            "median": self.median,
            "ratios": list(self.ratios),
            "ratio": self.ratio,
            "interval": list(self.interval) if self.interval else None,
            "speculative": {
                "launched": self.launched,
                "adopted": self.adopted,
                "wasted": self.wasted,
            },
            "solved": list(self.solved),
        }


def schedule_rounds(
    cells: Sequence[str], rounds: int, seed: int = 0, *, warmup: bool = True
) -> list[tuple[int, str]]:
    """``(round, cell)`` in run order: one warm-up run of the first cell (round 0), then
    ``rounds`` rounds of every cell in an order shuffled per round by ``seed``."""
    if rounds < 1:
        raise ConfigError("rounds", f"must be >= 1, got {rounds}")
    if not cells or len(set(cells)) != len(cells):
        raise ConfigError("cells", f"need distinct cells, got {list(cells)}")
    rng = random.Random(seed)
    plan = [(WARMUP, cells[0])] if warmup else []
    for rnd in range(1, rounds + 1):
        order = list(cells)
        rng.shuffle(order)
        plan += [(rnd, cell) for cell in order]
    return plan


def bootstrap_interval(
    values: Sequence[float],
    level: float = 0.9,
    *,
    resamples: int = 2000,
    seed: int = 0,
    stat: Callable[[Sequence[float]], float] = statistics.median,
) -> tuple[float, float]:
    """The ``level`` percentile-bootstrap interval of ``stat`` (the median) of ``values``."""
    if not values:
        raise ConfigError("values", "no values to bootstrap")
    if not 0.0 < level < 1.0:
        raise ConfigError("level", f"must be in (0, 1), got {level}")
    rng = random.Random(seed)
    draws = sorted(stat(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return draws[int(tail * resamples)], draws[int((1.0 - tail) * resamples) - 1]


def summarize_rounds(
    runs: Sequence[Run],
    control: Callable[[str], str | None] | None = None,
    *,
    metric: str = "queries_per_s",
    level: float = 0.9,
) -> dict[str, CellSummary]:
    """Per cell, over the measured rounds (the warm-up dropped): see ``CellSummary``.
    ``control(cell)`` names the cell it is compared with in the same round (None: none);
    a round where either run is missing gives no ratio."""
    by_round: dict[tuple[int, str], Mapping[str, Any]] = {}
    cells: list[str] = []
    for run in runs:
        if run.round == WARMUP:
            continue
        by_round[(run.round, run.cell)] = run.figures
        if run.cell not in cells:
            cells.append(run.cell)
    out = {}
    for cell in cells:
        mine = sorted((rnd, f) for (rnd, c), f in by_round.items() if c == cell)
        values = tuple(float(f[metric]) for _, f in mine)
        base = control(cell) if control is not None else None
        ratios = tuple(
            float(f[metric]) / float(by_round[(rnd, base)][metric])
            for rnd, f in mine
            if base is not None and (rnd, base) in by_round and by_round[(rnd, base)][metric]
        )
        out[cell] = CellSummary(
            cell=cell,
            control=base,
            values=values,
            median=statistics.median(values),
            ratios=ratios,
            ratio=statistics.median(ratios) if ratios else None,
            interval=bootstrap_interval(ratios, level) if ratios else None,
            launched=sum(int(f.get("speculative_nodes", 0)) for _, f in mine),
            adopted=sum(int(f.get("speculative_hits", 0)) for _, f in mine),
            solved=tuple(sorted({int(f["solved"]) for _, f in mine if "solved" in f})),
        )
    return out


def summary_line(cells: Mapping[str, CellSummary], metric: str = "queries/s") -> str:
    """One line: each cell's median and, against its control, the ratio and interval."""
    parts = []
    for s in cells.values():
        text = f"{s.cell} {s.median:.3g} {metric}"
        if s.ratio is not None and s.interval is not None:
            lo, hi = s.interval
            text += f" = {s.ratio:.2f}x {s.control} [{lo:.2f}, {hi:.2f}]"
        parts.append(text)
    return "; ".join(parts)
