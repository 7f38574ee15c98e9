"""Search quality on Game of 24, ToT's test range (ranks 901-1000), shipped models.

Compares, on the embedded engine in baseline mode (quality does not depend on the executor
mode): greedy single path; beam search and REBASE at width 8 with the learned PRM; and
best-of-N with the PRM picking the best trace, where N is chosen so that best-of-N generates
at least as many tokens as the most expensive tree search (equal-token comparison).

    python benchmarks/game24_quality.py --queries 100 --json quality.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path
from typing import Any

from spec_tot.adapters.local import create_local
from spec_tot.config import ExecutorConfig
from spec_tot.graphs import game24_task as task
from spec_tot.graphs.game24 import compile_game24, game24_inputs

TREE_SEARCHES: dict[str, dict[str, Any]] = {
    "rebase-w8": {"search": "rebase", "params": {"width": 8, "max_depth": 3}},
    "beam-n8-w4": {"search": "beam", "params": {"n": 8, "width": 4, "max_depth": 3}},
    "tot_bfs-b5-w8": {"search": "tot_bfs", "params": {"breadth": 5, "width": 8, "max_depth": 3}},
    "rebase-w32": {"search": "rebase", "params": {"width": 32, "max_depth": 3}},
}


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    folder = task.asset_dir()
    backend = create_local(
        policy_path=str(folder / "policy"),
        prm_path=str(folder / "prm"),
        max_num_seqs=256,
        num_kv_blocks=4096,
    )
    inputs = game24_inputs(args.queries)
    rows: list[dict[str, Any]] = []

    async def one(label: str, search: str, params: dict[str, Any], temperature: float) -> None:
        app = compile_game24(
            search=search,
            search_params=params,
            temperature=temperature,
            backend=backend,
            config=ExecutorConfig(mode="baseline", seed=args.seed, max_concurrency=32),
        )
        batch = await app.arun_batch(inputs)
        m = batch.metrics
        rows.append(
            {
                "method": label,
                "search": search,
                "params": params,
                "temperature": temperature,
                "queries": m.queries,
                "solved": m.solved,
                "solve_rate": m.accuracy,
                "output_tokens": m.output_tokens,
                "tokens_per_query": m.output_tokens / m.queries,
                "wall_s": m.wall_s,
            }
        )
        print(
            f"{label:16s} solved {m.solved}/{m.queries} ({m.accuracy:.0%}) "
            f"tokens/query {m.output_tokens / m.queries:.0f}",
            flush=True,
        )

    try:
        await one("greedy", "best_of_n", {"n": 1, "max_depth": 3, "vote": "best"}, 0.0)
        for label, spec in TREE_SEARCHES.items():
            await one(label, spec["search"], spec["params"], args.temperature)
        # Best-of-N at (at least) each tree search's token budget.
        trace = next(r for r in rows if r["method"] == "greedy")["tokens_per_query"]
        budgets = [r["tokens_per_query"] for r in rows if r["method"] in TREE_SEARCHES]
        for n in sorted({max(1, math.ceil(b / max(trace, 1.0))) for b in budgets}):
            params = {"n": n, "max_depth": 3, "vote": "best"}
            await one(f"best-of-{n}", "best_of_n", params, args.temperature)
    finally:
        await backend.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = asyncio.run(_run(args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    bons = [r for r in rows if r["method"].startswith("best-of-")]
    pairs = []
    for tree in (r for r in rows if r["method"] in TREE_SEARCHES):
        # the cheapest best-of-N that spends at least this search's tokens
        match = min(
            (b for b in bons if b["tokens_per_query"] >= 0.95 * tree["tokens_per_query"]),
            key=lambda b: b["tokens_per_query"],
            default=max(bons, key=lambda b: b["tokens_per_query"]),
        )
        pairs.append(
            f"{tree['method']} {tree['solve_rate']:.0%} @{tree['tokens_per_query']:.0f} tok "
            f"vs {match['method']} {match['solve_rate']:.0%} @{match['tokens_per_query']:.0f} tok"
        )
    greedy = next(r for r in rows if r["method"] == "greedy")
    print(
        f"summary (ranks 901-{900 + greedy['queries']}, greedy {greedy['solve_rate']:.0%}): "
        + "; ".join(pairs)
    )


if __name__ == "__main__":
    main()
