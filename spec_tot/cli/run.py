"""``spec-tot run``: the main job, one mode at one concurrency (``--compare``: baseline too)."""

from __future__ import annotations

from typing import Annotated

import typer

from spec_tot.cli._execute import plan_and_report
from spec_tot.cli._options import Shared, search_command
from spec_tot.config import MODES
from spec_tot.errors import ConfigError

__all__ = ["run"]


@search_command
def run(
    shared: Shared,
    *,
    queries: Annotated[int, typer.Option(min=1, help="Number of puzzles.")] = 100,
    concurrency: Annotated[int, typer.Option(min=1, help="Queries in flight at once.")] = 32,
    mode: Annotated[str, typer.Option(help=f"Executor mode: {', '.join(MODES)}.")] = "full",
    compare: Annotated[bool, typer.Option(help="Also run baseline mode beside it.")] = False,
    show_tree: Annotated[bool, typer.Option(help="Show the search trees live.")] = False,
) -> None:
    """Run a ToT program end to end and print solved rate, queries/s and tokens/s."""
    if compare and mode == "baseline":
        raise ConfigError(
            "--compare",
            "compares a speculative --mode with baseline; "
            f"choose --mode from {', '.join(m for m in MODES if m != 'baseline')}",
        )
    plan_and_report(
        shared,
        modes=["baseline", mode] if compare else [mode],
        modes_option="--mode",
        concurrency=[concurrency],
        queries=queries,
        show_tree=show_tree,
    )
