"""Where each engine step's milliseconds go: the engine alone, through ``LocalBackend``, and
through the executor, at 1, 8 and 32 queries.

Layers (one cell = one layer at one query count):

- ``engine``: ``LLMEngine`` in this process, no executor, no child process: the main job's
  generation requests (per query a Game-of-24 prompt, ``n=8`` samples of the shipped
  sampling parameters; three waves, each extending every prompt by its first sample, as a
  search descends), stepped until done.
- ``backend``: the same requests through ``LocalBackend`` (engine and PRM cores in child
  processes, typed messages), all in flight at once.
- ``executor``: the main job itself (REBASE, ``full``, PRM rewards) at that concurrency.

Per cell: engine steps/s (engine steps over the cell's wall time), ms per step in each
stage of the engine's step (``stage_*``: schedule, draft, inputs, capture, forward, sample,
postprocess; ``gpu`` is GPU-busy time from CUDA events), the time outside steps (the engine
idle or between steps), the core loop's own time, the PRM's stages, the executor's CPU and
the wall time it had generation / reward calls outstanding.
Ratios: each layer's steps/s over ``engine``'s at the same query count, per round, median
with a bootstrap 90% interval. Rounds are interleaved (order shuffled per round, seeded),
round 0 is a warm-up and dropped, the prefix cache is flushed before each run.

``--micro`` swaps the shipped models for a 1-layer, hidden-32 random policy and PRM with the
same tokenizer: the forward costs almost nothing, so every overhead around it shows, on CPU
too. ``--device cuda`` runs on a GPU.

    python benchmarks/pipeline.py --queries 1,8,32 --rounds 3 --json pipeline.json
    python benchmarks/pipeline.py --micro --queries 32 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_process import bootstrap

__all__ = ["main"]

LAYERS = ("engine", "backend", "executor")
STAGES = ("schedule", "draft", "inputs", "capture", "forward", "sample", "postprocess")
PUZZLES = ["4 4 6 8", "1 2 3 4", "2 3 5 12", "1 1 4 6", "3 3 8 8", "1 5 5 5", "2 2 10 10"]
WAVES = 3


def micro_models(root: Path) -> tuple[str, str]:
    """A 1-layer, hidden-32 random policy and PRM beside the shipped ones' tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from spec_tot.graphs.game24 import PROGRAM

    opts = PROGRAM.backend_options("local")
    out = []
    for name in ("policy_path", "prm_path"):
        src, dst = Path(opts[name]), root / name
        dst.mkdir(parents=True)
        for f in src.iterdir():
            if f.name.startswith("tokenizer") or f.name == "prm.json":
                shutil.copy(f, dst / f.name)
        config = LlamaConfig.from_pretrained(src)
        config.update(dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=16))  # fmt: skip
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        config.save_pretrained(dst)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        state.pop("lm_head.weight", None)  # tied
        save_file(state, str(dst / "model.safetensors"))
        out.append(str(dst))
    return out[0], out[1]


def _requests(wave: int, queries: int, prompts: list[str], tag: str) -> list[Any]:
    from spec_tot.requests import GenerateRequest, SamplingParams

    params = SamplingParams(temperature=0.8, max_tokens=40, stop=("\n",), seed=wave)
    return [GenerateRequest(f"{tag}/{wave}/{i}", params, prompt=prompts[i], n=8)
            for i in range(queries)]  # fmt: skip


def _first_prompts(queries: int) -> list[str]:
    from spec_tot.graphs import game24_task as task

    return [task.prompt(PUZZLES[i % len(PUZZLES)], []) for i in range(queries)]


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if isinstance(v, float)}


def run_engine(engine: Any, queries: int, tag: str) -> tuple[float, dict[str, float]]:
    # (getattr: builds before the engine-wide flush had only the block manager's)
    getattr(engine, "reset_prefix_cache", engine.block_manager.reset_prefix_cache)()
    before = engine.stats()
    prompts = _first_prompts(queries)
    start = time.perf_counter()
    for wave in range(WAVES):
        for request in _requests(wave, queries, prompts, tag):
            engine.add_request(request)
        done: dict[str, Any] = {}
        while engine.has_unfinished():
            for result in engine.step():
                done[result.request_id] = result
        prompts = [p + done[f"{tag}/{wave}/{i}"].completions[0].text + "\n"
                   for i, p in enumerate(prompts)]  # fmt: skip
    return time.perf_counter() - start, _diff(engine.stats(), before)


async def run_backend(backend: Any, queries: int, tag: str) -> tuple[float, dict[str, float]]:
    await backend.flush_prefix_cache()
    before = backend.stats()
    prompts = _first_prompts(queries)
    start = time.perf_counter()
    for wave in range(WAVES):
        reqs = _requests(wave, queries, prompts, tag)
        results = await asyncio.gather(*(backend.generate(r) for r in reqs))
        prompts = [p + r.completions[0].text + "\n" for p, r in zip(prompts, results, strict=True)]
    return time.perf_counter() - start, _diff(backend.stats(), before)


async def run_executor(backend: Any, queries: int, seed: int = 0) -> tuple[float, dict[str, float]]:
    from spec_tot.config import ExecutorConfig
    from spec_tot.graphs.game24 import PROGRAM, game24_inputs

    await backend.flush_prefix_cache()
    before = backend.stats()
    # A seed per run: a run must not find the texts of an earlier one in a cache (builds
    # whose flush left the PRM's scores and the drafters' history behind would run warm).
    config = ExecutorConfig(mode="full", seed=seed, max_concurrency=queries)
    app = PROGRAM.build(backend=backend, search="rebase", search_params={}, config=config)
    start = time.perf_counter()
    batch = await app.arun_batch(game24_inputs(queries))
    wall = time.perf_counter() - start
    stats = _diff(backend.stats(), before)
    metrics = batch.metrics
    stats["executor_cpu_s"] = metrics.executor_cpu_s
    # (getattr: the same script measures builds from before these figures existed)
    stats["gen_pending_s"] = getattr(metrics, "generation_pending_s", 0.0)
    stats["reward_pending_s"] = getattr(metrics, "reward_pending_s", 0.0)
    return wall, stats


def _row(wall: float, stats: dict[str, float]) -> dict[str, float]:
    steps = max(stats.get("num_steps", 0.0), 1.0)
    ms = {s: 1e3 * stats.get(f"stage_{s}_s", 0.0) / steps for s in STAGES}
    ms["gpu"] = 1e3 * stats.get("stage_gpu_forward_s", 0.0) / steps
    ms["outside"] = 1e3 * (wall - stats.get("step_seconds", 0.0)) / steps
    for key in ("core_commands_s", "core_emit_s", "prm_tokenize_s", "prm_forward_s",
                "prm_queue_s", "prm_reply_s", "executor_cpu_s", "gen_pending_s",
                "reward_pending_s"):  # fmt: skip
        ms[key.removesuffix("_s")] = 1e3 * stats.get(key, 0.0) / steps
    ms["busy"] = stats.get("step_seconds", 0.0) / wall  # share of the wall inside steps
    return {"wall_s": wall, "steps": steps, "steps_per_s": steps / wall,
            "tokens_per_s": stats.get("num_generated_tokens", 0.0) / wall,
            "graph_steps": stats.get("num_graph_steps", 0.0), "ms_per_step": ms}  # fmt: skip


async def _rounds(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    from spec_tot.adapters.local import create_local
    from spec_tot.adapters.local.config import EngineConfig
    from spec_tot.adapters.local.engine.llm_engine import LLMEngine

    engine_opts = {k: v for k, v in options.items() if k not in ("policy_path", "prm_path")}
    engine = LLMEngine(EngineConfig(model=options["policy_path"], **engine_opts))
    backend = create_local(**options)
    cells = [(layer, q) for q in args.queries for layer in args.layers]
    runs: dict[str, list[dict[str, Any]]] = {f"{la}@{q}": [] for la, q in cells}
    rng = random.Random(args.seed)
    try:
        for rnd in range(args.rounds + 1):
            order = cells[:]
            rng.shuffle(order)
            for layer, q in order:
                tag = f"r{rnd}"
                if layer == "engine":
                    wall, stats = run_engine(engine, q, tag)
                elif layer == "backend":
                    wall, stats = await run_backend(backend, q, tag)
                else:
                    wall, stats = await run_executor(backend, q, seed=1000 * args.seed + rnd)
                row = _row(wall, stats)
                print(f"round {rnd} {layer}@{q}: {row['steps_per_s']:.1f} steps/s "
                      f"{row['tokens_per_s']:.0f} tok/s", flush=True)  # fmt: skip
                if rnd:  # round 0 warms up (imports, calibration, graph captures)
                    runs[f"{layer}@{q}"].append(row)
    finally:
        await backend.aclose()
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]], queries: list[int]) -> dict[str, Any]:
    cells: dict[str, Any] = {}
    for key, rows in runs.items():
        stages = rows[0]["ms_per_step"].keys()
        cells[key] = {
            "steps_per_s": statistics.median(r["steps_per_s"] for r in rows),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "ms_per_step": {
                s: statistics.median(r["ms_per_step"][s] for r in rows) for s in stages
            },
            "rounds": rows,
        }
    ratios: dict[str, Any] = {}
    for q in queries:
        base = runs.get(f"engine@{q}")
        for layer in ("backend", "executor"):
            rows = runs.get(f"{layer}@{q}")
            if not base or not rows:
                continue
            per = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(rows, base, strict=True)]
            ratios[f"{layer}@{q}"] = {"median": statistics.median(per), "ratios": per,
                                      "ci90": bootstrap(per, level=0.9)}  # fmt: skip
    parts = [f"{k} {v['median']:.2f}x engine steps/s [{v['ci90'][0]:.2f}, {v['ci90'][1]:.2f}]"
             for k, v in ratios.items()]  # fmt: skip
    return {"cells": cells, "vs_engine": ratios, "summary": "; ".join(parts)}


def print_table(cells: dict[str, Any]) -> None:
    keys = list(next(iter(cells.values()))["ms_per_step"].keys())
    head = f"{'cell':<14}{'steps/s':>9}{'tok/s':>9} " + " ".join(f"{k[:9]:>9}" for k in keys)
    print("ms per engine step:\n" + head)
    for name, c in cells.items():
        vals = " ".join(f"{c['ms_per_step'][k]:9.3f}" for k in keys)
        print(f"{name:<14}{c['steps_per_s']:9.1f}{c['tokens_per_s']:9.0f} {vals}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", default="1,8,32")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--backend-opt", action="append", default=[], help="KEY=VALUE (JSON value)")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.queries = [int(q) for q in args.queries.split(",")]
    args.layers = args.layers.split(",")
    from spec_tot.graphs.game24 import PROGRAM

    options: dict[str, Any] = {**PROGRAM.backend_options("local"), "device": args.device}
    for item in args.backend_opt:
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    with tempfile.TemporaryDirectory() as tmp:
        if args.micro:
            options["policy_path"], options["prm_path"] = micro_models(Path(tmp))
        runs = asyncio.run(_rounds(args, options))
    result = summarize(runs, args.queries)
    result["config"] = {"micro": args.micro, "device": args.device, "rounds": args.rounds,
                        "queries": args.queries, "options": options}  # fmt: skip
    print_table(result["cells"])
    print(("micro: " if args.micro else "") + result["summary"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
