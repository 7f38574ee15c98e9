"""Does the engine core grow with the number of queries it has served?

Runs the main job (Game of 24, REBASE, ``full``, the embedded backend) for ``--queries``
queries in chunks of ``--chunk``, every query a new tree (ids ``q0``, ``q1``, ... over the
puzzles of ranks 1-1362 in turn), and ``--settle-s`` seconds after each chunk (at rest)
reads the resident set of the engine core, the PRM core and this process from ``/proc``.
Reports the curve and, per process, the least-squares slope over the last ``--tail``
queries in MB per 100 queries.

    python benchmarks/rss_curve.py --queries 5000 --json benchmarks/results/rss_curve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

__all__ = ["main", "slope_mb_per_100"]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _children(pid: int) -> list[int]:
    """Descendants of ``pid`` (the fork server and the cores it forked)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task"):
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def slope_mb_per_100(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (queries, MB), in MB per 100 queries."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(q for q, _ in points) / n
    my = sum(m for _, m in points) / n
    sxx = sum((q - mx) ** 2 for q, _ in points)
    sxy = sum((q - mx) * (m - my) for q, m in points)
    return 100 * sxy / sxx if sxx else 0.0


def _inputs(start: int, count: int) -> list[dict[str, Any]]:
    from spec_tot.graphs import game24_task as task

    puzzles = task.load_puzzles()
    return [
        {"question": puzzles[i % len(puzzles)].text, "steps": [], "query_id": f"q{i}"}
        for i in range(start, start + count)
    ]


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from spec_tot.backends import default_registry
    from spec_tot.config import ExecutorConfig
    from spec_tot.graphs.game24 import PROGRAM

    backend = default_registry().create("local", **PROGRAM.backend_options("local"))
    config = ExecutorConfig(mode="full", seed=0, max_concurrency=args.concurrency)
    app = PROGRAM.build(backend=backend, search="rebase", config=config)
    curve: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        policy_pid = await backend.check_health()
        for done in range(0, args.queries, args.chunk):
            batch = await app.arun_batch(_inputs(done, args.chunk))
            # an idle core gives freed heap back within a second (adapters/local/core/heap.py):
            # read what it holds at rest, not the chunk's last step
            await asyncio.sleep(args.settle_s)
            cores = {p: _rss_mb(p) for p in _children(os.getpid())}
            row = {"queries": done + args.chunk, "wall_s": time.perf_counter() - start,
                   "solved": batch.metrics.solved, "front_mb": _rss_mb(os.getpid()),
                   "engine_mb": cores.pop(policy_pid, 0.0),
                   "other_mb": sorted(cores.values(), reverse=True)}  # fmt: skip
            curve.append(row)
            print(json.dumps(row), flush=True)
    finally:
        await backend.aclose()
    tail = [r for r in curve if r["queries"] > args.queries - args.tail]
    slopes = {key: slope_mb_per_100([(r["queries"], r[key]) for r in tail])
              for key in ("engine_mb", "front_mb")}  # fmt: skip
    # the PRM core is the largest of the other children (the fork server is small)
    slopes["prm_mb"] = slope_mb_per_100([(r["queries"], r["other_mb"][0]) for r in tail
                                         if r["other_mb"]])  # fmt: skip
    summary = ", ".join(f"{k.removesuffix('_mb')} {v:+.3f} MB/100 queries"
                        for k, v in slopes.items())  # fmt: skip
    head = f"RSS slope over the last {args.tail} of {args.queries} queries"
    return {"curve": curve, "slopes_mb_per_100": slopes, "summary": f"{head}: {summary}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=5000)
    ap.add_argument("--chunk", type=int, default=100)
    ap.add_argument("--tail", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--settle-s", type=float, default=1.5)
    ap.add_argument("--json")
    args = ap.parse_args()
    result = asyncio.run(_run(args))
    result["config"] = vars(args)
    print(result["summary"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
