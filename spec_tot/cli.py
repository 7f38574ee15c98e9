"""``spec-tot`` command line: ``run`` (the main job), ``bench``, ``serve`` and ``graph``."""

from __future__ import annotations

import asyncio
import importlib
import json
import shutil
import sys
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from spec_tot._private.mermaid import graph_to_mermaid
from spec_tot._private.programs import Program, load_program
from spec_tot.backends import default_registry
from spec_tot.config import MODES, ExecutorConfig
from spec_tot.errors import ConfigError, SpecTotError
from spec_tot.metrics import RunMetrics

__all__ = ["app", "main"]

app = typer.Typer(add_completion=False, no_args_is_help=False, help=__doc__)
console = Console(stderr=True)
# Wide enough for the results table when piped to a file or a CI log.
out = Console(width=max(shutil.get_terminal_size((160, 24)).columns, 150))


def _parse_pairs(pairs: list[str] | None, option: str) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(option, f"expected KEY=VALUE, got {pair!r}")
        try:
            parsed[key] = json.loads(raw)
        except json.JSONDecodeError:
            parsed[key] = raw  # a bare string such as a path
    return parsed


def _int_list(text: str, option: str) -> list[int]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() and int(t) > 0 for t in items):
        raise ConfigError(option, f"expected positive integers separated by commas, got {text!r}")
    return [int(t) for t in items]


async def _one_run(
    program: Program,
    *,
    backend_name: str,
    backend_options: dict[str, Any],
    search: str,
    search_params: dict[str, Any],
    mode: str,
    concurrency: int,
    queries: int,
    seed: int,
    label: str,
    show_tree: bool = False,
) -> RunMetrics:
    options = {**program.backend_options(backend_name), **backend_options}
    backend = default_registry().create(backend_name, **options)
    try:
        tot = program.build(
            backend=backend,
            search=search,
            search_params=search_params,
            config=ExecutorConfig(mode=mode, seed=seed, max_concurrency=concurrency),
        )
        inputs = program.inputs(queries)
        if show_tree:
            return await _run_with_tree(tot, inputs)
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            task = progress.add_task(label, total=len(inputs))
            batch = await tot.arun_batch(inputs, on_result=lambda _r: progress.advance(task))
        metrics: RunMetrics = batch.metrics
        return metrics
    finally:
        await backend.aclose()


async def _run_with_tree(tot: Any, inputs: list[Any]) -> RunMetrics:
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
    metrics: RunMetrics = batch.metrics
    return metrics


def _table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="spec-tot")
    columns = ("mode", "search", "conc.", "solved", "acc", "q/s", "tok/s", "useful tok/s")
    for col in (*columns, "hit", "p50 s", "reward calls", "peak RSS MB"):
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
            f"{m['latency_p50_s']:.2f}",
            str(m["reward_calls"]),
            f"{m['peak_rss_mb']:.0f}",
        )
    return table


def _program_for(program: str | None, backend: str | None) -> str:
    """The toy program fits the synthetic backends; real models run Game of 24."""
    if program is not None:
        return program
    return "toy" if backend in ("scripted", "sim") else "game24"


def _bench(
    *,
    program: str | None,
    backend: str | None,
    search: str | None,
    modes: list[str],
    concurrency: list[int],
    queries: int,
    seed: int,
    search_params: dict[str, Any],
    backend_options: dict[str, Any],
    show_tree: bool = False,
) -> list[dict[str, Any]]:
    if queries < 1:
        raise ConfigError("--queries", f"must be >= 1, got {queries}")
    prog = load_program(_program_for(program, backend))
    backend_name = backend or prog.default_backend
    search_name = search or prog.default_search
    rows: list[dict[str, Any]] = []
    for mode in modes:
        ExecutorConfig(mode=mode)  # unknown modes fail before any run starts
    for mode in modes:
        for conc in concurrency:
            # The simulator's costs are virtual seconds: run it on its virtual-time loop.
            runner: Any = asyncio.run
            if backend_name == "sim":
                runner = importlib.import_module("spec_tot.adapters.sim").run_virtual
            metrics = runner(
                _one_run(
                    prog,
                    backend_name=backend_name,
                    backend_options=backend_options,
                    search=search_name,
                    search_params=search_params,
                    mode=mode,
                    concurrency=conc,
                    queries=queries,
                    seed=seed,
                    label=f"{mode} x{conc}",
                    show_tree=show_tree,
                )
            )
            rows.append(
                {
                    "mode": mode,
                    "search": search_name,
                    "backend": backend_name,
                    "program": prog.name,
                    "concurrency": conc,
                    "seed": seed,
                    "metrics": metrics.to_dict(),
                }
            )
    return rows


ProgramOpt = Annotated[
    str | None,
    typer.Option(help="ToT program: game24 | toy (default: toy on scripted/sim, else game24)."),
]
BackendOpt = Annotated[str | None, typer.Option(help="Backend name (default: the program's).")]
SearchOpt = Annotated[str | None, typer.Option(help="Search policy (default: the program's).")]
SeedOpt = Annotated[int, typer.Option(help="Base seed.")]
ParamOpt = Annotated[list[str] | None, typer.Option(help="Search parameter KEY=VALUE.")]
BackendParamOpt = Annotated[list[str] | None, typer.Option(help="Backend option KEY=VALUE.")]
JsonOpt = Annotated[Path | None, typer.Option(help="Write the runs as JSON here.")]


@app.command()
def run(
    program: ProgramOpt = None,
    backend: BackendOpt = None,
    search: SearchOpt = None,
    queries: Annotated[int, typer.Option(help="Number of puzzles.")] = 100,
    concurrency: Annotated[int, typer.Option(help="Queries in flight at once.")] = 32,
    mode: Annotated[str, typer.Option(help=f"Executor mode: {', '.join(MODES)}.")] = "full",
    compare: Annotated[bool, typer.Option(help="Also run baseline mode beside it.")] = False,
    seed: SeedOpt = 0,
    param: ParamOpt = None,
    backend_opt: BackendParamOpt = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write JSON here.")] = None,
    show_tree: Annotated[bool, typer.Option(help="Show the search trees live.")] = False,
) -> None:
    """Run a ToT program end to end and print solved rate, queries/s and tokens/s."""
    if compare and mode == "baseline":
        raise ConfigError(
            "--compare",
            "compares a speculative --mode with baseline; "
            f"choose --mode from {', '.join(m for m in MODES if m != 'baseline')}",
        )
    modes = ["baseline", mode] if compare else [mode]
    rows = _bench(
        program=program,
        backend=backend,
        search=search,
        modes=modes,
        concurrency=[concurrency],
        queries=queries,
        seed=seed,
        search_params=_parse_pairs(param, "--param"),
        backend_options=_parse_pairs(backend_opt, "--backend-opt"),
        show_tree=show_tree,
    )
    _report(rows, json_path)


@app.command()
def bench(
    program: ProgramOpt = None,
    backend: BackendOpt = None,
    search: SearchOpt = None,
    modes: Annotated[str, typer.Option(help="Comma-separated executor modes.")] = "baseline",
    concurrency: Annotated[str, typer.Option(help="Comma-separated concurrency levels.")] = "1,32",
    queries: Annotated[int, typer.Option(help="Queries per run.")] = 32,
    seed: SeedOpt = 0,
    param: ParamOpt = None,
    backend_opt: BackendParamOpt = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write JSON here.")] = None,
) -> None:
    """Run every mode x concurrency in one process (same seeds, same backend kind)."""
    rows = _bench(
        program=program,
        backend=backend,
        search=search,
        modes=[m.strip() for m in modes.split(",") if m.strip()],
        concurrency=_int_list(concurrency, "--concurrency"),
        queries=queries,
        seed=seed,
        search_params=_parse_pairs(param, "--param"),
        backend_options=_parse_pairs(backend_opt, "--backend-opt"),
    )
    _report(rows, json_path)


def _report(rows: list[dict[str, Any]], json_path: Path | None) -> None:
    out.print(_table(rows))
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=2))
        console.print(f"wrote {json_path}")
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
    out.print("summary: " + "; ".join(parts))


@app.command()
def serve(
    program: ProgramOpt = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 30000,
    backend_opt: BackendParamOpt = None,
) -> None:
    """Serve the embedded engine (and the program's PRM) over SGLang's native HTTP API."""
    import uvicorn

    from spec_tot.adapters.local.serve import create_server_app

    options = {**load_program(program or "game24").backend_options("local")}
    options.update(_parse_pairs(backend_opt, "--backend-opt"))
    backend = default_registry().create("local", **options)
    server = create_server_app(backend, model_path=str(options.get("policy_path", "")))
    console.print(f"spec-tot serve: http://{host}:{port} (SGLang native API subset)")
    uvicorn.run(server, host=host, port=port, log_level="warning")


@app.command()
def graph(program: ProgramOpt = None) -> None:
    """Print a program's compiled graph as Mermaid."""
    from spec_tot.adapters.scripted import ScriptedBackend

    prog = load_program(program or "game24")
    tot = prog.build(backend=ScriptedBackend(), search=prog.default_search, search_params={})
    out.print(graph_to_mermaid(tot.graph), markup=False, highlight=False)


def main() -> None:
    """Entry point: errors are one clear line, not a traceback."""
    command = typer.main.get_command(app)
    try:
        code = command.main(standalone_mode=False)
    except click.exceptions.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except (SpecTotError, ValueError, OSError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)
