"""Executor modes x policies x concurrency on the embedded engine, Game of 24 (ranks 901+).

One process, the same shipped models, the same seeds and the same engine configuration for
every variant; each mode's queries/s is reported as a ratio to ``baseline`` at the same
policy, concurrency and seed (the denominator). Engine-level computation dedup follows each
mode's ``dedup`` switch (two engines are built: CD on and CD off).

    python benchmarks/game24_modes.py --policies rebase,beam,rstar --modes baseline,full \
        --concurrency 1,32 --queries 8 --json runs.json --png runs.png

Writes the ``spec-tot bench`` JSON row format plus a one-line summary; ``--ablation`` adds
runs of ``full`` with one technique switched off at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import torch

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
    "full-LVdefer": {"lv": {"defer_speculative": False}},
}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", default="rebase,beam,rstar")
    parser.add_argument("--modes", default="baseline,naive,spex,specscale,full")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--queries", type=int, default=8, help="queries per run at conc. 1")
    parser.add_argument("--queries-loaded", type=int, default=32, help="queries per run above 1")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--ablation", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    return parser.parse_args()


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    folder = task.asset_dir()
    common = {
        "policy_path": str(folder / "policy"),
        "prm_path": str(folder / "prm"),
        "max_num_seqs": 256,
        "num_kv_blocks": 4096,
    }
    probe = create_local(**common)
    saturation = probe.capabilities.saturation_batch  # measured once, shared by all runs
    await probe.aclose()
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
                        metrics = batch.metrics.to_dict()
                        engine = _delta(before, backend.stats())
                        rows.append(
                            {
                                "mode": label,
                                "search": policy,
                                "backend": "local",
                                "concurrency": conc,
                                "seed": seed,
                                "saturation_batch": saturation,
                                "metrics": metrics,
                                "engine": engine,
                            }
                        )
                        print(_line(rows[-1]), flush=True)
    finally:
        for engine in engines.values():
            await engine.aclose()
    return rows


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
    return (
        f"{row['search']:9s} {row['mode']:10s} c={row['concurrency']:<3d} seed={row['seed']} "
        f"acc={m['accuracy']:.2f} q/s={m['queries_per_s']:.3f} tok/s={m['tokens_per_s']:.0f} "
        f"hit={m['spec_hit_rate']:.2f} wasted={m['wasted_tokens']} "
        f"reward_batch_tok={m['reward_batch_tokens_mean']:.0f} "
        f"cpu_us/tok={m['executor_cpu_us_per_token']:.0f} "
        f"step_ms={engine['mean_step_ms']:.2f} executor/step_time={overhead:.1%}"
    )


def summary(rows: list[dict[str, Any]]) -> str:
    """Mean over seeds of each variant's queries/s ratio to baseline (same policy, conc.)."""
    base = {
        (r["search"], r["concurrency"], r["seed"]): r["metrics"]["queries_per_s"]
        for r in rows
        if r["mode"] == "baseline"
    }
    ratios: dict[tuple[str, str, int], list[float]] = {}
    for r in rows:
        denom = base.get((r["search"], r["concurrency"], r["seed"]))
        if denom and r["mode"] != "baseline":
            key = (r["search"], r["mode"], r["concurrency"])
            ratios.setdefault(key, []).append(r["metrics"]["queries_per_s"] / denom)
    parts = [f"{s}/{m}@{c}: {statistics.mean(v):.2f}x" for (s, m, c), v in sorted(ratios.items())]
    return "summary (queries/s vs baseline, same policy+concurrency+seeds): " + "; ".join(parts)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = sorted({r["search"] for r in rows})
    fig, axes = plt.subplots(1, len(policies), figsize=(5 * len(policies), 4), squeeze=False)
    for ax, policy in zip(axes[0], policies, strict=True):
        for mode in sorted({r["mode"] for r in rows}):
            points = sorted(
                (r["concurrency"], r["metrics"]["queries_per_s"])
                for r in rows
                if r["search"] == policy and r["mode"] == mode and r["seed"] == rows[0]["seed"]
            )
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=mode)
        ax.set(title=f"{policy} (embedded engine, CPU)", xlabel="concurrent queries")
        ax.set(ylabel="queries/s (higher is better)", xscale="log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    args = _args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = asyncio.run(_run(args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.png:
        plot(rows, args.png)
    print(summary(rows))


if __name__ == "__main__":
    main()
