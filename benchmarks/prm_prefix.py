"""PRM prefix reuse: the cost of scoring a trace's next step when its prefix was scored,
as a share of scoring the whole trace.

Shipped Game-of-24 PRM, real puzzles (ranks 901-1000) with random legal 3-step traces
(``--numbers 7``: 6-step traces of the same format). Per round and batch size: a fresh
scorer scores the whole traces (nothing cached), and a second fresh scorer scores all but
the last step (not timed), then the whole traces (timed: only the last step is
computed). CPU seconds, best of ``--repeats`` rounds each, rounds interleaved; also the
tokens each run computed. JSON via ``--json PATH``, one summary line.

    python benchmarks/prm_prefix.py --json /tmp/prm_prefix.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import torch

from spec_tot.adapters.local.engine.prm import PrmScorer
from spec_tot.graphs import game24_task as task
from spec_tot.requests import RewardItem

__all__ = ["main"]


def _traces(count: int, seed: int, numbers: int = 4) -> list[RewardItem]:
    """Random legal traces down to one number: test-range puzzles for 4 numbers, random
    numbers 1..13 for more (longer traces, same step format)."""
    rng = random.Random(seed)
    puzzles = task.load_puzzles(*task.TEST_RANKS)
    out = []
    for i in range(count):
        if numbers == 4:
            question = rng.choice(puzzles).text
        else:
            question = " ".join(str(rng.randint(1, 13)) for _ in range(numbers))
        left: Any = question
        steps = []
        for _ in range(numbers - 1):
            step = rng.choice(task.legal_steps(left))
            steps.append(step)
            left = task.apply_step(left, step)
        out.append(RewardItem(f"t{i}", question, tuple(steps)))
    return out


def _cpu(scorer: PrmScorer, items: list[RewardItem]) -> float:
    start = time.process_time()
    scorer.score(items)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--numbers", type=int, default=4, help="numbers a puzzle (steps = numbers - 1)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = task.asset_dir("prm")
    results: dict[str, dict[str, float]] = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        best = {"whole": float("inf"), "next": float("inf")}
        tokens = {}
        for rep in range(args.repeats):
            items = _traces(batch, seed=1000 * batch + rep, numbers=args.numbers)
            prefixes = [RewardItem(i.request_id, i.question, i.steps[:-1]) for i in items]
            whole = PrmScorer(path, "cpu", torch.float32)
            whole.score(_traces(2, seed=-1 - rep))  # warm-up on other traces
            before = whole.num_computed_tokens
            best["whole"] = min(best["whole"], _cpu(whole, items))
            tokens["whole"] = whole.num_computed_tokens - before
            nxt = PrmScorer(path, "cpu", torch.float32)
            nxt.score(_traces(2, seed=-1 - rep))
            nxt.score(prefixes)
            before = nxt.num_computed_tokens
            best["next"] = min(best["next"], _cpu(nxt, items))
            tokens["next"] = nxt.num_computed_tokens - before
        results[str(batch)] = {
            "whole_s": round(best["whole"], 5),
            "next_step_s": round(best["next"], 5),
            "cost_share": round(best["next"] / best["whole"], 3),
            "whole_tokens": float(tokens["whole"]),
            "next_step_tokens": float(tokens["next"]),
        }
        print(f"batch {batch:3d}: {results[str(batch)]}", flush=True)
    summary = {
        "results": results,
        "steps": args.numbers - 1,
        "repeats": args.repeats,
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    line = ", ".join(f"batch {b}: {r['cost_share']:.0%}" for b, r in results.items())
    print(f"PRM next step, prefix scored / whole trace (CPU s, best of {args.repeats}): {line}")


if __name__ == "__main__":
    main()
