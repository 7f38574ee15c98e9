"""LangGraph's ToT (and LATS) tutorial graphs: LangGraph's own runtime vs spec-tot.

The same graph object, the same deterministic chat model (``ScriptedChatModel``: replies are
a function of the prompt; each call's latency is drawn from 10-200 ms by a hash of the prompt
and ``--seeds``), run three ways side by side, interleaved input by input: LangGraph's
``compile().ainvoke`` (the denominator of every ratio), spec-tot ``baseline`` and spec-tot
``full``. Two loads: one query at a time, and ``--concurrency`` inputs at once (one
``asyncio.gather``). Answers are checked equal in every variant. Also reported: the ratio a
perfect predictor would reach on the ToT graph (each expansion started the moment the
candidate it expands was produced), from the baseline run's own latencies.

    python benchmarks/langgraph_tot.py --json benchmarks/results/langgraph_tot.json

Writes JSON rows ``{"graph", "load", "seed", "variant", "wall_s", "llm_calls", ...}`` and a
one-line summary.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lg_examples import lats, lats_answer, puzzles, tot, tot_answer

from spec_tot.langgraph import from_langgraph

VARIANTS = ("langgraph", "baseline", "full")
CONFIG: Any = {"recursion_limit": 100}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=12, help="inputs per seed and load")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--min-latency", type=float, default=0.01)
    parser.add_argument("--max-latency", type=float, default=0.2)
    parser.add_argument("--lats", action="store_true", help="also run the LATS graph")
    parser.add_argument("--max-speculative", type=int, default=16, help="speculative slots")
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def _apps(graph: Any, slots: int = 16) -> dict[str, Any]:
    return {
        "langgraph": graph.compile(),
        "baseline": from_langgraph(graph, mode="baseline"),
        "full": from_langgraph(graph, mode="full", max_speculative=slots),
    }


async def _tot(args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    inputs = puzzles(args.inputs, seed=100 + seed)
    models = {
        v: tot.tot_model(seed=seed, min_latency_s=args.min_latency, max_latency_s=args.max_latency)
        for v in VARIANTS
    }
    apps = {v: _apps(tot.build_tot_graph(models[v]), args.max_speculative)[v] for v in VARIANTS}
    batches = [[p] for p in inputs] + [
        inputs[i : i + args.concurrency] for i in range(0, len(inputs), args.concurrency)
    ]
    walls = {(load, v): 0.0 for load in ("1", "n") for v in VARIANTS}
    answers: dict[str, list[Any]] = {v: [] for v in VARIANTS}
    for batch in batches:
        load = "1" if len(batch) == 1 else "n"
        for variant in VARIANTS:  # interleaved: the three runs of one batch side by side
            started = time.perf_counter()
            finals = await asyncio.gather(
                *(apps[variant].ainvoke({"problem": p}, CONFIG) for p in batch)
            )
            walls[load, variant] += time.perf_counter() - started
            if load == "1":
                answers[variant].extend(tot_answer(f) for f in finals)
    if not answers["langgraph"] == answers["baseline"] == answers["full"]:
        raise AssertionError("answers differ between variants")
    calls = {v: models[v].num_calls for v in VARIANTS}
    for (load, variant), wall in walls.items():
        rows.append(
            {
                "graph": "tot",
                "load": 1 if load == "1" else args.concurrency,
                "seed": seed,
                "variant": variant,
                "inputs": len(inputs),
                "wall_s": wall,
                "speedup_vs_langgraph": walls[load, "langgraph"] / wall,
                "llm_calls_both_loads": calls[variant],
            }
        )
    rows.append(await _oracle(args, seed, inputs))
    return rows


async def _oracle(args: argparse.Namespace, seed: int, inputs: list[str]) -> dict[str, Any]:
    """The perfect-predictor bound: every expansion starts when its seed was produced."""
    log: list[tuple[Any, list[Any], float]] = []
    model = tot.tot_model(seed=seed, min_latency_s=args.min_latency, max_latency_s=args.max_latency)
    graph = tot.build_tot_graph(model)
    expand = graph.nodes["expand"].runnable

    async def timed(state: Any, config: Any) -> Any:
        started = time.perf_counter()
        out = await expand.ainvoke(state, config)
        seed_c = state.get("seed")
        made = [tuple(c.candidate.tokens) for c in out["candidates"]]
        log.append(
            (
                tuple(seed_c.candidate.tokens) if seed_c else None,
                made,
                time.perf_counter() - started,
            )
        )
        return out

    graph.nodes["expand"] = dataclasses.replace(graph.nodes["expand"], runnable=_as_runnable(timed))
    app = from_langgraph(graph, mode="baseline")
    total = bound = 0.0
    for p in inputs:
        log.clear()
        started = time.perf_counter()
        await app.ainvoke({"problem": p}, CONFIG)
        total += time.perf_counter() - started
        produced: dict[Any, float] = {}
        finish = 0.0
        for seed_tokens, made, latency in log:
            start = produced.get(seed_tokens, 0.0) if seed_tokens is not None else 0.0
            end = start + latency
            finish = max(finish, end)
            for m in made:
                produced.setdefault(m, end)
        bound += finish
    return {
        "graph": "tot",
        "load": 1,
        "seed": seed,
        "variant": "oracle",
        "wall_s": bound,
        "speedup_vs_baseline": total / bound,
    }


def _as_runnable(fn: Any) -> Any:
    from langchain_core.runnables import RunnableLambda

    return RunnableLambda(fn)


def _lats(args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    rows = []
    questions = [f"question {i}: compare two sources" for i in range(args.concurrency)]
    for variant in VARIANTS:
        log = lats.SearchLog()
        model = lats.lats_model(
            seed=seed, min_latency_s=args.min_latency, max_latency_s=args.max_latency
        )
        app = _apps(lats.build_lats_graph(model, log))[variant]
        started = time.perf_counter()
        finals = app.batch(
            [{"input": q} for q in questions], {"max_concurrency": len(questions), **CONFIG}
        )
        wall = time.perf_counter() - started
        rows.append(
            {
                "graph": "lats",
                "load": len(questions),
                "seed": seed,
                "variant": variant,
                "wall_s": wall,
                "llm_calls": model.num_calls,
                "tool_calls": log.calls,
                "speculative_tool_calls": log.speculative_calls,
                "answers": [lats_answer(f)[0][-1] for f in finals],
            }
        )
    base = rows[0]["wall_s"]
    for row in rows:
        row["speedup_vs_langgraph"] = base / row["wall_s"]
    return rows


def _summary(rows: list[dict[str, Any]], concurrency: int) -> str:
    def mean(load: int, variant: str, key: str = "speedup_vs_langgraph") -> float:
        vals = [
            r[key]
            for r in rows
            if r["graph"] == "tot" and r["load"] == load and r["variant"] == variant
        ]
        return statistics.mean(vals) if vals else float("nan")

    return (
        f"ToT tutorial graph, wall-time speedup vs LangGraph's runtime (mean over seeds): "
        f"one query: full {mean(1, 'full'):.2f}x, baseline {mean(1, 'baseline'):.2f}x "
        f"(perfect-predictor bound {mean(1, 'oracle', 'speedup_vs_baseline'):.2f}x vs baseline); "
        f"{concurrency} concurrent: full {mean(concurrency, 'full'):.2f}x, "
        f"baseline {mean(concurrency, 'baseline'):.2f}x; answers equal in every variant"
    )


async def main() -> None:
    args = _args()
    rows: list[dict[str, Any]] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        rows.extend(await _tot(args, seed))
        if args.lats:
            rows.extend(await asyncio.to_thread(_lats, args, seed))
    summary = _summary(rows, args.concurrency)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1, default=str))
    print(summary)


if __name__ == "__main__":
    asyncio.run(main())
