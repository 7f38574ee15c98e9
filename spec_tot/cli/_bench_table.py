"""What ``spec-tot bench --rounds N`` prints: per mode x concurrency cell, the median over the
rounds and the ratio to the control mode at the same concurrency (median of per-round
ratios, bootstrap 90% interval), with the speculation it launched and adopted
(``spec_tot.rounds`` holds the statistics)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from spec_tot.rounds import CellSummary, Run, summarize_rounds, summary_line

__all__ = ["rounds_payload", "rounds_table", "summarize_rows"]


def _label(row: Mapping[str, Any]) -> str:
    return f"{row['mode']}@{row['concurrency']}"


def summarize_rows(rows: Sequence[Mapping[str, Any]], control: str) -> dict[str, CellSummary]:
    """The cells of ``bench`` rows that carry a ``round``; each compared with ``control``'s
    run at its concurrency in the same round (the control's own cell has no ratio)."""
    runs = [Run(int(r["round"]), _label(r), r["metrics"]) for r in rows]

    def control_of(cell: str) -> str | None:
        mode, _, conc = cell.partition("@")
        return None if mode == control else f"{control}@{conc}"

    cells = summarize_rounds(runs, control_of)

    def order(cell: str) -> tuple[bool, str, int]:  # the control first, then by mode
        mode, _, conc = cell.partition("@")
        return (mode != control, mode, int(conc))

    return {name: cells[name] for name in sorted(cells, key=order)}


def rounds_table(cells: Mapping[str, CellSummary]) -> Table:
    table = Table(title="spec-tot bench (rounds)")
    for col in ("cell", "rounds", "median q/s", "vs control", "90% interval", "solved",
                "spec launched", "adopted", "wasted"):  # fmt: skip
        table.add_column(col, justify="right")
    for s in cells.values():
        interval = f"[{s.interval[0]:.2f}, {s.interval[1]:.2f}]" if s.interval else "-"
        table.add_row(
            s.cell,
            str(len(s.values)),
            f"{s.median:.3f}",
            f"{s.ratio:.2f}x {s.control}" if s.ratio is not None else "control",
            interval,
            "/".join(str(n) for n in s.solved) or "-",
            str(s.launched),
            str(s.adopted),
            str(s.wasted),
        )
    return table


def rounds_payload(
    rows: Sequence[Mapping[str, Any]], cells: Mapping[str, CellSummary], control: str
) -> dict[str, Any]:
    """The JSON of a rounds bench: every run (the warm-up as round 0), the cells, the line."""
    return {
        "control": control,
        "runs": list(rows),
        "cells": {name: s.to_dict() for name, s in cells.items()},
        "summary": summary_line(cells),
    }
