"""How ``run`` and ``bench`` execute a checked plan: one fresh backend per run, the runs in
their (shuffled, for rounds) order, progress shown, a signal turning into the runs so far;
then the report."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
from pathlib import Path
from typing import Any

import spec_tot.cli.kit as kit
from spec_tot.cli._checks import Plan, check_json_path, check_rounds, parse_pairs, plan_runs
from spec_tot.cli._interrupt import RunInterrupted, StopSignal, partial_batch
from spec_tot.cli._options import Shared
from spec_tot.cli._report import RunOutcome, report
from spec_tot.config import ExecutorConfig
from spec_tot.errors import ExecutionError
from spec_tot.progress import run_progress
from spec_tot.rounds import schedule_rounds

__all__ = ["bench_rows", "execute_plan", "plan_and_report"]


async def _one_run(
    plan: Plan, config: ExecutorConfig, show_tree: bool, stop: StopSignal
) -> RunOutcome:
    options = {**plan.program.backend_options(plan.backend), **plan.backend_options}
    backend = kit.start_backend(
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
    the queries that had finished make the result (``spec_tot.cli._interrupt``)."""
    finished: list[Any] = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    # a bar on a terminal; in a log, a plain line every 10 s (a bar there is only noise)
    with run_progress(label, len(inputs), kit.console) as advance:

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
    with Live(view.render(), console=kit.console, refresh_per_second=8) as live:

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


def execute_plan(plan: Plan, show_tree: bool = False, rounds: int = 1) -> list[RunOutcome]:
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


def bench_rows(*, show_tree: bool = False, **selection: Any) -> list[dict[str, Any]]:
    """Every mode x concurrency, checked first (``selection``: ``plan_runs``'s keywords),
    then run in one process with the same seeds; the JSON rows."""
    return [r.row for r in execute_plan(plan_runs(**selection), show_tree)]


def plan_and_report(
    shared: Shared,
    *,
    show_tree: bool = False,
    rounds: int = 1,
    control: str | None = None,
    **selection: Any,
) -> None:
    """Check everything (``shared`` and the command's own ``selection``: ``plan_runs``'s
    keywords), run the plan, report it; what finished before a signal is reported too."""
    check_json_path(shared.json_path)  # before the run: its results must have somewhere to go
    plan = plan_runs(
        search_params=parse_pairs(shared.param, "--param"),
        backend_options=parse_pairs(shared.backend_opt, "--backend-opt"),
        **shared.selection(),
        **selection,
    )
    control = check_rounds(rounds, control, [c.mode for c in plan.configs])
    text = plan.options_text()
    try:
        outcomes = execute_plan(plan, show_tree, rounds)
    except RunInterrupted as stopped:
        finished = [o for o in stopped.outcomes if o.row["metrics"]["queries"]]
        if finished:  # what finished is printed and written, never lost
            with contextlib.suppress(ExecutionError):
                _report(finished, shared.json_path, text, control)
        raise
    _report(outcomes, shared.json_path, text, control)


def _report(
    outcomes: list[RunOutcome], json_path: Path | None, text: str, control: str | None
) -> None:
    report(outcomes, json_path, out=kit.out, err=kit.console, options_text=text, control=control)
