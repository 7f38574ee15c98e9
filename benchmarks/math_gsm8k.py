"""GSM8K with a real chat model on the embedded engine: accuracy per search, and the
executor modes' queries/s on the same problems.

``accuracy``: the first ``--problems`` GSM8K test problems, SmolLM2-135M-Instruct (from
``scripts/fetch_smollm2.py``) on the embedded engine, the math program
(``spec_tot.graphs.math``) with the policy judging itself; per method: solved, accuracy with
a 90% Wilson interval, generated tokens per problem, wall seconds.

- greedy: one chain, temperature 0 (``best_of_n`` n=1);
- best_of_8: 8 chains, the best by the judge's score (``best_of_n`` n=8, vote "best");
- beam: ``beam`` n=8, width 4;  rebase: ``rebase`` width 8.

``modes``: ``--mode-problems`` problems, one search, ``baseline`` / ``dedup`` / ``full``
over ``--rounds`` interleaved rounds (``spec_tot.rounds``): queries/s, the ratios to
``dedup`` with intervals, and whether each mode's answers are the same in every round.

``drafter``: token speculation's prompt-lookup drafter on these texts: ``full`` on
``--mode-problems`` problems with no drafter (``ngram_max=0``, the default) and with
prompt lookup (``ngram_max`` 4, n-grams of 2..4 tokens), each run on a fresh engine, over
``--rounds`` interleaved rounds: queries/s (ratio to no drafter), drafted and accepted
tokens, the acceptance rate, and whether the answers are the same.

    python benchmarks/math_gsm8k.py accuracy --problems 100 --json results/math_gsm8k_accuracy.json
    python benchmarks/math_gsm8k.py modes --mode-problems 10 --rounds 3 --json ...
    python benchmarks/math_gsm8k.py modes --method beam --mode-problems 8 --concurrency 4 \
        --modes dedup,full --rounds 5 --json ...
    python benchmarks/math_gsm8k.py drafter --mode-problems 8 --rounds 3 --json ...
    python benchmarks/math_gsm8k.py weights --methods greedy,beam --mode-problems 16 --json ...

``weights``: the accuracy cost of the GGUF's quantized weights (``EngineConfig.weights``,
``"auto"`` runs them for SmolLM2 on the CPU) against the float weights: ``full`` on
``--mode-problems`` problems per method, each weights on a fresh engine: solved, queries/s
and every problem whose answer differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from typing import Any

from spec_tot.backends import default_registry
from spec_tot.config import ExecutorConfig
from spec_tot.graphs.math import PROGRAM, compile_math, math_inputs
from spec_tot.rounds import Run, schedule_rounds, summarize_rounds, summary_line

__all__ = ["DRAFTERS", "METHODS", "main", "wilson"]

METHODS: dict[str, tuple[str, dict[str, Any], float]] = {
    "greedy": ("best_of_n", {"n": 1, "max_depth": 10, "vote": "best"}, 0.0),
    "best_of_8": ("best_of_n", {"n": 8, "max_depth": 10, "vote": "best"}, 0.7),
    "beam": ("beam", {"n": 8, "width": 4, "max_depth": 10}, 0.7),
    "rebase": ("rebase", {"width": 8, "max_depth": 10}, 0.7),
}


def wilson(k: int, n: int, z: float = 1.645) -> tuple[float, float]:
    """The Wilson score interval of k successes in n (z=1.645: 90%)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


async def _run(
    backend: Any, method: str, problems: int, mode: str, seed: int, concurrency: int = 0
) -> dict[str, Any]:
    search, params, temperature = METHODS[method]
    config = ExecutorConfig(mode=mode, seed=seed, max_concurrency=concurrency or problems)
    app = compile_math(backend=backend, search=search, search_params=params,
                       temperature=temperature, config=config)  # fmt: skip
    await backend.flush_prefix_cache()
    start = time.perf_counter()
    batch = await app.arun_batch(math_inputs(problems))
    wall = time.perf_counter() - start
    m = batch.metrics
    return {"method": method, "mode": mode, "problems": problems, "solved": m.solved,
            "wall_s": wall, "queries_per_s": problems / wall,
            "tokens_per_problem": m.output_tokens / problems,
            "speculative_nodes": m.speculative_nodes, "speculative_hits": m.speculative_hits,
            "answers": [r.answer for r in batch.results]}  # fmt: skip


async def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    backend = default_registry().create("local", **PROGRAM.backend_options("local"))
    rows = []
    try:
        for method in args.methods.split(","):
            row = await _run(backend, method, args.problems, "full", args.seed)
            lo, hi = wilson(row["solved"], args.problems)
            row.update(accuracy=row["solved"] / args.problems, interval90=[lo, hi])
            print(f"{method}: {row['solved']}/{args.problems} [{lo:.2f}, {hi:.2f}] "
                  f"{row['tokens_per_problem']:.0f} tok/problem {row['wall_s']:.0f} s",
                  flush=True)  # fmt: skip
            rows.append(row)
    finally:
        await backend.aclose()
    summary = "; ".join(f"{r['method']} {r['solved']}/{r['problems']} "
                        f"[{r['interval90'][0]:.2f}, {r['interval90'][1]:.2f}]"
                        for r in rows)  # fmt: skip
    return {"rows": rows, "summary": f"GSM8K accuracy (90% Wilson): {summary}"}


async def modes(args: argparse.Namespace) -> dict[str, Any]:
    backend = default_registry().create("local", **PROGRAM.backend_options("local"))
    runs: list[Run] = []
    try:
        for rnd, mode in schedule_rounds(args.modes.split(","), args.rounds, args.seed):
            row = await _run(
                backend, args.method, args.mode_problems, mode, args.seed, args.concurrency
            )
            print(f"round {rnd} {mode}: {row['queries_per_s']:.3f} q/s "
                  f"{row['solved']} solved", flush=True)  # fmt: skip
            runs.append(Run(rnd, mode, row))
    finally:
        await backend.aclose()
    control, in_flight = args.modes.split(",")[0], args.concurrency or args.mode_problems
    cells = summarize_rounds(runs, lambda m: None if m == control else control)
    answers = {m: {tuple(r.figures["answers"]) for r in runs if r.cell == m and r.round}
               for m in cells}  # fmt: skip
    return {"runs": [{"round": r.round, **r.figures} for r in runs],
            "cells": {k: v.to_dict() for k, v in cells.items()},
            "same_answers_every_round": {m: len(a) == 1 for m, a in answers.items()},
            "same_answers_across_modes": len(set().union(*answers.values())) == 1,
            "summary": f"{args.method} x{args.mode_problems} @{in_flight}: "
                       f"{summary_line(cells)}"}  # fmt: skip


DRAFTERS: dict[str, dict[str, Any]] = {"none": {}, "lookup": {"ngram_max": 4, "ngram_min": 2}}


async def drafter(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[Run] = []
    for rnd, name in schedule_rounds(list(DRAFTERS), args.rounds, args.seed):
        options = {**PROGRAM.backend_options("local"), **DRAFTERS[name]}
        backend = default_registry().create("local", **options)
        try:
            row = await _run(backend, args.method, args.mode_problems, "full", args.seed)
            stats = backend.stats()
        finally:
            await backend.aclose()
        drafted, accepted = (
            stats.get("num_draft_tokens", 0.0),
            stats.get("num_accepted_tokens", 0.0),
        )
        row.update(drafter=name, draft_tokens=drafted, accepted_tokens=accepted,
                   acceptance=accepted / drafted if drafted else None)  # fmt: skip
        print(f"round {rnd} {name}: {row['queries_per_s']:.3f} q/s, drafted {drafted:.0f}, "
              f"accepted {accepted:.0f}", flush=True)  # fmt: skip
        runs.append(Run(rnd, name, row))
    cells = summarize_rounds(runs, lambda m: None if m == "none" else "none")
    measured = [r.figures for r in runs if r.round and r.cell == "lookup"]
    drafted = sum(f["draft_tokens"] for f in measured)
    accepted = sum(f["accepted_tokens"] for f in measured)
    answers = {tuple(r.figures["answers"]) for r in runs if r.round}
    rate = accepted / drafted if drafted else 0.0
    return {"runs": [{"round": r.round, **r.figures} for r in runs],
            "cells": {k: v.to_dict() for k, v in cells.items()},
            "lookup_drafted": drafted, "lookup_accepted": accepted, "lookup_acceptance": rate,
            "same_answers": len(answers) == 1,
            "summary": f"{args.method} x{args.mode_problems} prompt lookup: acceptance "
                       f"{rate:.2f} ({accepted:.0f}/{drafted:.0f}); "
                       f"{summary_line(cells)}"}  # fmt: skip


async def weights(args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for method in args.methods.split(","):
        for kind in ("float", "gguf"):
            options = {**PROGRAM.backend_options("local"), "weights": kind}
            backend = default_registry().create("local", **options)
            try:
                row = await _run(backend, method, args.mode_problems, "full", args.seed)
            finally:
                await backend.aclose()
            print(f"{method} {kind}: {row['solved']}/{args.mode_problems} solved, "
                  f"{row['queries_per_s']:.3f} q/s", flush=True)  # fmt: skip
            rows[f"{method}/{kind}"] = row
    parts, differences = [], {}
    for method in args.methods.split(","):
        fl, gg = rows[f"{method}/float"], rows[f"{method}/gguf"]
        differ = [{"problem": i, "float": a, "gguf": b}
                  for i, (a, b) in enumerate(zip(fl["answers"], gg["answers"], strict=True))
                  if a != b]  # fmt: skip
        differences[method] = differ
        parts.append(f"{method}: solved {fl['solved']} float vs {gg['solved']} gguf, "
                     f"{len(differ)}/{args.mode_problems} answers differ, "
                     f"{gg['queries_per_s'] / fl['queries_per_s']:.2f}x q/s (one run)")  # fmt: skip
    head = f"GGUF vs float weights, x{args.mode_problems}: "
    return {"rows": rows, "differences": differences, "summary": head + "; ".join(parts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["accuracy", "modes", "drafter", "weights"])
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--method", default="rebase", choices=list(METHODS))
    ap.add_argument("--mode-problems", type=int, default=10)
    ap.add_argument("--modes", default="dedup,baseline,full", help="the first: the control")
    ap.add_argument("--concurrency", type=int, default=0, help="in flight (0: every problem)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    job = {"accuracy": accuracy, "modes": modes, "drafter": drafter, "weights": weights}[args.what]
    result = asyncio.run(job(args))
    result["config"] = vars(args)
    print(result["summary"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
