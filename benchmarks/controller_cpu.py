"""The executor's own CPU per event against the number of queries in flight: issue 34's
"controller CPU per event flat in the number of queries".

The toy program on the scripted backend (token latency ``--token-ms``, stragglers, so that
speculation has score waits to fill), ``full`` mode, ``--queries`` Q all in flight at once
(Q = 16, 64, 256): the event-loop thread's CPU seconds (``executor_cpu_s``) per node the
search reported (each node is one generation event plus one reward event), and how many
speculative nodes the one dispatcher launched and adopted. Each Q runs ``--rounds`` times,
interleaved in a shuffled order; the median is reported.

    python benchmarks/controller_cpu.py --json benchmarks/results/controller_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from spec_tot.backends import default_registry
from spec_tot.config import ExecutorConfig
from spec_tot.programs import load_program
from spec_tot.rounds import schedule_rounds

__all__ = ["main"]


async def _run(queries: int, args: argparse.Namespace) -> dict[str, Any]:
    program = load_program("toy")
    backend = default_registry().create(
        "scripted",
        token_latency_s=args.token_ms / 1000,
        straggler_rate=0.2,
        depth=4,
        seed=args.seed,
    )
    try:
        config = ExecutorConfig(mode="full", seed=args.seed, max_concurrency=queries)
        app = program.build(backend=backend, search=args.search, config=config)
        batch = await app.arun_batch(program.inputs(queries))
    finally:
        await backend.aclose()
    m = batch.metrics
    return {
        "queries": queries,
        "nodes": m.nodes,
        "executor_cpu_s": m.executor_cpu_s,
        "cpu_us_per_node": 1e6 * m.executor_cpu_s / max(m.nodes, 1),
        "speculative_nodes": m.speculative_nodes,
        "speculative_hits": m.speculative_hits,
        "wall_s": m.wall_s,
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(q) for q in args.queries.split(",")]
    runs: list[dict[str, Any]] = []
    for rnd, q in schedule_rounds([str(q) for q in sizes], args.rounds, args.seed):
        row = await _run(int(q), args)
        row["round"] = rnd
        print(f"round {rnd} Q={q}: {row['cpu_us_per_node']:.0f} us/node, "
              f"spec {row['speculative_nodes']}/{row['speculative_hits']}", flush=True)  # fmt: skip
        runs.append(row)
    cells = {}
    for q in sizes:
        mine = [r for r in runs if r["queries"] == q and r["round"]]
        cells[q] = {
            "cpu_us_per_node": statistics.median(r["cpu_us_per_node"] for r in mine),
            "speculative_nodes": statistics.median(r["speculative_nodes"] for r in mine),
            "speculative_hits": statistics.median(r["speculative_hits"] for r in mine),
        }
    first = cells[sizes[0]]["cpu_us_per_node"]
    line = ", ".join(
        f"Q={q} {c['cpu_us_per_node']:.0f} us/node ({c['cpu_us_per_node'] / first:.2f}x)"
        for q, c in cells.items()
    )
    return {"runs": runs, "cells": cells, "summary": f"executor CPU per node: {line}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", default="16,64,256")
    ap.add_argument("--search", default="rebase")
    ap.add_argument("--token-ms", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    result = asyncio.run(_main(args))
    result["config"] = vars(args)
    print(result["summary"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
