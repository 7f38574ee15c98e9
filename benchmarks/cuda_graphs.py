"""CUDA decode on a GPU: the paged kernels, greedy parity with and without CUDA graphs, and
where the engine's step goes with each (the engine alone, in this process).

1. Kernels: the Triton paged decode kernel and the torch gather fallback against a gather +
   SDPA reference (float32 and the run dtype), and whether Triton loaded (with the reason).
2. Parity: the shipped Game-of-24 policy, greedy, 16 prompts x 24 tokens, token speculation
   off and on, ``cuda_graphs`` off vs on, in float32 and bfloat16: identical texts.
3. The engine alone, 32 requests x 8 samples of the shipped policy (the main job's first
   expansion), interleaved rounds (round 0 dropped), graphs off vs on: ms per step, tokens/s,
   the GPU-busy share of a step (CUDA events around each forward over the step's wall time),
   and the per-stage host times of the step.

    python benchmarks/cuda_graphs.py --json cuda_graphs.json       (on a GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["main"]

PUZZLES = ["4 4 6 8", "1 2 3 4", "2 3 5 12", "1 1 4 6", "3 3 8 8", "1 5 5 5", "2 2 10 10"]
STAGES = ("schedule", "draft", "inputs", "capture", "forward", "sample", "postprocess")


def kernels(device: str) -> dict[str, Any]:
    import torch.nn.functional as F

    from spec_tot.adapters.local.model.attention import GatherPagedKernel
    from spec_tot.adapters.local.model.triton_paged import load_triton_kernel

    triton_kernel, note = load_triton_kernel(device)
    out: dict[str, Any] = {"triton": triton_kernel is not None, "note": note, "max_err": {}}
    gen = torch.Generator().manual_seed(0)
    n, heads, kv, dim, bs, longest = 24, 9, 3, 64, 16, 200
    blocks = -(-longest // bs)
    k_pool = torch.randn(n * blocks + 1, bs, kv, dim, generator=gen)
    v_pool = torch.randn(n * blocks + 1, bs, kv, dim, generator=gen)
    tables = torch.randperm(n * blocks + 1, generator=gen)[: n * blocks].view(n, blocks)
    lengths = torch.randint(1, longest + 1, (n,), generator=gen)
    q = torch.randn(n, heads, dim, generator=gen)
    ref = []
    for i in range(n):
        slots = (tables[i][:, None] * bs + torch.arange(bs)).reshape(-1)[: int(lengths[i])]
        k = k_pool.reshape(-1, kv, dim)[slots].transpose(0, 1)[None]
        v = v_pool.reshape(-1, kv, dim)[slots].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q[i][None, :, None], k, v, scale=0.125, enable_gqa=True)
        ref.append(o[0, :, 0])
    want = torch.stack(ref)
    for dtype in (torch.float32, torch.bfloat16):
        args = [t.to(device, dtype) for t in (q, k_pool, v_pool)]
        args += [tables.to(device), lengths.to(device)]
        named = {"gather": GatherPagedKernel(), "triton": triton_kernel}
        for name, kernel in named.items():
            if kernel is not None:
                got = kernel.attend(*args, 0.125).float().cpu()
                out["max_err"][f"{name}_{str(dtype)[6:]}"] = float((got - want).abs().max())
    return out


def _engine(device: str, dtype: str, graphs: bool, tokspec: bool) -> Any:
    from spec_tot.adapters.local.config import EngineConfig
    from spec_tot.adapters.local.engine.llm_engine import LLMEngine
    from spec_tot.graphs.game24 import PROGRAM

    opts = PROGRAM.backend_options("local")
    return LLMEngine(
        EngineConfig(
            model=opts["policy_path"], device=device, dtype=dtype, cuda_graphs=graphs,
            token_speculation=tokspec, drafter=opts["drafter"], ngram_max=opts["ngram_max"],
        )
    )  # fmt: skip


def _prompts(count: int) -> list[str]:
    from spec_tot.graphs import game24_task as task

    return [task.prompt(PUZZLES[i % len(PUZZLES)], []) for i in range(count)]


def _drain(engine: Any) -> dict[str, Any]:
    out = {}
    while engine.has_unfinished():
        for r in engine.step():
            out[r.request_id] = r
    return out


def parity(device: str) -> dict[str, Any]:
    from spec_tot.requests import GenerateRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24)
    out: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        for tokspec in (False, True):
            texts = []
            for graphs in (False, True):
                engine = _engine(device, dtype, graphs, tokspec)
                for i, p in enumerate(_prompts(16)):
                    engine.add_request(GenerateRequest(f"p{i}", params, prompt=p))
                done = _drain(engine)
                texts.append([done[f"p{i}"].completions[0].text for i in range(16)])
                stats = engine.stats()
            same = sum(a == b for a, b in zip(*texts, strict=True))
            out[f"{dtype}_tokspec_{tokspec}"] = {
                "identical": f"{same}/16",
                "graph_steps": stats.get("num_graph_steps", 0.0),
                "eager_steps": stats.get("num_eager_steps", 0.0),
            }
    return out


def _load(engine: Any, tag: str, queries: int, n: int) -> None:
    from spec_tot.requests import GenerateRequest, SamplingParams

    sp = SamplingParams(temperature=0.8, max_tokens=40, stop=("\n",), seed=1)
    for i, p in enumerate(_prompts(queries)):
        engine.add_request(GenerateRequest(f"{tag}/{i}", sp, prompt=p, n=n))


def engine_alone(device: str, rounds: int, queries: int, n: int) -> dict[str, Any]:
    engines, memory_mb = {}, {}
    for g in (False, True):  # GPU memory each engine holds (pool, weights, graphs' buffers)
        before = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
        engines[g] = _engine(device, "auto", g, True)
        after = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
        memory_mb[g] = (after - before) / 2**20
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for rnd in range(rounds + 1):
        for graphs in (False, True) if rnd % 2 else (True, False):
            engine = engines[graphs]
            engine.reset_prefix_cache()
            before = engine.stats()
            _load(engine, f"r{rnd}", queries, n)
            start = time.perf_counter()
            done = _drain(engine)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
            after = engine.stats()
            d = {k: after[k] - before.get(k, 0.0) for k in after}
            steps = max(d["num_steps"], 1.0)
            tokens = sum(c.num_tokens for r in done.values() for c in r.completions)
            row = {"ms_per_step": 1e3 * wall / steps, "tokens_per_s": tokens / wall,
                   "gpu_busy": d.get("stage_gpu_forward_s", 0.0) / wall,
                   "graph_steps": d.get("num_graph_steps", 0.0), "steps": steps}  # fmt: skip
            row.update({f"{s}_ms": 1e3 * d.get(f"stage_{s}_s", 0.0) / steps for s in STAGES})
            line = f"round {rnd} graphs={graphs}: {row['ms_per_step']:.2f} ms/step "
            line += f"{row['tokens_per_s']:.0f} tok/s busy {row['gpu_busy']:.0%}"
            print(line, flush=True)
            if rnd:
                rows[graphs].append(row)
    out: dict[str, Any] = {}
    for graphs, rs in rows.items():
        out[f"graphs_{graphs}"] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        out[f"graphs_{graphs}"]["engine_memory_mb"] = memory_mb[graphs]
        stats = engines[graphs].stats()
        out[f"graphs_{graphs}"]["capture_s"] = stats.get("graph_capture_s", 0.0)
    pairs = zip(rows[True], rows[False], strict=True)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs]
    out["graphs_vs_eager_tokens_per_s"] = {"median": statistics.median(ratios), "ratios": ratios}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    result: dict[str, Any] = {"device": args.device, "torch": torch.__version__}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    for name, part in (
        ("kernels", lambda: kernels(args.device)),
        ("parity", lambda: parity(args.device)),
        ("engine", lambda: engine_alone(args.device, args.rounds, args.queries, args.samples)),
    ):
        t = time.perf_counter()
        try:
            result[name] = part()
        except Exception as exc:  # one part failing must not hide the others
            result[name] = {"error": repr(exc)}
        took = time.perf_counter() - t
        print(f"== {name} ({took:.1f}s): {json.dumps(result[name], default=str)}", flush=True)
        save()
    eng = result.get("engine", {})
    if "graphs_True" in eng:
        on, off = eng["graphs_True"], eng["graphs_False"]
        gain = eng["graphs_vs_eager_tokens_per_s"]["median"]
        print(f"engine alone {args.queries}x{args.samples}: graphs {on['ms_per_step']:.2f} ms/step "
              f"(GPU busy {on['gpu_busy']:.0%}) vs eager {off['ms_per_step']:.2f} "
              f"({off['gpu_busy']:.0%}); tokens/s {gain:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
