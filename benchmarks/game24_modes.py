"""Executor modes x policies x concurrency on the embedded engine, Game of 24 (ranks 901+).

One process, the same shipped models, the same seeds and the same engine configuration for
every variant; variants of one (seed, policy, concurrency) run back to back, so a ratio
compares runs a few seconds apart. Engine-level computation dedup follows each mode's
``dedup`` switch (two engines are built: CD on and CD off). Every speedup is reported
against three denominators of the same policy, concurrency and seed: ``baseline`` (no
speculation, no dedup), ``dedup`` (baseline with dedup: the honest control) and ``naive``.
At concurrency 1 each policy also gets its critical-path bound (``critical_path.py``: from
the baseline's trees and the engine's step-cost curve measured at the start of the run) and
each mode its achieved / bound.

    python benchmarks/game24_modes.py --policies beam,rebase,rstar,rest_mcts \\
        --modes baseline,dedup,naive,full --concurrency 1,32 --seeds 0,1,2 \\
        --queries 8 --queries-loaded 32 --json runs.json --png runs.png
    python benchmarks/game24_modes.py --smoke     # CI-sized: one policy, 2 queries, 1 seed

JSON: {"runs": [rows in the ``spec-tot bench`` format plus "engine" counters and, for
baseline rows at concurrency 1, "bound"], "costs": the measured step-cost curve and reward
latencies, "summary": the one-line summary}. ``--ablation`` adds ``full`` with one technique
switched off at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from critical_path import Costs, add_bounds, measure_costs, tree_bound

from spec_tot.adapters.local import create_local
from spec_tot.config import ExecutorConfig
from spec_tot.graphs import game24_task as task
from spec_tot.graphs.game24 import compile_game24, game24_inputs

ABLATIONS: dict[str, dict[str, Any]] = {
    "full-T1": {"speculate": "off"},
    "full-T2": {"budget": False},
    "full-EP": {"ep": False},
    "full-CD": {"dedup": False},
    "full-LV": {"lv": None},
    "full-LVidle": {"lv": {"idle_flush": False}},
    "full-depth1": {"max_spec_depth": 1},
}
DENOMINATORS = ("baseline", "dedup", "naive")


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", default="beam,rebase,rstar,rest_mcts")
    parser.add_argument("--modes", default="baseline,dedup,naive,full")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--queries", type=int, default=8, help="queries per run at conc. 1")
    parser.add_argument("--queries-loaded", type=int, default=32, help="queries per run above 1")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--ablation", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="beam, 2 queries, conc. 1, seed 0")
    parser.add_argument(
        "--saturation",
        choices=("engine", "curve"),
        default="engine",
        help="the T2 capacity: the engine's own calibration, or the largest batch whose "
        "measured full step time is within 1.25x batch 1's (where speculation is nearly free)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--summarize", type=Path, help="print the summary of a saved --json")
    args = parser.parse_args()
    if args.smoke:
        args.policies, args.concurrency, args.seeds = "beam", "1", "0"
        args.queries = args.queries_loaded = 2
    return args


async def _run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], Costs]:
    folder = task.asset_dir()
    common = {
        "policy_path": str(folder / "policy"),
        "prm_path": str(folder / "prm"),
        "max_num_seqs": 256,
        "num_kv_blocks": 4096,
    }
    probe = create_local(**common)
    saturation = probe.capabilities.saturation_batch  # measured once, shared by all runs
    costs = await measure_costs(probe)
    await probe.aclose()
    if args.saturation == "curve":
        saturation = costs.nearly_free_batch()
    print("costs:", json.dumps(costs.to_dict()), "saturation_batch:", saturation, flush=True)
    engines = {
        dedup: create_local(**common, enable_dedup=dedup, saturation_batch=saturation)
        for dedup in (False, True)
    }
    variants: list[tuple[str, str, dict[str, Any]]] = [
        (m, m, {}) for m in args.modes.split(",") if m
    ]
    if args.ablation:
        variants += [(label, "full", over) for label, over in ABLATIONS.items()]
    rows: list[dict[str, Any]] = []
    try:
        for seed in (int(s) for s in args.seeds.split(",")):
            for policy in args.policies.split(","):
                for conc in (int(c) for c in args.concurrency.split(",")):
                    queries = args.queries if conc == 1 else args.queries_loaded
                    for label, mode, overrides in variants:
                        config = ExecutorConfig(
                            mode=mode,
                            seed=seed,
                            max_concurrency=conc,
                            speculation_overrides=overrides,
                        )
                        backend = engines[config.speculation.dedup]
                        app = compile_game24(search=policy, backend=backend, config=config)
                        before = backend.stats()
                        batch = await app.arun_batch(game24_inputs(queries))
                        row = {
                            "mode": label,
                            "search": policy,
                            "backend": "local",
                            "concurrency": conc,
                            "seed": seed,
                            "saturation_batch": saturation,
                            "metrics": batch.metrics.to_dict(),
                            "engine": _delta(before, backend.stats()),
                        }
                        if label == "baseline" and conc == 1:
                            bounds = [tree_bound(r.tree, costs) for r in batch.results]
                            row["bound"] = add_bounds(bounds)
                        rows.append(row)
                        print(_line(row), flush=True)
    finally:
        for engine in engines.values():
            await engine.aclose()
    return rows, costs


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Engine counters of one run, and the executor's CPU time as a share of the engine's
    step time (the executor-overhead figure)."""
    keys = ("num_steps", "num_decode_steps", "num_generated_tokens", "step_seconds")
    out = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}
    out["mean_step_ms"] = 1e3 * out["step_seconds"] / max(out["num_steps"], 1.0)
    return out


def _line(row: dict[str, Any]) -> str:
    m = row["metrics"]
    engine = row["engine"]
    overhead = m["executor_cpu_s"] / max(engine["step_seconds"], 1e-9)
    bound = f" bound_s={row['bound']['bound_s']:.2f}" if "bound" in row else ""
    return (
        f"{row['search']:9s} {row['mode']:11s} c={row['concurrency']:<3d} seed={row['seed']} "
        f"acc={m['accuracy']:.2f} q/s={m['queries_per_s']:.3f} wall={m['wall_s']:.2f} "
        f"hit={m['spec_hit_rate']:.2f} wasted={m['wasted_tokens']} "
        f"reward_calls={m['reward_calls']} step_ms={engine['mean_step_ms']:.2f} "
        f"executor/step_time={overhead:.1%}{bound}"
    )


def summary(rows: list[dict[str, Any]]) -> str:
    """Means over seeds: each mode's queries/s over each denominator (same policy,
    concurrency and seed), achieved / bound at concurrency 1, accuracy per seed, and the
    executor's CPU share of engine step time at the highest concurrency."""
    by_key = {(r["search"], r["concurrency"], r["seed"], r["mode"]): r for r in rows}
    parts: list[str] = []
    for policy in sorted({r["search"] for r in rows}):
        for conc in sorted({r["concurrency"] for r in rows if r["search"] == policy}):
            seeds = sorted({r["seed"] for r in rows if r["search"] == policy})
            modes = [r["mode"] for r in rows if (r["search"], r["concurrency"], r["seed"]) ==
                     (policy, conc, seeds[0])]  # fmt: skip
            for mode in modes:
                ratios = []
                for denom in DENOMINATORS:
                    vals = [
                        by_key[(policy, conc, s, mode)]["metrics"]["queries_per_s"]
                        / by_key[(policy, conc, s, denom)]["metrics"]["queries_per_s"]
                        for s in seeds
                        if (policy, conc, s, denom) in by_key and (policy, conc, s, mode) in by_key
                    ]
                    if vals and denom != mode:
                        ratios.append(f"{statistics.mean(vals):.2f}x/{denom}")
                bound = [
                    by_key[(policy, 1, s, "baseline")]["bound"]["bound_s"]
                    / by_key[(policy, 1, s, mode)]["metrics"]["wall_s"]
                    for s in seeds
                    if conc == 1
                    and "bound" in by_key.get((policy, 1, s, "baseline"), {})
                    and (policy, 1, s, mode) in by_key
                ]
                achieved = f" achieved/bound {statistics.mean(bound):.2f}" if bound else ""
                acc = ",".join(
                    f"{by_key[(policy, conc, s, mode)]['metrics']['accuracy']:.2f}"
                    for s in seeds
                    if (policy, conc, s, mode) in by_key
                )
                parts.append(
                    f"{policy}/{mode}@{conc}: {' '.join(ratios) or '-'}{achieved} acc[{acc}]"
                )
    top = max(r["concurrency"] for r in rows)
    cpu = [
        r["metrics"]["executor_cpu_s"] / max(r["engine"]["step_seconds"], 1e-9)
        for r in rows
        if r["concurrency"] == top and r["mode"] == "full"
    ]
    tail = f"; executor CPU / engine step time at {top} concurrent (full): max {max(cpu):.1%}"
    return (
        "summary (queries/s ratios, mean of seeds; accuracy per seed): "
        + "; ".join(parts)
        + (tail if cpu else "")
        + chain_steps(rows)
    )


def chain_steps(rows: list[dict[str, Any]]) -> str:
    """At one query, summed over seeds: the dependency chain's engine steps as a share of
    the baseline's steps (what no overlap can remove), each mode's steps over the chain's
    (1.0: every off-chain step removed), and its mean step time (what wider batches cost)."""
    parts = []
    for policy in sorted({r["search"] for r in rows}):
        one = [r for r in rows if r["search"] == policy and r["concurrency"] == 1]
        base = [r for r in one if r["mode"] == "baseline" and r.get("bound")]
        if not base:
            continue
        chain = sum(r["bound"]["chain_steps"] for r in base)
        share = chain / max(sum(r["engine"]["num_steps"] for r in base), 1.0)
        modes = []
        for mode in dict.fromkeys(r["mode"] for r in one):
            runs = [r for r in one if r["mode"] == mode]
            steps = sum(r["engine"]["num_steps"] for r in runs)
            ms = 1e3 * sum(r["engine"]["step_seconds"] for r in runs) / max(steps, 1.0)
            modes.append(f"{mode} {steps / chain:.2f} ({ms:.1f} ms/step)")
        parts.append(f"{policy}: chain {share:.0%} of baseline's steps; " + ", ".join(modes))
    return "; engine steps over the chain's at one query: " + "; ".join(parts) if parts else ""


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = sorted({r["search"] for r in rows})
    fig, axes = plt.subplots(1, len(policies), figsize=(5 * len(policies), 4), squeeze=False)
    for ax, policy in zip(axes[0], policies, strict=True):
        for mode in sorted({r["mode"] for r in rows}):
            points: dict[int, list[float]] = {}
            for r in rows:
                if r["search"] == policy and r["mode"] == mode:
                    points.setdefault(r["concurrency"], []).append(r["metrics"]["queries_per_s"])
            if points:
                xs = sorted(points)
                ax.plot(xs, [statistics.mean(points[x]) for x in xs], marker="o", label=mode)
        ax.set(title=f"{policy} (embedded engine, CPU)", xlabel="concurrent queries")
        ax.set(ylabel="queries/s, mean of seeds", xscale="log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    args = _args()
    if args.summarize:
        print(summary(json.loads(args.summarize.read_text())["runs"]))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, costs = asyncio.run(_run(args))
    line = summary(rows)
    if args.json:
        payload = {"runs": rows, "costs": costs.to_dict(), "summary": line}
        args.json.write_text(json.dumps(payload, indent=1))
    if args.png:
        plot(rows, args.png)
    print(line)


if __name__ == "__main__":
    main()
