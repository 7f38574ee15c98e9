"""The engine core in its own process vs on a thread of the caller's process.

Scenarios (each in interleaved rounds: every round runs every cell once, in a shuffled
order; round 0 is a warm-up and dropped; the prefix cache is flushed before each run):

- ``main``: the main job (``spec-tot run``: Game of 24 ranks 901-1000, REBASE, ``full``,
  shipped models, seed 0) at each ``--concurrency``, one fresh backend per run as the CLI
  makes it, queries/s of the batch. Kinds: ``thread`` (``process=False``), ``process`` (the
  default: engine and PRM each in a child of its own), ``process_shared`` (both in one
  child), ``process_t1`` / ``process_t2`` (children on one / two torch threads). Per cell:
  median, bootstrap interval, coefficient of variation over the rounds; per kind vs
  ``thread``: the median of the per-round ratios with its bootstrap interval; answers
  compared query by query. ``--fresh`` runs every cell in a fresh interpreter (nothing an
  earlier cell left in the benchmark's own process: a loaded in-thread engine's memory and
  thread pools, the shared fork server).
- ``gil``: 64 requests x 48 new tokens through ``LocalBackend`` (the shipped policy), alone
  and beside an asyncio task that runs Python for ``--burn-ms`` of every 4 ms on the same
  event loop (an executor-like duty cycle); output tokens/s, and busy/alone per kind.
- ``start``: wall seconds of ``spec-tot run --queries 1`` in a fresh interpreter, default vs
  ``--backend-opt process=false`` (start-up dominates: imports, model loads, calibration
  from its cache), to the process's exit (``exit_s``, what a shell waits for) and to the
  end of its output pipes (``drained_s``: a child that inherited them counts); and
  ``ready``: a fresh interpreter that starts the CLI's backend and waits until it answers
  (``ready_s``), so start-up alone. Per-round differences, median and bootstrap interval.

Run each under ``/work/bin/cpu-lock bench`` (or alone on the machine); JSON via ``--json``,
one summary line per scenario.

    python benchmarks/engine_process.py main --concurrency 32,64 --rounds 6 --json main.json
    python benchmarks/engine_process.py gil --rounds 6 --json gil.json
    python benchmarks/engine_process.py start --rounds 6 --json start.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["bootstrap", "main"]

KINDS: dict[str, dict[str, Any]] = {
    "thread": {"process": False},
    "process": {},  # the default: the PRM in a child of its own
    "process_shared": {"prm_process": False},  # engine and PRM in one child
    "process_t1": {"threads": 1},
    "process_t2": {"threads": 2},
}


def bootstrap(
    values: list[float],
    stat: Callable[[list[float]], float] = statistics.median,
    n: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """``level`` percentile interval of ``stat`` over resamples of ``values``."""
    rng = random.Random(seed)
    draws = sorted(stat(rng.choices(values, k=len(values))) for _ in range(n))
    tail = (1.0 - level) / 2
    return draws[int(tail * n)], draws[int((1.0 - tail) * n) - 1]


def _cell(values: list[float]) -> dict[str, Any]:
    mean = statistics.fmean(values)
    cv = statistics.stdev(values) / mean if len(values) > 1 and mean else 0.0
    return {"values": values, "median": statistics.median(values), "ci95": bootstrap(values),
            "ci90": bootstrap(values, level=0.9), "cv": cv}  # fmt: skip


def _ratio(num: list[float], den: list[float]) -> dict[str, Any]:
    """Per-round ratios (same round: minutes apart at most) and their median's interval."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return {"ratios": ratios, "median": statistics.median(ratios), "ci95": bootstrap(ratios),
            "ci90": bootstrap(ratios, level=0.9)}  # fmt: skip


def _local_options(kind: str) -> dict[str, Any]:
    from spec_tot.graphs.game24 import PROGRAM

    return {**PROGRAM.backend_options("local"), **KINDS[kind]}


# -- main job ----------------------------------------------------------------------------------
async def _main_job(kind: str, concurrency: int, queries: int) -> dict[str, Any]:
    from spec_tot.adapters.local import create_local
    from spec_tot.config import ExecutorConfig
    from spec_tot.graphs.game24 import PROGRAM, game24_inputs

    backend = create_local(**_local_options(kind))
    try:
        await backend.flush_prefix_cache()
        config = ExecutorConfig(mode="full", seed=0, max_concurrency=concurrency)
        app = PROGRAM.build(backend=backend, search="rebase", search_params={}, config=config)
        batch = await app.arun_batch(game24_inputs(queries))
    finally:
        await backend.aclose()
    metrics = batch.metrics
    return {
        "queries_per_s": metrics.queries_per_s,
        "solved": metrics.solved,
        "answers": {r.query_id: r.answer for r in batch.results},
    }


def _run_cell(kind: str, concurrency: int, queries: int) -> dict[str, Any]:
    return asyncio.run(_main_job(kind, concurrency, queries))


def _fresh_cell(kind: str, concurrency: int, queries: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "cell", "--kinds", kind]
    command += ["--concurrency", str(concurrency), "--queries", str(queries)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_main(args: argparse.Namespace) -> dict[str, Any]:
    kinds = args.kinds.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    cells = [(k, c) for c in concs for k in kinds]
    rng = random.Random(args.seed)
    runs: dict[str, list[dict[str, Any]]] = {f"{k}@{c}": [] for k, c in cells}
    for rnd in range(args.rounds + 1):
        order = cells[:]
        rng.shuffle(order)
        # the warm-up (imports, the fork server's start) is dropped: it may run fewer queries
        queries = args.queries if rnd else args.warmup_queries or args.queries
        for kind, conc in order:
            out = _fresh_cell(kind, conc, queries) if args.fresh else _run_cell(kind, conc, queries)
            print(f"round {rnd} {kind}@{conc}: {out['queries_per_s']:.2f} q/s "
                  f"{out['solved']}/{queries}", flush=True)  # fmt: skip
            if rnd:
                runs[f"{kind}@{conc}"].append(out)
    result: dict[str, Any] = {"cells": {}, "vs_thread": {}, "answers_equal": {}}
    for key, outs in runs.items():
        cell = _cell([o["queries_per_s"] for o in outs])
        cell["solved"] = [o["solved"] for o in outs]
        result["cells"][key] = cell
    for kind, conc in cells:
        base = f"thread@{conc}"
        if kind == "thread" or base not in runs:
            continue
        key = f"{kind}@{conc}"
        num = [o["queries_per_s"] for o in runs[key]]
        result["vs_thread"][key] = _ratio(num, [o["queries_per_s"] for o in runs[base]])
        same = [a["answers"] == b["answers"] for a, b in zip(runs[key], runs[base], strict=True)]
        result["answers_equal"][key] = same
    parts = []
    for key, ratio in result["vs_thread"].items():
        lo, hi = ratio["ci90"]
        cv_p = result["cells"][key]["cv"]
        cv_t = result["cells"]["thread@" + key.split("@")[1]]["cv"]
        parts.append(f"{key} {ratio['median']:.2f}x thread [{lo:.2f}, {hi:.2f}] "
                     f"cv {cv_p:.3f} vs {cv_t:.3f}")  # fmt: skip
    result["summary"] = "main job (90% intervals): " + "; ".join(parts)
    return result


# -- GIL experiment ----------------------------------------------------------------------------
async def _burner(busy_s: float, period_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:  # Python work on the loop, as an executor does
            sum(i * i for i in range(200))
        await asyncio.sleep(max(0.0, period_s - busy_s))


async def _gil_run(backend: Any, busy_ms: float, tag: str) -> float:
    from spec_tot.requests import GenerateRequest, SamplingParams

    await backend.flush_prefix_cache()
    params = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=1)
    stop = asyncio.Event()
    burner = asyncio.create_task(_burner(busy_ms / 1e3, 4e-3, stop)) if busy_ms else None
    start = time.perf_counter()
    results = await asyncio.gather(*(
        backend.generate(GenerateRequest(f"{tag}/{i}", params, prompt=f"{i % 13} 4 6 8 q{i}"))
        for i in range(64)
    ))  # fmt: skip
    elapsed = time.perf_counter() - start
    stop.set()
    if burner is not None:
        await burner
    return sum(c.num_tokens for r in results for c in r.completions) / elapsed


def run_gil(args: argparse.Namespace) -> dict[str, Any]:
    from spec_tot.adapters.local import create_local

    kinds = args.kinds.split(",")
    burns = [0.0, args.burn_ms]

    async def go() -> dict[str, list[float]]:
        backends = {k: create_local(**_local_options(k), saturation_batch=64) for k in kinds}
        for backend in backends.values():
            await backend.check_health()
        cells = [(k, b) for k in kinds for b in burns]
        out: dict[str, list[float]] = {f"{k}@{b}": [] for k, b in cells}
        rng = random.Random(args.seed)
        try:
            for rnd in range(args.rounds + 1):
                order = cells[:]
                rng.shuffle(order)
                for kind, burn in order:
                    tps = await _gil_run(backends[kind], burn, f"r{rnd}{kind}{burn}")
                    print(f"round {rnd} {kind} burn {burn} ms: {tps:.0f} tok/s", flush=True)
                    if rnd:
                        out[f"{kind}@{burn}"].append(tps)
        finally:
            for backend in backends.values():
                await backend.aclose()
        return out

    runs = asyncio.run(go())
    result: dict[str, Any] = {"cells": {k: _cell(v) for k, v in runs.items()}, "busy_vs_alone": {}}
    for kind in kinds:
        result["busy_vs_alone"][kind] = _ratio(runs[f"{kind}@{args.burn_ms}"], runs[f"{kind}@0.0"])
    result["summary"] = f"GIL (burn {args.burn_ms:.0f} ms of 4): " + "; ".join(
        f"{k} {r['median']:.2f}x alone [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"
        for k, r in result["busy_vs_alone"].items()
    )
    return result


# -- start-up --------------------------------------------------------------------------------
_READY = """
import asyncio, sys
from spec_tot.backends import default_registry
from spec_tot.graphs.game24 import PROGRAM
options = {**PROGRAM.backend_options("local"), **dict(a.split("=") for a in sys.argv[1:])}
options = {k: v == "True" if v in ("True", "False") else v for k, v in options.items()}
backend = default_registry().create("local", **options)
async def go():
    await backend.check_health()
    print("ready", flush=True)
    await backend.aclose()
asyncio.run(go())
"""


def _timed(command: list[str], marker: bytes | None) -> dict[str, float]:
    """Seconds until ``marker`` on stdout (when given), until the process exits (what a
    shell waits for) and until its stdout and stderr close (what a caller capturing them
    waits for: children that inherited them count). Both pipes are read as they fill."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out: dict[str, float] = {}
    err: list[bytes] = []

    def drain(pipe: Any, sink: list[bytes] | None) -> None:
        for line in pipe:
            if marker is not None and sink is None and line.strip() == marker:
                out.setdefault("ready_s", time.perf_counter() - start)
            if sink is not None:
                sink.append(line)

    readers = [threading.Thread(target=drain, args=(proc.stdout, None)),
               threading.Thread(target=drain, args=(proc.stderr, err))]  # fmt: skip
    for reader in readers:
        reader.start()
    code = proc.wait()
    out["exit_s"] = time.perf_counter() - start
    for reader in readers:
        reader.join()
    out["drained_s"] = time.perf_counter() - start
    if code != 0 or (marker is not None and "ready_s" not in out):
        raise RuntimeError(f"{command} exited {code}: {b''.join(err).decode()[-2000:]}")
    return out


def run_start(args: argparse.Namespace) -> dict[str, Any]:
    exe = Path(sys.executable).with_name("spec-tot")
    run = [str(exe), "run", "--queries", "1"]
    # kind -> (command, stdout marker): the CLI's wall time, and a fresh interpreter that
    # only starts the CLI's backend and waits until it answers (start-up alone)
    commands: dict[str, tuple[list[str], bytes | None]] = {
        "process": (run, None),
        "thread": ([*run, "--backend-opt", "process=false"], None),
        "process_ready": ([sys.executable, "-c", _READY], b"ready"),
        "thread_ready": ([sys.executable, "-c", _READY, "process=False"], b"ready"),
    }
    rng = random.Random(args.seed)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in commands}
    for rnd in range(args.rounds + 1):
        order = list(commands)
        rng.shuffle(order)
        for kind in order:
            got = _timed(*commands[kind])
            print(f"round {rnd} {kind}: " + " ".join(f"{k} {v:.2f}" for k, v in got.items()),
                  flush=True)  # fmt: skip
            if rnd:
                runs[kind].append(got)
    result: dict[str, Any] = {"cells": {}, "process_minus_thread_s": {}}
    for kind, outs in runs.items():
        for metric in outs[0]:
            result["cells"][f"{kind}.{metric}"] = _cell([o[metric] for o in outs])
    pairs = {"run": ("process", "thread"), "ready": ("process_ready", "thread_ready")}
    for name, (proc_kind, thread_kind) in pairs.items():
        for metric in runs[proc_kind][0]:
            diffs = [a[metric] - b[metric]
                     for a, b in zip(runs[proc_kind], runs[thread_kind], strict=True)]  # fmt: skip
            result["process_minus_thread_s"][f"{name}.{metric}"] = {
                "values": diffs, "median": statistics.median(diffs), "ci95": bootstrap(diffs),
                "ci90": bootstrap(diffs, level=0.9),
            }  # fmt: skip
    cells = result["cells"]
    parts = []
    for key, d in result["process_minus_thread_s"].items():
        name, metric = key.split(".")
        proc_kind, thread_kind = pairs[name]
        parts.append(
            f"{key}: process {cells[f'{proc_kind}.{metric}']['median']:.2f} s, thread "
            f"{cells[f'{thread_kind}.{metric}']['median']:.2f} s, {d['median']:+.2f} s "
            f"[{d['ci90'][0]:+.2f}, {d['ci90'][1]:+.2f}]"
        )
    result["summary"] = (
        "start-up (spec-tot run --queries 1; ready: the backend answers; 90% intervals): "
        + "; ".join(parts)
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenario", choices=("main", "gil", "start", "cell"))
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (+1 warm-up)")
    parser.add_argument("--kinds", default="thread,process")
    parser.add_argument("--concurrency", default="1,32,64")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--warmup-queries", type=int, help="main: queries of the warm-up round")
    parser.add_argument("--burn-ms", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="shuffles the order of cells")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--fresh", action="store_true", help="main: each run in a new python")
    args = parser.parse_args()
    if args.scenario == "cell":  # one run of --fresh: its result as the last stdout line
        print(json.dumps(_run_cell(args.kinds, int(args.concurrency), args.queries)))
        return
    run = {"main": run_main, "gil": run_gil, "start": run_start}[args.scenario]
    load = os.getloadavg()
    result = run(args)
    result.update(
        scenario=args.scenario,
        args=vars(args) | {"json": str(args.json)},
        load_before=load,
        load_after=os.getloadavg(),
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    print(result["summary"])


if __name__ == "__main__":
    main()
