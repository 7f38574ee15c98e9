"""The ``spec-tot`` command line: ``run`` (the main job), ``bench``, ``serve`` and ``graph``."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from spec_tot import _cli_help, cli_kit
from spec_tot._cli_checks import (
    MAX_ROUNDS,
    Plan,
    as_option,
    check_json_path,
    check_rounds,
    error_line,
    int_list,
    mode_list,
    parse_pairs,
    plan_runs,
)
from spec_tot._cli_interrupt import RunInterrupted, StopSignal, partial_batch
from spec_tot._cli_report import RunOutcome, report
from spec_tot._private.mermaid import graph_to_mermaid
from spec_tot.backends import BackendRegistry
from spec_tot.config import MODES, ExecutorConfig
from spec_tot.errors import ConfigError, ExecutionError, UnknownNameError
from spec_tot.programs import load_program
from spec_tot.progress import run_progress, show_progress
from spec_tot.rounds import schedule_rounds

__all__ = ["app", "main", "run_cli"]

TRACEBACK_ENV = "SPEC_TOT_TRACEBACK"  # set to 1 to see the traceback of an unexpected error

app = typer.Typer(add_completion=False, help=_cli_help.APP_HELP, epilog=_cli_help.names_epilog())


@app.callback()
def _top(version: _cli_help.VersionOpt = False) -> None:
    """Fast Tree-of-Thought reasoning ('spec-tot COMMAND --help': a command's options)."""


console = cli_kit.console
# Wide enough for the results table when piped to a file or a CI log.
out = Console(width=max(shutil.get_terminal_size((160, 24)).columns, 150))

# typer ships its own copy of click (typer._click) whose exceptions are not click's: find the
# base class through a public one, so this works with a vendored and a plain click alike.
_CLICK_ERROR: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"
)


async def _one_run(
    plan: Plan, config: ExecutorConfig, show_tree: bool, stop: StopSignal
) -> RunOutcome:
    options = {**plan.program.backend_options(plan.backend), **plan.backend_options}
    backend = cli_kit.start_backend(
        plan.backend, options, plan.options_text(), tuple(plan.backend_options), plan.registry
    )
    try:
        tot = plan.program.build(
            backend=backend, search=plan.search, search_params=plan.search_params, config=config
        )
        inputs = copy.deepcopy(plan.inputs)  # each run starts from fresh input states
        if show_tree:
            batch = await _run_with_tree(tot, inputs)
        else:
            batch = await _run_stoppable(
                tot, inputs, f"{config.mode} x{config.max_concurrency}", stop
            )
    finally:
        await backend.aclose()
    first_error = next(
        (
            r.errors[0] if r.errors else f"{r.query_id}: {r.status}"
            for r in batch.results
            if r.status != "ok"
        ),
        None,
    )
    row = {
        "mode": config.mode,
        "search": plan.search,
        "backend": plan.backend,
        "program": plan.program.name,
        "concurrency": config.max_concurrency,
        "seed": config.seed,
        "metrics": batch.metrics.with_backend_stats(backend.stats()).to_dict(),
    }
    if stop.signum is not None:
        row["partial"] = True  # cut short by a signal: the queries that had finished
    return RunOutcome(row, first_error)


async def _run_stoppable(tot: Any, inputs: list[Any], label: str, stop: StopSignal) -> Any:
    """The batch, with its progress shown; a SIGINT or SIGTERM cuts it short and
    the queries that had finished make the result (``_cli_interrupt.py``)."""
    finished: list[Any] = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    # a bar on a terminal; in a log, a plain line every 10 s (a bar there is only noise)
    with run_progress(label, len(inputs), console) as advance:

        def on_result(result: Any) -> None:
            finished.append(result)
            advance()

        work = asyncio.ensure_future(tot.arun_batch(inputs, on_result=on_result))
        remove = stop.watch(work)
        try:
            return await work
        except asyncio.CancelledError:
            if stop.signum is None:
                raise
            return partial_batch(finished, loop.time() - started)
        finally:
            remove()


async def _run_with_tree(tot: Any, inputs: list[Any]) -> Any:
    """The run with a live view of the search trees (statuses as they change)."""
    from rich.live import Live

    from spec_tot.viz import LiveTree

    view = LiveTree()
    loop = asyncio.get_running_loop()
    last = 0.0
    with Live(view.render(), console=console, refresh_per_second=8) as live:

        def on_event(event: Any) -> None:
            nonlocal last
            view(event)
            if loop.time() - last > 0.1:  # rebuilding the view per event would cost the run
                last = loop.time()
                live.update(view.render())

        batch = await tot.arun_batch(inputs, on_event=on_event)
        live.update(view.render())
    return batch


def _schedule(plan: Plan, rounds: int) -> list[tuple[int | None, ExecutorConfig]]:
    """The runs in order: each config once; with ``rounds`` > 1, a warm-up run (round 0)
    then every config once per round, shuffled per round by the plan's seed."""
    if rounds == 1:
        return [(None, config) for config in plan.configs]
    cells = {f"{c.mode}@{c.max_concurrency}": c for c in plan.configs}
    order = schedule_rounds(list(cells), rounds, plan.configs[0].seed)
    return [(rnd, cells[cell]) for rnd, cell in order]


def _execute(plan: Plan, show_tree: bool = False, rounds: int = 1) -> list[RunOutcome]:
    """Every run of ``plan`` (``_schedule``); each starts a fresh backend, so no run finds
    another's prefix cache. A signal ends them with ``RunInterrupted`` (holding the runs
    so far, the one it cut short included)."""
    # The simulator's costs are virtual seconds: run it on its virtual-time loop.
    runner: Any = asyncio.run
    if plan.backend == "sim":
        runner = importlib.import_module("spec_tot.adapters.sim").run_virtual
    stop = StopSignal()
    outcomes = []
    for rnd, config in _schedule(plan, rounds):
        outcome = runner(_one_run(plan, config, show_tree, stop))
        if rnd is not None:
            outcome.row["round"] = rnd
        outcomes.append(outcome)
        if stop.signum is not None:
            raise RunInterrupted(stop.signum, outcomes)
    return outcomes


def _bench(*, show_tree: bool = False, **selection: Any) -> list[dict[str, Any]]:
    """Every mode x concurrency, checked first (``selection``: ``plan_runs``'s keywords),
    then run in one process with the same seeds; the JSON rows."""
    return [r.row for r in _execute(plan_runs(**selection), show_tree)]


def _plan_and_report(
    *,
    param: list[str] | None,
    backend_opt: list[str] | None,
    json_path: Path | None,
    show_tree: bool = False,
    rounds: int = 1,
    control: str | None = None,
    **selection: Any,
) -> None:
    check_json_path(json_path)  # before the run: its results must have somewhere to go
    plan = plan_runs(
        search_params=parse_pairs(param, "--param"),
        backend_options=parse_pairs(backend_opt, "--backend-opt"),
        **selection,
    )
    control = check_rounds(rounds, control, [c.mode for c in plan.configs])
    text = plan.options_text()
    try:
        outcomes = _execute(plan, show_tree, rounds)
    except RunInterrupted as stopped:
        finished = [o for o in stopped.outcomes if o.row["metrics"]["queries"]]
        if finished:  # what finished is printed and written, never lost
            with contextlib.suppress(ExecutionError):
                report(finished, json_path, out=out, err=console, options_text=text,
                       control=control)  # fmt: skip
        raise
    report(outcomes, json_path, out=out, err=console, options_text=text, control=control)


@app.command()
def run(
    ctx: typer.Context,
    program: cli_kit.ProgramOpt = None,
    backend: cli_kit.BackendOpt = None,
    search: cli_kit.SearchOpt = None,
    queries: Annotated[int, typer.Option(min=1, help="Number of puzzles.")] = 100,
    dataset: cli_kit.DatasetOpt = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Queries in flight at once.")] = 32,
    mode: Annotated[str, typer.Option(help=f"Executor mode: {', '.join(MODES)}.")] = "full",
    compare: Annotated[bool, typer.Option(help="Also run baseline mode beside it.")] = False,
    seed: cli_kit.SeedOpt = 0,
    param: cli_kit.ParamOpt = None,
    backend_opt: cli_kit.BackendParamOpt = None,
    json_path: cli_kit.JsonOpt = None,
    hit_rates: cli_kit.HitRatesOpt = "auto",
    show_tree: Annotated[bool, typer.Option(help="Show the search trees live.")] = False,
    list_options: _cli_help.ListOptionsOpt = None,
    list_params: _cli_help.ListParamsOpt = None,
) -> None:
    """Run a ToT program end to end and print solved rate, queries/s and tokens/s."""
    if compare and mode == "baseline":
        raise ConfigError(
            "--compare",
            "compares a speculative --mode with baseline; "
            f"choose --mode from {', '.join(m for m in MODES if m != 'baseline')}",
        )
    _plan_and_report(
        program=program,
        backend=backend,
        search=search,
        modes=["baseline", mode] if compare else [mode],
        concurrency=[concurrency],
        queries=queries,
        dataset=dataset,
        seed=seed,
        param=param,
        backend_opt=backend_opt,
        json_path=json_path,
        show_tree=show_tree,
        hit_rates=hit_rates,
        modes_option="--mode",
        registry=ctx.obj,
    )


@app.command()
def bench(
    ctx: typer.Context,
    program: cli_kit.ProgramOpt = None,
    backend: cli_kit.BackendOpt = None,
    search: cli_kit.SearchOpt = None,
    modes: Annotated[
        str, typer.Option(help=f"Comma-separated executor modes ({', '.join(MODES)}).")
    ] = "baseline",
    concurrency: Annotated[str, typer.Option(help="Comma-separated concurrency levels.")] = "1,32",
    queries: Annotated[int, typer.Option(min=1, help="Queries per run.")] = 32,
    dataset: cli_kit.DatasetOpt = None,
    seed: cli_kit.SeedOpt = 0,
    param: cli_kit.ParamOpt = None,
    backend_opt: cli_kit.BackendParamOpt = None,
    json_path: cli_kit.JsonOpt = None,
    hit_rates: cli_kit.HitRatesOpt = "auto",
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
    list_options: _cli_help.ListOptionsOpt = None,
    list_params: _cli_help.ListParamsOpt = None,
) -> None:
    """Run every mode x concurrency in one process (same seeds, same backend kind)."""
    _plan_and_report(
        rounds=rounds,
        control=control,
        program=program,
        backend=backend,
        search=search,
        modes=mode_list(modes, "--modes"),
        concurrency=int_list(concurrency, "--concurrency"),
        queries=queries,
        dataset=dataset,
        seed=seed,
        param=param,
        backend_opt=backend_opt,
        json_path=json_path,
        hit_rates=hit_rates,
        modes_option="--modes",
        registry=ctx.obj,
    )


@app.command()
def graph(program: cli_kit.ProgramOpt = None) -> None:
    """Print a program's compiled graph as Mermaid."""
    from spec_tot.adapters.scripted import ScriptedBackend

    with as_option("--program"):
        prog = load_program(program or "game24")
    tot = prog.build(backend=ScriptedBackend(), search=prog.default_search, search_params={})
    out.print(graph_to_mermaid(tot.graph), markup=False, highlight=False)


# Commands that live with what they serve, registered by name so the core imports none of
# them (``spec_tot.cli_kit``: how a plug-in adds its own).
_BUILTIN_COMMANDS = {"serve": "spec_tot.adapters.local.serve.command:serve"}


cli_kit.add_commands(app, _BUILTIN_COMMANDS)


def _say(line: str) -> None:
    """One line on stderr, never wrapped (a terminal-width console would break it)."""
    print(line, file=sys.stderr, flush=True)


def run_cli(argv: Sequence[str] | None = None, *, registry: BackendRegistry | None = None) -> int:
    """Run the CLI and return its exit code: 0 ok, 2 a usage error (one line, naming the
    option), 1 a runtime failure (one line), 130 interrupted. No traceback unless
    ``SPEC_TOT_TRACEBACK=1``. ``registry``: the backends ``run`` and ``bench`` know by name,
    their options checked by each entry's schema (default: ``default_registry()``)."""
    command = typer.main.get_command(app)
    try:
        code = command.main(
            args=list(argv) if argv is not None else None,
            prog_name="spec-tot",
            standalone_mode=False,
            obj=registry,
        )
    except _CLICK_ERROR as exc:
        err: Any = exc
        ctx = getattr(err, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        _say(f"error: {' '.join(str(err.format_message()).split())}{hint}")
        return int(getattr(err, "exit_code", 2))
    except RunInterrupted as stopped:
        _say(f"aborted ({stopped}): the queries that had finished are reported, marked partial")
        return stopped.exit_code
    except (typer.Abort, KeyboardInterrupt):
        _say("aborted")
        return 130
    except (ConfigError, UnknownNameError) as exc:
        _say(f"error: {error_line(exc)}")
        return 2
    except Exception as exc:
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        _say(f"error: {error_line(exc)}")
        return 1
    return code if isinstance(code, int) else 0


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point (``spec-tot``, ``python -m spec_tot``): errors are one line, not a
    traceback; long steps (model load, calibration, kernel compilation) print what they do."""
    show_progress()
    sys.exit(run_cli(argv))
