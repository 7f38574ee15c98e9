"""LangGraph's ToT and LATS tutorial graphs: LangGraph's own runtime vs spec-tot.

The tutorial graphs as the tutorials write them (sync node functions; only spec-tot node
metadata added), over a deterministic chat model (``ScriptedChatModel``: replies are a
function of the prompt, each call's latency 10-200 ms by a hash of the prompt and the
round). Variants: LangGraph's ``compile()`` (the denominator of every ratio), spec-tot
``baseline`` and ``full``. Cells: graph x load (one query at a time, or ``--concurrency``
at once) x entry (``invoke``/threads, or ``ainvoke``/``asyncio.gather``) x checkpointer
(none, or ``InMemorySaver`` with a thread per input).

Every cell runs ``--rounds`` rounds plus one warm-up round that is discarded; a round runs
the three variants on the same inputs, in an order shuffled per round (seeded), rounds of
all cells interleaved. Reported per cell: the median of the per-round ratios
(LangGraph's wall time / the variant's) and a bootstrap 90% interval, the speculative tasks
``full`` launched and adopted, the model calls of each variant; answers are checked equal
in every variant and round.

    python benchmarks/langgraph_tot.py --json benchmarks/results/langgraph_tot.json

Writes JSON (``cells``: per-cell figures, ``runs``: every run) and a one-line summary.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from langgraph.checkpoint.memory import InMemorySaver

from spec_tot.langgraph import from_langgraph, speculation_of


def _load_examples() -> Any:
    """The tests' example graphs (``tests/lg_examples.py``: LangGraph's ToT and LATS
    tutorials from examples/, the inputs, the answers compared), loaded from its file so the
    benchmark runs exactly what the tests check, with no edit of ``sys.path``."""
    path = Path(__file__).resolve().parents[1] / "tests" / "lg_examples.py"
    spec = importlib.util.spec_from_file_location("lg_examples", path)
    if spec is None or spec.loader is None:
        raise ImportError(str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_EXAMPLES = _load_examples()
tot, lats, puzzles = _EXAMPLES.tot, _EXAMPLES.lats, _EXAMPLES.puzzles
tot_answer, lats_answer = _EXAMPLES.tot_answer, _EXAMPLES.lats_answer

VARIANTS = ("langgraph", "baseline", "full")
RUN: Any = {"recursion_limit": 100}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--graphs", default="tot,lats")
    parser.add_argument("--loads", default="1,10", help="queries at once")
    parser.add_argument("--entries", default="sync,async")
    parser.add_argument("--checkpointers", default="none,memory")
    parser.add_argument("--inputs", type=int, default=6, help="queries per load-1 run")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="shuffles the variant order")
    parser.add_argument("--min-latency", type=float, default=0.01)
    parser.add_argument("--max-latency", type=float, default=0.2)
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def bootstrap(values: Sequence[float], level: float = 0.9, n: int = 2000) -> tuple[float, float]:
    """Percentile interval of the median of ``values`` (resampled with replacement)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    lo = meds[int((1 - level) / 2 * n)]
    hi = meds[min(n - 1, int((1 + level) / 2 * n))]
    return lo, hi


class Cell:
    """One point of the grid: builds each variant's app and runs it on a round's inputs."""

    def __init__(self, args: argparse.Namespace, graph: str, load: int, entry: str, saver: str):
        self.args, self.graph, self.load, self.entry, self.saver = args, graph, load, entry, saver
        self.name = f"{graph}/load={load}/{entry}/checkpointer={saver}"

    def inputs(self, rnd: int) -> list[Any]:
        n = self.args.inputs if self.load == 1 else self.load
        if self.graph == "tot":
            return [{"problem": p} for p in puzzles(n, seed=1000 + rnd)]
        return [{"input": f"question {rnd}.{i}: compare two sources"} for i in range(n)]

    def app(self, variant: str, rnd: int) -> tuple[Any, Any, Any]:
        lo, hi = self.args.min_latency, self.args.max_latency
        if self.graph == "tot":
            model = tot.tot_model(seed=rnd, min_latency_s=lo, max_latency_s=hi)
            builder, log = tot.build_tot_graph(model, sync=True), None
        else:
            model = lats.lats_model(seed=rnd, min_latency_s=lo, max_latency_s=hi)
            log = lats.SearchLog()
            builder = lats.build_lats_graph(model, log)
        saver = InMemorySaver() if self.saver == "memory" else None
        compiled = builder.compile(checkpointer=saver)
        app = compiled if variant == "langgraph" else from_langgraph(compiled, mode=variant)
        return app, model, log

    def configs(self, n: int, rnd: int) -> list[Any]:
        extra = {"configurable": {"N": 2}} if self.graph == "lats" else {}
        if self.saver == "none":
            return [{**RUN, **extra} for _ in range(n)]
        threads = [{"thread_id": f"r{rnd}-{i}"} for i in range(n)]
        return [{**RUN, "configurable": {**extra.get("configurable", {}), **t}} for t in threads]

    def answer(self, state: Any) -> Any:
        return tot_answer(state) if self.graph == "tot" else lats_answer(state)

    def run(self, variant: str, rnd: int) -> dict[str, Any]:
        app, model, log = self.app(variant, rnd)
        inputs, configs = self.inputs(rnd), self.configs(len(self.inputs(rnd)), rnd)
        started = time.perf_counter()
        if self.load == 1:
            finals = [_one(app, x, c, self.entry) for x, c in zip(inputs, configs, strict=True)]
        else:
            finals = _many(app, inputs, configs, self.entry)
        wall = time.perf_counter() - started
        totals = speculation_of(app).totals.to_dict() if variant != "langgraph" else {}
        return {
            "cell": self.name,
            "round": rnd,
            "variant": variant,
            "wall_s": wall,
            "llm_calls": model.num_calls,
            "tool_calls": log.calls if log is not None else None,
            "speculative": totals.get("speculative", 0),
            "adopted": totals.get("adopted", 0),
            "answers": [repr(self.answer(f)) for f in finals],
        }


def _one(app: Any, x: Any, config: Any, entry: str) -> Any:
    if entry == "sync":
        return app.invoke(x, config)
    return asyncio.run(app.ainvoke(x, config))


def _many(app: Any, inputs: list[Any], configs: list[Any], entry: str) -> list[Any]:
    if entry == "sync":  # LangGraph's own batch: one thread per input
        with ThreadPoolExecutor(len(inputs)) as pool:
            return list(pool.map(app.invoke, inputs, configs))

    async def gather() -> list[Any]:
        return await asyncio.gather(
            *(app.ainvoke(x, c) for x, c in zip(inputs, configs, strict=True))
        )

    return asyncio.run(gather())


def grid(args: argparse.Namespace) -> list[Cell]:
    cells = []
    for graph in args.graphs.split(","):
        for load in (int(x) for x in args.loads.split(",")):
            for entry in args.entries.split(","):
                if graph == "lats" and entry == "async":
                    continue  # the LATS tutorial's nodes are sync and invoked sync
                for saver in args.checkpointers.split(","):
                    if graph == "lats" and saver != "none":
                        # its state holds the search tree's Node objects, which no
                        # LangGraph checkpointer serialises (LangGraph itself fails)
                        continue
                    cells.append(Cell(args, graph, load, entry, saver))
    return cells


def measure(cells: list[Cell], rounds: int, seed: int, log: Callable[[str], None]) -> list[Any]:
    rng = random.Random(seed)
    runs: list[dict[str, Any]] = []
    for rnd in range(rounds + 1):  # round 0 warms every cell up and is discarded
        for cell in cells:
            order = list(VARIANTS)
            rng.shuffle(order)
            got = {v: cell.run(v, rnd) for v in order}
            answers = {v: r.pop("answers") for v, r in got.items()}
            if not answers["langgraph"] == answers["baseline"] == answers["full"]:
                raise AssertionError(f"{cell.name} round {rnd}: answers differ")
            if rnd > 0:
                runs.extend(got.values())
            log(
                f"{cell.name} round {rnd}: "
                + " ".join(f"{v}={got[v]['wall_s']:.2f}s" for v in VARIANTS)
            )
    return runs


def figures(cells: list[Cell], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for cell in cells:
        rows = [r for r in runs if r["cell"] == cell.name]
        by_round: dict[int, dict[str, Any]] = {}
        for r in rows:
            by_round.setdefault(r["round"], {})[r["variant"]] = r
        entry: dict[str, Any] = {"cell": cell.name, "rounds": len(by_round)}
        for variant in ("baseline", "full"):
            ratios = [v["langgraph"]["wall_s"] / v[variant]["wall_s"] for v in by_round.values()]
            lo, hi = bootstrap(ratios)
            entry[variant] = {
                "speedup_vs_langgraph": statistics.median(ratios),
                "interval_90": [lo, hi],
                "per_round": ratios,
            }
        full = [v["full"] for v in by_round.values()]
        entry["full"]["speculative_per_run"] = statistics.mean(r["speculative"] for r in full)
        entry["full"]["adopted_per_run"] = statistics.mean(r["adopted"] for r in full)
        entry["llm_calls_per_run"] = {
            v: statistics.mean(r["llm_calls"] for r in rows if r["variant"] == v) for v in VARIANTS
        }
        out.append(entry)
    return out


def summary(figs: list[dict[str, Any]]) -> str:
    parts = []
    for f in figs:
        full = f["full"]
        lo, hi = full["interval_90"]
        parts.append(
            f"{f['cell']}: full {full['speedup_vs_langgraph']:.2f}x [{lo:.2f}, {hi:.2f}] "
            f"(baseline {f['baseline']['speedup_vs_langgraph']:.2f}x; "
            f"{full['adopted_per_run']:.0f}/{full['speculative_per_run']:.0f} adopted/launched)"
        )
    return (
        "LangGraph tutorial graphs, wall-time speedup vs LangGraph's runtime (median of "
        f"{figs[0]['rounds'] if figs else 0} interleaved rounds, 90% interval): " + "; ".join(parts)
    )


def main() -> None:
    args = _args()
    cells = grid(args)
    runs = measure(cells, args.rounds, args.seed, lambda line: print(line, file=sys.stderr))
    figs = figures(cells, runs)
    line = summary(figs)
    if args.json is not None:
        args.json.write_text(json.dumps({"cells": figs, "runs": runs, "summary": line}, indent=1))
    print(line)


if __name__ == "__main__":
    main()
