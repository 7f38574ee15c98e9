"""The engine core in its own process vs on a thread of the caller's process.

Scenarios (each in interleaved rounds: every round runs every cell once, in a shuffled
order; round 0 is a warm-up and dropped; the prefix cache is flushed before each run):

- ``main``: the main job (``spec-tot run``: Game of 24 ranks 901-1000, REBASE, ``full``,
  shipped models, seed 0) at each ``--concurrency``, one fresh backend per run as the CLI
  makes it, queries/s of the batch. Kinds: ``thread`` (``process=False``), ``process`` (the
  default), ``process_t1`` (the child on one torch thread), ``process_prm`` (the PRM in a
  process of its own). Per cell: median, bootstrap interval, coefficient of variation over
  the rounds; per kind vs ``thread``: the median of the per-round ratios with its
  bootstrap interval; answers compared query by query.
- ``gil``: 64 requests x 48 new tokens through ``LocalBackend`` (the shipped policy), alone
  and beside an asyncio task that runs Python for ``--burn-ms`` of every 4 ms on the same
  event loop (an executor-like duty cycle); output tokens/s, and busy/alone per kind.
- ``start``: wall seconds of ``spec-tot run --queries 1`` in a fresh interpreter, default vs
  ``--backend-opt process=false`` (start-up dominates: imports, model loads, calibration
  from its cache); the difference of medians with its bootstrap interval.

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["bootstrap", "main"]

KINDS: dict[str, dict[str, Any]] = {
    "thread": {"process": False},
    "process": {},
    "process_t1": {"threads": 1},
    "process_prm": {"prm_process": True},
}


def bootstrap(values: list[float], stat: Callable[[list[float]], float] = statistics.median,
              n: int = 2000, seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """95% percentile interval of ``stat`` over resamples of ``values``."""
    rng = random.Random(seed)
    draws = sorted(stat(rng.choices(values, k=len(values))) for _ in range(n))
    return draws[int(0.025 * n)], draws[int(0.975 * n) - 1]


def _cell(values: list[float]) -> dict[str, Any]:
    mean = statistics.fmean(values)
    cv = statistics.stdev(values) / mean if len(values) > 1 and mean else 0.0
    return {"values": values, "median": statistics.median(values), "ci95": bootstrap(values),
            "cv": cv}  # fmt: skip


def _ratio(num: list[float], den: list[float]) -> dict[str, Any]:
    """Per-round ratios (same round: minutes apart at most) and their median's interval."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return {"ratios": ratios, "median": statistics.median(ratios), "ci95": bootstrap(ratios)}


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


def run_main(args: argparse.Namespace) -> dict[str, Any]:
    kinds = args.kinds.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    cells = [(k, c) for c in concs for k in kinds]
    rng = random.Random(args.seed)
    runs: dict[str, list[dict[str, Any]]] = {f"{k}@{c}": [] for k, c in cells}
    for rnd in range(args.rounds + 1):
        order = cells[:]
        rng.shuffle(order)
        for kind, conc in order:
            out = asyncio.run(_main_job(kind, conc, args.queries))
            print(f"round {rnd} {kind}@{conc}: {out['queries_per_s']:.2f} q/s "
                  f"{out['solved']}/{args.queries}", flush=True)  # fmt: skip
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
        lo, hi = ratio["ci95"]
        cv_p = result["cells"][key]["cv"]
        cv_t = result["cells"]["thread@" + key.split("@")[1]]["cv"]
        parts.append(f"{key} {ratio['median']:.2f}x thread [{lo:.2f}, {hi:.2f}] "
                     f"cv {cv_p:.3f} vs {cv_t:.3f}")  # fmt: skip
    result["summary"] = "main job: " + "; ".join(parts)
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
def run_start(args: argparse.Namespace) -> dict[str, Any]:
    exe = Path(sys.executable).with_name("spec-tot")
    commands = {
        "process": [str(exe), "run", "--queries", "1"],
        "thread": [str(exe), "run", "--queries", "1", "--backend-opt", "process=false"],
    }
    rng = random.Random(args.seed)
    runs: dict[str, list[float]] = {k: [] for k in commands}
    for rnd in range(args.rounds + 1):
        order = list(commands)
        rng.shuffle(order)
        for kind in order:
            start = time.perf_counter()
            subprocess.run(commands[kind], check=True, capture_output=True, env=os.environ)
            wall = time.perf_counter() - start
            print(f"round {rnd} {kind}: {wall:.2f} s", flush=True)
            if rnd:
                runs[kind].append(wall)
    diffs = [a - b for a, b in zip(runs["process"], runs["thread"], strict=True)]
    result = {
        "cells": {k: _cell(v) for k, v in runs.items()},
        "process_minus_thread_s": {
            "values": diffs,
            "median": statistics.median(diffs),
            "ci95": bootstrap(diffs),
        },
    }
    d = result["process_minus_thread_s"]
    result["summary"] = (
        f"spec-tot run --queries 1: process {result['cells']['process']['median']:.2f} s, "
        f"thread {result['cells']['thread']['median']:.2f} s, difference {d['median']:+.2f} s "
        f"[{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}]"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenario", choices=("main", "gil", "start"))
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (+1 warm-up)")
    parser.add_argument("--kinds", default="thread,process")
    parser.add_argument("--concurrency", default="1,32,64")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--burn-ms", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="shuffles the order of cells")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
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
