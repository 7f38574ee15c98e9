"""Embedded engine throughput, two workloads, one process, variants interleaved.

1. **Static batches** vs transformers' static ``generate``: the same model (a random-init
   4-layer, 128-wide Llama unless ``--model PATH``, e.g. the SmolLM2 folder of
   ``scripts/fetch_smollm2.py``), the same prompts, greedy, a fixed number of new tokens (EOS
   ignored), batch sizes 1..64. Interleaved rounds: each round runs every (batch, variant)
   once in a shuffled order, round 0 is a warm-up and dropped, ``--repeats`` rounds count;
   per batch the median of the per-round ratios and its bootstrap 95% interval.
2. **Stream of short requests**: ``LONG`` requests decode while short requests (10-30 new
   tokens, 20 on average, ToT-child prompts: a shared 48-token question plus 16 tokens of
   their own) arrive, ``SHORT`` in flight (a closed loop: a new one as soon as one
   finishes), until ``--short`` of them are done. Mixed steps (``mixed_steps=True``) vs the
   all-prefill / all-decode scheduler (``False``), same model, same requests, prefix caching
   on, engines built once; output tokens per second over the whole run.

Output tokens per second by wall time and by this process's CPU time (steadier on a shared
machine), JSON via ``--json PATH``, one summary line. ``uptime``'s load is recorded beside
the figures.

    python benchmarks/engine.py --json /tmp/engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["main"]


def _hf_model(path: str | None) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if path:
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def _prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(batch)]


def make_engine(hf: Any, **options: Any) -> Any:
    """Our engine, built once outside the timed region (a server keeps it warm)."""
    from spec_tot.adapters.local.config import EngineConfig
    from spec_tot.adapters.local.engine.llm_engine import LLMEngine
    from spec_tot.adapters.local.model.loader import from_hf_model

    config = EngineConfig(
        model_config={},
        block_size=16,
        num_kv_blocks=1024,
        max_num_seqs=128,
        max_model_len=1024,
        max_num_batched_tokens=options.pop("max_num_batched_tokens", 2048),
        saturation_batch=32,
        enable_prefix_caching=options.pop("enable_prefix_caching", False),
        **options,
    )
    return LLMEngine(config, from_hf_model(hf, "cpu", torch.float32))


def make_ours(hf: Any, **options: Any) -> Callable[[Any, list[list[int]], int], int]:
    """Greedy fixed-length requests run to completion on one engine."""
    from spec_tot.requests import GenerateRequest, SamplingParams

    engine = make_engine(hf, **options)
    counter = iter(range(10**9))

    def run(_hf: Any, prompts: list[list[int]], new: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        for ids in prompts:
            engine.add_request(GenerateRequest(f"r{next(counter)}", params, prompt_ids=tuple(ids)))
        tokens = 0
        while engine.has_unfinished():
            tokens += sum(c.num_tokens for r in engine.step() for c in r.completions)
        return tokens

    return run


def run_static(hf: Any, prompts: list[list[int]], new: int) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return int((out.shape[1] - width) * len(prompts))


def stream_workload(engine: Any, vocab: int, *, short: int, in_flight: int, long: int) -> int:
    """Output tokens of ``long`` decoding requests plus a closed loop of short ones (10 to
    30 new tokens each, 20 on average; the same requests for every engine), run until the
    last short one finishes."""
    from spec_tot.requests import GenerateRequest, SamplingParams

    rng = random.Random(7)
    stem = [rng.randrange(3, vocab) for _ in range(48)]
    long_params = SamplingParams(temperature=0.0, max_tokens=10**4 // 16, ignore_eos=True)
    for i in range(long):
        ids = tuple(rng.randrange(3, vocab) for _ in range(64))
        engine.add_request(GenerateRequest(f"long/{i}", long_params, prompt_ids=ids))
    sent = done = tokens = 0
    while done < short:
        # each finished one is replaced at once; their lengths differ, so arrivals spread
        # over the steps, as the children of a search arrive
        while sent - done < in_flight and sent < short:
            tail = tuple(rng.randrange(3, vocab) for _ in range(16))
            ids = tuple(stem) + tail  # a ToT child: the question, then its own steps
            # 20 tokens on average, as search steps vary: 10..30
            params = SamplingParams(
                temperature=0.0, max_tokens=rng.randint(10, 30), ignore_eos=True
            )
            engine.add_request(GenerateRequest(f"short/{sent}", params, prompt_ids=ids))
            sent += 1
        for result in engine.step():
            done += result.request_id.startswith("short/")
            tokens += sum(c.num_tokens for c in result.completions)
    return tokens + sum(c.num_tokens for r in engine.abort("long") for c in r.completions)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _measure(fn: Callable[[], int]) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return tokens / (time.perf_counter() - wall), tokens / (time.process_time() - cpu)


def _bootstrap(values: list[float], n: int = 2000) -> list[float]:
    rng = random.Random(0)
    draws = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return [round(draws[int(0.025 * n)], 3), round(draws[int(0.975 * n) - 1], 3)]


def _rounds(
    cells: dict[str, dict[str, Callable[[], int]]], rounds: int, seed: int = 0
) -> dict[str, dict[str, list[float]]]:
    """Wall tokens/s of every (group, variant) in ``rounds`` + 1 rounds; each round runs
    every cell once in a shuffled order, and round 0 (the warm-up) is dropped."""
    rng = random.Random(seed)
    order = [(g, v) for g, fns in cells.items() for v in fns]
    out: dict[str, dict[str, list[float]]] = {g: {v: [] for v in fns} for g, fns in cells.items()}
    for rnd in range(rounds + 1):
        rng.shuffle(order)
        for group, variant in order:
            wall, _ = _measure(cells[group][variant])
            if rnd:
                out[group][variant].append(wall)
    return out


def _summary(runs: dict[str, list[float]], top: str, bottom: str) -> dict[str, Any]:
    """Medians per variant and the per-round ratio ``top / bottom`` (median, 95% interval)."""
    ratios = [a / b for a, b in zip(runs[top], runs[bottom], strict=True)]
    out: dict[str, Any] = {v: round(statistics.median(t), 1) for v, t in runs.items()}
    out["ratio"] = round(statistics.median(ratios), 3)
    out["ratio_ci95"] = _bootstrap(ratios)
    out["rounds"] = {v: [round(x, 1) for x in t] for v, t in runs.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="local HF folder (default: random 4x128)")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds (+1 warm-up)")
    parser.add_argument("--short", type=int, default=160, help="short requests a stream")
    parser.add_argument(
        "--streams",
        default="32x8,32x16,32x32,0x32",
        help="stream workloads, LONGxSHORT: decoding requests x short ones in flight",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf = _hf_model(args.model)
    vocab = hf.config.vocab_size
    ours = make_ours(hf)
    ours(hf, _prompts(2, vocab, 99), 4)  # warm-up: first-call costs are not throughput
    run_static(hf, _prompts(2, vocab, 99), 4)
    load_before = _load()
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: _prompts(b, vocab, b) for b in batches}
    static_runs = _rounds(
        {
            str(b): {
                "ours": lambda p=prompts[b]: ours(hf, p, args.new_tokens),
                "static": lambda p=prompts[b]: run_static(hf, p, args.new_tokens),
            }
            for b in batches
        },
        args.repeats,
    )
    static = {b: _summary(r, "ours", "static") for b, r in static_runs.items()}
    for b, row in static.items():
        print(f"batch {b:>3}: ours/static {row['ratio']}x {row['ratio_ci95']}", flush=True)
    # the stream's children share their question: prefix caching on, as a search runs
    engines = {
        "mixed": make_engine(hf, enable_prefix_caching=True),
        "legacy": make_engine(hf, mixed_steps=False, enable_prefix_caching=True),
    }
    stream_cells: dict[str, dict[str, Callable[[], int]]] = {}
    for spec in [s for s in args.streams.split(",") if s]:
        long, in_flight = (int(x) for x in spec.split("x"))
        stream_cells[spec] = {
            name: lambda e=engine, n=long, f=in_flight: stream_workload(
                e, vocab, short=args.short, in_flight=f, long=n
            )
            for name, engine in engines.items()
        }
    streams = {
        k: _summary(r, "mixed", "legacy") for k, r in _rounds(stream_cells, args.repeats).items()
    }
    summary = {
        "static_tok_s": static,
        "stream_tok_s": streams,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "short_requests": args.short,
        "model": args.model or "random llama 4x128",
        "load_before": load_before,
        "load_after": _load(),
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    line = ", ".join(f"b{b} {r['ratio']}x {r['ratio_ci95']}" for b, r in static.items())
    stream_line = ", ".join(f"{k} {r['ratio']}x {r['ratio_ci95']}" for k, r in streams.items())
    print(
        f"engine / transformers static generate (wall tok/s, median of {args.repeats} "
        f"interleaved rounds, {args.threads} threads): {line}; mixed / all-prefill-or-decode "
        f"steps on a stream of short requests: {stream_line} (load {load_before} -> {_load()})"
    )


if __name__ == "__main__":
    main()
