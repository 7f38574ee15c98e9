"""Token-level speculative decoding in the embedded engine, with vs without, interleaved.

Every comparison runs its variants in rounds (``--rounds`` + 1, the first a warm-up that is
dropped), the variants' order shuffled in each round, the prefix cache flushed before each
run; it reports each variant's median and the median of the per-round ratios with a
bootstrap 90% interval (over rounds). ``/work/bin/cpu-lock bench`` around every call.

- ``record``: the main job (``spec-tot run``: REBASE width 8, 100 puzzles, ``full``, 32
  concurrent, shipped models, token speculation off) with every generation request written
  to ``--traces`` (prompt, sampling, n): the "main job's traces".
- ``engine``: those requests replayed straight into the engine (``LLMEngine``, one thread
  driving it, the calibrated step-cost curve given as the backend gives it) with ``--batch``
  requests in flight (closed loop); output tokens per second with token speculation on
  (the program's drafter and prompt lookup, as the program's backend options set them) and
  off; acceptance per drafter. ``--model PATH --gsm8k FILE``: a Hugging Face folder (e.g.
  SmolLM2-135M-Instruct) on GSM8K questions in its chat template, prompt lookup only.
- ``job``: the main job itself through ``compile_game24`` on two backends built once (token
  speculation on / off) in this process: queries/s and solved, ``--modes`` x
  ``--concurrency``, the seed of round r is ``--seeds[r % len]``.

    python benchmarks/token_spec.py record --traces benchmarks/results/game24_traces.json
    python benchmarks/token_spec.py engine --traces ... --batch 1 --requests 150 --json ...
    python benchmarks/token_spec.py job --search rebase --modes full --concurrency 32 ...
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["main"]


def _bootstrap(
    ratios: list[float], level: float = 0.90, reps: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """The median's bootstrap interval over rounds (``level``: two-sided coverage)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choice(ratios) for _ in ratios) for _ in range(reps))
    tail = (1.0 - level) / 2.0
    return meds[int(tail * reps)], meds[int((1.0 - tail) * reps) - 1]


def _compare(rounds: list[dict[str, float]], num: str, den: str) -> dict[str, Any]:
    ratios = [r[num] / r[den] for r in rounds if r.get(den)]
    lo, hi = _bootstrap(ratios) if ratios else (0.0, 0.0)
    return {
        "numerator": num,
        "denominator": den,
        "median": statistics.median(ratios) if ratios else 0.0,
        "ci90": [lo, hi],
        "ratios": ratios,
    }


# -- record -------------------------------------------------------------------------------------
async def _record(args: argparse.Namespace) -> None:
    from spec_tot.adapters.local import create_local
    from spec_tot.config import ExecutorConfig
    from spec_tot.graphs.game24 import PROGRAM, compile_game24, game24_inputs

    options = {**PROGRAM.backend_options("local"), "token_speculation": False}
    backend = create_local(**options)
    seen: list[dict[str, Any]] = []
    plain = backend.generate

    async def recording(request: Any) -> Any:
        s = request.sampling
        seen.append(
            {
                "prompt": request.prompt,
                "n": request.n,
                "sampling": {
                    "temperature": s.temperature,
                    "max_tokens": s.max_tokens,
                    "stop": list(s.stop),
                    "seed": s.seed,
                },
            }
        )
        return await plain(request)

    backend.generate = recording  # type: ignore[method-assign]
    try:
        config = ExecutorConfig(mode="full", seed=0, max_concurrency=32)
        app = compile_game24(search="rebase", backend=backend, config=config)
        batch = await app.arun_batch(game24_inputs(args.queries))
    finally:
        await backend.aclose()
    args.traces.write_text(json.dumps(seen))
    print(f"recorded {len(seen)} requests; solved {batch.metrics.solved}/{batch.metrics.queries}")


# -- engine -------------------------------------------------------------------------------------
def _requests(args: argparse.Namespace, tokenizer: Any) -> list[Any]:
    from spec_tot.requests import GenerateRequest, SamplingParams

    if args.gsm8k is not None:
        rows = [json.loads(line) for line in args.gsm8k.read_text().splitlines() if line]
        out = []
        for i, row in enumerate(rows[: args.requests]):
            messages = [{"role": "user", "content": row["question"] + "\nSolve step by step."}]
            prompt = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
            out.append(GenerateRequest(f"g{i}/0", sp, prompt=prompt))
        return out
    traces = json.loads(args.traces.read_text())[: args.requests]
    out = []
    for i, t in enumerate(traces):
        s = t["sampling"]
        sp = SamplingParams(
            temperature=s["temperature"],
            max_tokens=s["max_tokens"],
            stop=tuple(s["stop"]),
            seed=s["seed"],
        )
        out.append(GenerateRequest(f"t{i}/0", sp, prompt=t["prompt"], n=t["n"]))
    return out


def _replay(engine: Any, requests: list[Any], batch: int, tag: str) -> dict[str, float]:
    """Closed loop: ``batch`` requests in flight; output tokens per second. Request ids get
    ``tag`` (each run its own trees: no drafter finds an earlier run's output)."""
    engine.reset_prefix_cache()
    before = engine.stats()
    pending = [dataclasses.replace(r, request_id=f"{tag}{r.request_id}") for r in requests]
    inflight = 0
    tokens = 0
    started, cpu = time.perf_counter(), time.process_time()
    while pending or inflight:
        while pending and inflight < batch:
            engine.add_request(pending.pop(0))
            inflight += 1
        for result in engine.step():
            inflight -= 1
            tokens += sum(c.num_tokens for c in result.completions)
    wall = time.perf_counter() - started
    after = engine.stats()
    keys = [
        k for k in after if k.startswith(("num_draft", "num_accepted", "num_decode", "num_verify"))
    ]
    out = {k: after[k] - before.get(k, 0.0) for k in keys}
    out.update(
        tokens=float(tokens),
        wall_s=wall,
        cpu_s=time.process_time() - cpu,
        tokens_per_s=tokens / wall,
        steps=after["num_steps"] - before["num_steps"],
    )
    return out


def _engines(args: argparse.Namespace) -> dict[str, Any]:
    from spec_tot.adapters.local.config import EngineConfig
    from spec_tot.adapters.local.engine.calibrate import step_cost_curve
    from spec_tot.adapters.local.engine.llm_engine import LLMEngine
    from spec_tot.graphs.game24 import PROGRAM

    if args.model is not None:
        common: dict[str, Any] = {"model": str(args.model)}
        variants = {"off": {"token_speculation": False}, "on": {"ngram_max": 4}}
    else:
        program = PROGRAM.backend_options("local")
        common = {"model": program["policy_path"]}
        variants = {
            "off": {"token_speculation": False},
            "on": {"drafter": program["drafter"], "ngram_max": program["ngram_max"]},
        }
        if args.per_drafter:
            variants["game24_only"] = {"drafter": program["drafter"], "ngram_max": 0}
            variants["ngram_only"] = {"ngram_max": 4}
    seqs = max(8, args.batch) if args.model is not None else max(64, args.batch)
    common.update(max_num_seqs=seqs, num_kv_blocks=args.kv_blocks)
    engines = {}
    curve = None
    for name, extra in variants.items():
        engine = LLMEngine(EngineConfig(**common, **extra, saturation_batch=8))
        if curve is None:
            with engine.plain_decoding():
                curve = step_cost_curve(engine)
        engine.use_step_costs(curve)
        engines[name] = engine
    print("step-cost curve (s):", {b: round(t, 5) for b, t in (curve or {}).items()}, flush=True)
    return engines


def _engine_bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = _engines(args)
    requests = _requests(args, next(iter(engines.values())).tokenizer)
    rng = random.Random(args.seed)
    rounds: list[dict[str, float]] = []
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds + 1):
        order = list(engines)
        rng.shuffle(order)
        tps: dict[str, float] = {}
        for name in order:
            work = requests if r else requests[: args.warmup_requests or len(requests)]
            stats = _replay(engines[name], work, args.batch, f"{r}{name}")
            tps[name] = stats["tokens_per_s"]
            runs.append({"round": r, "variant": name, **stats})
            print(f"round {r} {name:12s} {_engine_line(stats)}", flush=True)
        if r:  # round 0 warms up
            rounds.append(tps)
    out = {
        "batch": args.batch,
        "requests": len(requests),
        "threads": torch.get_num_threads(),
        "model": str(args.model) if args.model else "game24 policy",
        "runs": runs,
        "medians": {v: statistics.median(r[v] for r in rounds) for v in engines},
        "speedup": {v: _compare(rounds, v, "off") for v in engines if v != "off"},
        "acceptance": _acceptance([x for x in runs if x["round"]]),
    }
    return out


def _engine_line(stats: dict[str, float]) -> str:
    drafted = stats.get("num_draft_tokens", 0.0)
    rate = stats.get("num_accepted_tokens", 0.0) / drafted if drafted else 0.0
    per_step = stats.get("num_decode_tokens", 0.0) / max(stats.get("num_decode_rows", 0.0), 1)
    return (
        f"tok/s={stats['tokens_per_s']:.0f} wall={stats['wall_s']:.2f} steps={stats['steps']:.0f}"
        f" drafted={drafted:.0f} accepted={rate:.2f} tok/row-step={per_step:.2f}"
    )


def _acceptance(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per variant and drafter: drafted and accepted tokens over the measured rounds."""
    out: dict[str, dict[str, float]] = {}
    for run in runs:
        slot = out.setdefault(run["variant"], {})
        for key, value in run.items():
            if key.startswith(("num_draft_tokens_", "num_accepted_tokens_")):
                slot[key] = slot.get(key, 0.0) + value
    for slot in out.values():
        for key in [k for k in slot if k.startswith("num_draft_tokens_")]:
            name = key.removeprefix("num_draft_tokens_")
            drafted = slot[key]
            slot[f"acceptance_{name}"] = slot.get(f"num_accepted_tokens_{name}", 0.0) / max(
                drafted, 1.0
            )
    return out


# -- job ----------------------------------------------------------------------------------------
async def _job_bench(args: argparse.Namespace) -> dict[str, Any]:
    from spec_tot.adapters.local import create_local
    from spec_tot.config import ExecutorConfig
    from spec_tot.graphs.game24 import PROGRAM, compile_game24, game24_inputs

    options = PROGRAM.backend_options("local")
    backends = {
        "on": create_local(**options),
        "off": create_local(**options, token_speculation=False),
    }
    variants = [(f"{mode}+tok", mode, "on") for mode in args.modes.split(",")]
    variants += [(mode, mode, "off") for mode in args.modes.split(",")]
    for label in filter(None, args.extra.split(",")):
        variants.append((label, label.split("+")[0], "on" if "+tok" in label else "off"))
    seeds = [int(s) for s in args.seeds.split(",")]
    rng = random.Random(args.seed)
    rounds: list[dict[str, float]] = []
    runs: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds + 1):
            seed = seeds[(r - 1) % len(seeds)] if r else seeds[0]
            order = list(variants)
            rng.shuffle(order)
            qps: dict[str, float] = {}
            for label, mode, which in order:
                backend = backends[which]
                await backend.flush_prefix_cache()
                before = backend.stats()
                config = ExecutorConfig(mode=mode, seed=seed, max_concurrency=args.concurrency)
                app = compile_game24(search=args.search, backend=backend, config=config)
                queries = args.queries if r else args.warmup_queries or args.queries
                batch = await app.arun_batch(game24_inputs(queries))
                m = batch.metrics
                after = backend.stats()
                delta = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("num_")}
                runs.append(
                    {
                        "round": r,
                        "variant": label,
                        "seed": seed,
                        "metrics": m.to_dict(),
                        "engine": delta,
                    }
                )
                qps[label] = m.queries_per_s
                drafted = delta.get("num_draft_tokens", 0.0)
                rate = delta.get("num_accepted_tokens", 0.0) / drafted if drafted else 0.0
                print(
                    f"round {r} seed {seed} {label:14s} q/s={m.queries_per_s:.3f} "
                    f"solved={m.solved}/{m.queries} wall={m.wall_s:.2f} accepted={rate:.2f}",
                    flush=True,
                )
            if r:
                rounds.append(qps)
    finally:
        for backend in backends.values():
            await backend.aclose()
    labels = [v[0] for v in variants]
    denominators = args.denominators.split(",") if args.denominators else []
    comparisons = [_compare(rounds, f"{mode}+tok", mode) for mode in args.modes.split(",")]
    for pair in denominators:
        num, den = pair.split("/")
        comparisons.append(_compare(rounds, num, den))
    solved: dict[str, dict[int, list[int]]] = {}
    for run in runs:
        if run["round"]:
            solved.setdefault(run["variant"], {}).setdefault(run["seed"], []).append(
                run["metrics"]["solved"]
            )
    return {
        "search": args.search,
        "concurrency": args.concurrency,
        "queries": args.queries,
        "runs": runs,
        "medians": {v: statistics.median(r[v] for r in rounds) for v in labels},
        "comparisons": comparisons,
        "solved": solved,
    }


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--traces", type=Path, required=True)
    rec.add_argument("--queries", type=int, default=100)
    eng = sub.add_parser("engine")
    eng.add_argument("--traces", type=Path)
    eng.add_argument("--model", type=Path, help="a Hugging Face folder instead of the policy")
    eng.add_argument("--gsm8k", type=Path, help="GSM8K jsonl (with --model)")
    eng.add_argument("--temperature", type=float, default=0.0)
    eng.add_argument("--max-tokens", type=int, default=128)
    eng.add_argument("--batch", type=int, default=1)
    eng.add_argument("--requests", type=int, default=200)
    eng.add_argument("--kv-blocks", type=int, default=2048)
    eng.add_argument("--per-drafter", action="store_true", help="also each drafter alone")
    eng.add_argument("--warmup-requests", type=int, default=0, help="warm-up size (0: all)")
    job = sub.add_parser("job")
    job.add_argument("--search", default="rebase")
    job.add_argument("--modes", default="full")
    job.add_argument("--extra", default="", help="more variants, e.g. baseline+tok")
    job.add_argument("--denominators", default="", help="more ratios, e.g. full+tok/baseline")
    job.add_argument("--concurrency", type=int, default=32)
    job.add_argument("--queries", type=int, default=100)
    job.add_argument("--seeds", default="0,1,2")
    job.add_argument("--warmup-queries", type=int, default=0, help="warm-up size (0: all)")
    for p in (eng, job):
        p.add_argument("--rounds", type=int, default=5, help="measured rounds (+1 warm-up)")
        p.add_argument("--seed", type=int, default=0, help="the shuffle's seed")
        p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
        p.add_argument("--json", type=Path)
    return parser.parse_args()


def _summary(result: dict[str, Any]) -> str:
    parts = []
    for comp in result.get("comparisons", []) or [
        {"numerator": k, **v} for k, v in result.get("speedup", {}).items()
    ]:
        lo, hi = comp["ci90"]
        den = comp.get("denominator", "off")
        parts.append(f"{comp['numerator']}/{den} {comp['median']:.2f}x [{lo:.2f}, {hi:.2f}]")
    where = (
        f"batch {result['batch']}"
        if "batch" in result
        else (f"{result['search']} c={result['concurrency']}")
    )
    return f"summary: {where}: " + "; ".join(parts)


def main() -> None:
    args = _args()
    if args.command == "record":
        asyncio.run(_record(args))
        return
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    result = _engine_bench(args) if args.command == "engine" else asyncio.run(_job_bench(args))
    result["summary"] = _summary(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    print(result["summary"])


if __name__ == "__main__":
    main()
