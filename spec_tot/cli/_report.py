"""What ``spec-tot run`` and ``bench`` print: the results table, the one-line summary, and the
verdict on failed queries (a run in which every query failed is an error, not a result)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from spec_tot.cli._bench_table import rounds_payload, rounds_table, summarize_rows
from spec_tot.errors import ExecutionError

__all__ = ["RunOutcome", "report"]


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """One mode x concurrency run: its JSON row and the first query error, if any failed."""

    row: dict[str, Any]
    first_error: str | None

    @property
    def label(self) -> str:
        return f"{self.row['mode']}@{self.row['concurrency']}"

    @property
    def failed(self) -> int:
        m = self.row["metrics"]
        return int(m["failed"]) + int(m["cancelled"])  # cancelled counts timeouts too

    @property
    def all_failed(self) -> bool:
        return self.failed >= int(self.row["metrics"]["queries"])


def _table(rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="spec-tot")
    columns = ("mode", "search", "conc.", "solved", "acc", "q/s", "tok/s", "useful tok/s")
    for col in (*columns, "hit", "tok/step", "draft acc", "p50 s", "reward calls", "peak RSS MB"):
        table.add_column(col, justify="right")
    for row in rows:
        m = row["metrics"]
        table.add_row(
            row["mode"],
            row["search"],
            str(row["concurrency"]),
            f"{m['solved']}/{m['queries']}",
            f"{m['accuracy']:.2f}",
            f"{m['queries_per_s']:.3f}",
            f"{m['tokens_per_s']:.0f}",
            f"{m['useful_tokens_per_s']:.0f}",
            f"{m['spec_hit_rate']:.2f}",
            f"{m['tokens_per_step']:.2f}" if m.get("tokens_per_step") else "-",
            f"{m['acceptance_rate']:.2f}" if m.get("draft_tokens") else "-",
            f"{m['latency_p50_s']:.2f}",
            str(m["reward_calls"]),
            f"{m['peak_rss_mb']:.0f}",
        )
    return table


def _summary(rows: Sequence[dict[str, Any]]) -> str:
    base = {
        r["concurrency"]: r["metrics"]["queries_per_s"] for r in rows if r["mode"] == "baseline"
    }
    parts = []
    for row in rows:
        m = row["metrics"]
        part = (
            f"{row['mode']}@{row['concurrency']}: {m['queries_per_s']:.3f} q/s"
            f" acc {m['accuracy']:.2f}"
        )
        denom = base.get(row["concurrency"])
        if row["mode"] != "baseline" and denom:
            part += f" ({m['queries_per_s'] / denom:.2f}x baseline)"
        parts.append(part)
    return "summary: " + "; ".join(parts)


def _write_json(payload: Any, path: Path) -> str | None:
    """Write the runs; what went wrong, if anything (the run's results still print)."""
    try:
        path.write_text(json.dumps(payload, indent=2))
    except OSError as exc:
        return f"--json: could not write {str(path)!r}: {exc.strerror or exc}"
    return None


def report(
    runs: Sequence[RunOutcome],
    json_path: Path | None,
    *,
    out: Console,
    err: Console,
    options_text: str,
    control: str | None = None,
) -> None:
    """Print the table and summary (stdout), write the JSON, warn about failed queries
    (stderr); raise ``ExecutionError`` when every query of some run failed, or when the JSON
    could not be written (after the table: finished work is never lost to an output path).
    When every query of every run failed there is no table: its rates would measure
    nothing. With ``control`` (``bench --rounds``; every row has a ``round``) the table is
    per cell over the rounds, against the ``control`` mode, and the JSON an object."""
    rows = [r.row for r in runs]
    dead = [r for r in runs if r.all_failed]
    payload: Any = rows
    if len(dead) == len(runs):
        pass
    elif control is None:
        out.print(_table(rows))
        out.print(_summary(rows), soft_wrap=True)
    else:
        cells = summarize_rows(rows, control)
        payload = rounds_payload(rows, cells, control)
        out.print(rounds_table(cells))
        out.print(f"summary: {payload['summary']}", soft_wrap=True)
    json_error = _write_json(payload, json_path) if json_path is not None else None
    if json_path is not None and json_error is None and len(dead) < len(runs):
        err.print(f"wrote {json_path}", soft_wrap=True, markup=False, highlight=False)
    for run in runs:
        if run.failed and not run.all_failed:
            err.print(
                f"warning: {run.failed}/{run.row['metrics']['queries']} queries failed in "
                f"{run.label}; first: {run.first_error}",
                soft_wrap=True,
                markup=False,
                highlight=False,
            )
    if dead:
        first = dead[0]
        where = ", ".join(r.label for r in dead)
        also = f"; {json_error}" if json_error else ""
        raise ExecutionError(
            f"every query failed in {where} ({first.failed}/{first.row['metrics']['queries']};"
            f" {options_text}); first error: {first.first_error}{also}"
        )
    if json_error is not None:
        raise ExecutionError(json_error)
