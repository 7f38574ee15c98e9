"""Executor modes on the simulated GPU (``spec_tot.adapters.sim``), all in virtual time.

Modes (baseline, dedup, naive, spex, specscale, full) x searches (beam n=8 width 4, REBASE, ETS,
rStar MCTS, REST-MCTS*) x concurrency (1, 4, 16, 32, 64) on one preset (A100 80GB + a
Qwen2.5-7B policy + a 7B PRM on the same card), same seeds everywhere. The sim's CD switch
(``engine_dedup``) follows the mode's ``dedup`` switch. Also an ablation at 8 beams,
concurrency 32 (SpecScale's Figure 13 setting) and at concurrency 1 (SPEX's single-query
setting).

    python benchmarks/sim.py --json /tmp/sim.json --png /tmp/sim.png

Output: JSON rows in the ``spec-tot bench`` format ({"mode", "search", "backend",
"concurrency", "seed", "metrics"} plus "sim": engine counters), a PNG of useful tokens/s
(generated minus wasted) and queries/s vs concurrency per mode, the ablation tables and one
summary line of queries/s ratios against three named denominators (baseline, dedup and naive,
same search and concurrency). Same queries in every variant, so queries/s compares equal
work. ``--quick`` runs the issue's acceptance points only (one query for every search; beam
n=8 width 4 ablation at 32 queries).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from typing import Any

from spec_tot.adapters.sim import SimBackend, SimConfig, run_virtual
from spec_tot.config import ExecutorConfig
from spec_tot.graph import State
from spec_tot.graphs.toy import ANSWER_PREFIX, build_toy_graph, toy_questions

__all__ = ["ABLATION", "SEARCHES", "main", "run_one"]

SEARCHES: dict[str, tuple[str, dict[str, Any]]] = {
    "beam": ("beam", {"n": 8, "width": 4}),
    "rebase": ("rebase", {}),
    "ets": ("ets", {}),
    "rstar": ("rstar", {}),
    "rest_mcts": ("rest_mcts", {}),
}
MODES = ("baseline", "dedup", "naive", "spex", "specscale", "full")
DENOMINATORS = ("baseline", "dedup", "naive")
# SpecScale's cumulative ablation (Figure 13: EP, EP+CD, EP+CD+LV on naive speculation) and
# SPEX's (T1 ranked speculation, + T2 budget, + T3 early termination).
ABLATION: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("baseline", "baseline", {}),
    ("dedup (baseline+CD, no speculation)", "dedup", {}),
    ("naive", "naive", {}),
    ("EP", "specscale", {"dedup": False, "lv": None}),
    ("EP+CD", "specscale", {"lv": None}),
    ("EP+CD+LV (specscale)", "specscale", {}),
    ("specscale, LV deferring speculation", "specscale", {"lv": {"defer_speculative": True}}),
    ("SPEX T1", "spex", {"budget": False}),
    ("SPEX T1+T2 (spex)", "spex", {}),
    ("SPEX T1+T2+T3", "spex", {"early_termination": True}),
    ("full", "full", {}),
    ("full - budget", "full", {"budget": False}),
    ("full, LV idle rule off", "full", {"lv": {"idle_flush": False}}),
)


def _answer(state: State) -> str | None:
    steps = state["steps"]
    if steps and str(steps[-1]).startswith(ANSWER_PREFIX):
        return str(steps[-1][len(ANSWER_PREFIX) :])
    return None


def _check(state: State, answer: str | None) -> bool:
    return answer is not None and answer == str(state.get("target", "24"))


def run_one(
    *,
    preset: str,
    mode: str,
    search: str,
    concurrency: int,
    queries: int,
    seed: int,
    overrides: Mapping[str, Any] | None = None,
    sim_overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One run on a fresh simulated GPU; returns a ``spec-tot bench`` row."""
    config = ExecutorConfig(
        mode=mode, seed=seed, max_concurrency=concurrency, speculation_overrides=overrides or {}
    )
    sim = SimConfig.preset(
        preset, seed=seed, engine_dedup=config.speculation.dedup, **(sim_overrides or {})
    )
    backend = SimBackend(sim)
    policy, params = SEARCHES[search]
    # Steps up to 1024 tokens: the toy default (64) would cut the straggler tail.
    app = build_toy_graph(max_tokens=1024).compile(
        answer=_answer, check=_check, backend=backend, search=policy, search_params=params,
        config=config,
    )  # fmt: skip

    async def go() -> Any:
        try:
            return await app.arun_batch(toy_questions(queries))
        finally:
            await backend.aclose()

    started = time.perf_counter()
    batch = run_virtual(go())
    st = backend.stats()
    wall = max(batch.metrics.wall_s, 1e-9)
    return {
        "mode": mode,
        "search": search,
        "backend": f"sim:{preset}",
        "concurrency": concurrency,
        "seed": seed,
        "overrides": {k: v for k, v in (overrides or {}).items()},
        "metrics": batch.metrics.to_dict(),
        "sim": {
            "real_s": time.perf_counter() - started,
            "decode_share": st["decode_busy_s"] / wall,
            "prm_share": st["prm_busy_s"] / wall,
            "prm_calls": st["prm_calls"],
            "prm_tokens": st["prm_tokens"],
            "mean_batch": st["mean_batch"],
            "mean_logical_batch": st["mean_logical_batch"],
            "peak_running": st["peak_running"],
            "peak_kv_tokens": st["peak_kv_tokens"],
            "dedup_saved_tokens": st["dedup_saved_tokens"],
            "preemptions": st["preemptions"],
            "inflight_after": backend.num_inflight,
        },
    }


def _queries(concurrency: int, per_slot: int, minimum: int) -> int:
    return max(minimum, per_slot * concurrency)


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    searches = sorted({r["search"] for r in rows}, key=list(SEARCHES).index)
    fig, axes = plt.subplots(2, len(searches), figsize=(4 * len(searches), 7), squeeze=False)
    for col, search in enumerate(searches):
        for mode in MODES:
            pts = sorted(
                (r["concurrency"], r["metrics"]) for r in rows
                if r["search"] == search and r["mode"] == mode and not r["overrides"]
            )  # fmt: skip
            if not pts:
                continue
            xs = [c for c, _ in pts]
            axes[0][col].plot(
                xs, [m["useful_tokens_per_s"] for _, m in pts], marker="o", label=mode
            )
            axes[1][col].plot(xs, [m["queries_per_s"] for _, m in pts], marker="o", label=mode)
        axes[0][col].set_title(search)
        for row, label in ((0, "useful tokens/s"), (1, "queries/s")):
            axes[row][col].set_xscale("log", base=2)
            axes[row][col].set_xlabel("concurrency")
            axes[row][col].set_ylabel(label)
    axes[0][0].legend()
    fig.suptitle("spec-tot executor modes on the simulated A100 (virtual time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="a100-80gb-7b")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--searches", default=",".join(SEARCHES))
    parser.add_argument("--concurrency", default="1,4,16,32,64")
    parser.add_argument("--per-slot", type=int, default=2, help="queries per concurrency slot")
    parser.add_argument("--min-queries", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sim", action="append", default=[], help="SimConfig KEY=JSON")
    parser.add_argument("--no-ablation", action="store_true")
    parser.add_argument("--ablation-concurrency", default="32,1")
    parser.add_argument("--quick", action="store_true", help="the acceptance points only")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.ablation_concurrency = "1", "32"
        args.modes, args.per_slot, args.min_queries = "baseline,dedup,naive,full", 1, 8
    sim_overrides = {k: json.loads(v) for k, _, v in (s.partition("=") for s in args.sim)}
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    for search in args.searches.split(","):
        for mode in args.modes.split(","):
            for conc in levels:
                rows.append(run_one(
                    preset=args.preset, mode=mode, search=search, concurrency=conc,
                    queries=_queries(conc, args.per_slot, args.min_queries), seed=args.seed,
                    sim_overrides=sim_overrides,
                ))  # fmt: skip
                m = rows[-1]["metrics"]
                print(
                    f"{search:9s} {mode:9s} x{conc:<3d} {m['useful_tokens_per_s']:8.0f} useful/s "
                    f"{m['queries_per_s']:7.3f} q/s acc {m['accuracy']:.2f} "
                    f"waste {m['wasted_tokens'] / max(m['output_tokens'], 1):.2f} "
                    f"gen {rows[-1]['sim']['decode_share']:.2f} "
                    f"prm {rows[-1]['sim']['prm_share']:.2f}",
                    flush=True,
                )
    ablation: list[dict[str, Any]] = []
    for conc in [] if args.no_ablation else [int(c) for c in args.ablation_concurrency.split(",")]:
        print(f"\nablation: beam n=8 width 4, concurrency {conc} (queries/s vs baseline)")
        first = len(ablation)
        for name, mode, overrides in ABLATION:
            row = run_one(
                preset=args.preset, mode=mode, search="beam", concurrency=conc,
                queries=_queries(conc, args.per_slot, args.min_queries), seed=args.seed,
                overrides=overrides, sim_overrides=sim_overrides,
            )  # fmt: skip
            row["name"] = name
            ablation.append(row)
            base = ablation[first]["metrics"]["queries_per_s"]
            qps = row["metrics"]["queries_per_s"]
            m = row["metrics"]
            print(
                f"  {name:30s} {qps:6.3f} q/s  {qps / base:5.2f}x baseline  "
                f"useful {m['useful_tokens_per_s']:6.0f} tok/s  all {m['tokens_per_s']:6.0f} "
                f"tok/s  prm calls {row['sim']['prm_calls']:.0f}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"runs": rows, "ablation": ablation}, fh, indent=1)
    if args.png:
        _plot(rows, args.png)
    print("summary (queries/s of full over baseline / dedup / naive, same search and "
          "concurrency; ablation vs baseline): " + _summary(rows, ablation))  # fmt: skip


def _summary(rows: list[dict[str, Any]], ablation: list[dict[str, Any]]) -> str:
    qps = {(r["search"], r["concurrency"], r["mode"]): r["metrics"]["queries_per_s"] for r in rows}
    parts = []
    for (search, conc, mode), value in sorted(qps.items()):
        if mode != "full":
            continue
        ratios = [
            f"{value / qps[(search, conc, d)]:.2f}x/{d}"
            for d in DENOMINATORS
            if (search, conc, d) in qps
        ]
        parts.append(f"{search}@{conc} {' '.join(ratios)}")
    by_conc: dict[int, list[str]] = {}
    for row in ablation:
        base = next(
            a
            for a in ablation
            if a["concurrency"] == row["concurrency"] and a["mode"] == "baseline"
        )
        ratio = row["metrics"]["queries_per_s"] / base["metrics"]["queries_per_s"]
        by_conc.setdefault(row["concurrency"], []).append(f"{row['name']} {ratio:.2f}x")
    parts += [f"ablation@{c}: " + ", ".join(v) for c, v in by_conc.items()]
    return "; ".join(parts)


if __name__ == "__main__":
    main()
