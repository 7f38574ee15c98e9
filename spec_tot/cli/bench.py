"""``spec-tot bench``: every mode x concurrency in one process, optionally over interleaved
rounds compared with a control mode."""

from __future__ import annotations

from typing import Annotated

import typer

from spec_tot.cli._checks import MAX_ROUNDS, int_list, mode_list
from spec_tot.cli._execute import plan_and_report
from spec_tot.cli._options import Shared, search_command
from spec_tot.config import MODES

__all__ = ["bench"]


@search_command
def bench(
    shared: Shared,
    *,
    modes: Annotated[
        str, typer.Option(help=f"Comma-separated executor modes ({', '.join(MODES)}).")
    ] = "baseline",
    concurrency: Annotated[str, typer.Option(help="Comma-separated concurrency levels.")] = "1,32",
    queries: Annotated[int, typer.Option(min=1, help="Queries per run.")] = 32,
    rounds: Annotated[
        int,
        typer.Option(
            min=1,
            max=MAX_ROUNDS,
            help="Rounds: above 1, a dropped warm-up run, then every cell once per round in "
            "a seeded shuffled order; the table gives each cell's median and its ratio to "
            "--control with a bootstrap 90% interval.",
        ),
    ] = 1,
    control: Annotated[
        str | None,
        typer.Option(
            help="The mode every other is compared with (default: the first of "
            "--modes); only with --rounds above 1."
        ),
    ] = None,
) -> None:
    """Run every mode x concurrency in one process (same seeds, same backend kind)."""
    plan_and_report(
        shared,
        modes=mode_list(modes, "--modes"),
        modes_option="--modes",
        concurrency=int_list(concurrency, "--concurrency"),
        queries=queries,
        rounds=rounds,
        control=control,
    )
