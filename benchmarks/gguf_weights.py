"""The embedded engine on SmolLM2-135M with its GGUF's quantized weights at decode steps
(``EngineConfig(weights="gguf")``: Q4_1 layers, the Q8_0 LM head) against its float32
weights (``"float"``, the control).

The engine alone (no process boundary, no server), the model folder of
``scripts/fetch_smollm2.py``, GSM8K chat prompts, greedy, a fixed number of new tokens (EOS
ignored), static batches. Interleaved rounds (``spec_tot.rounds``): round 0 a dropped
warm-up, every (batch, weights) cell once per round in a seeded shuffled order; per batch
the median tokens/s and the median of per-round ratios gguf / float with a bootstrap 90%
interval. Then the accuracy cost: greedy tokens generated alone (batch 1) by both, per
prompt, as the share of prompts whose continuations are identical and the mean share of
tokens before the first difference.

    python benchmarks/gguf_weights.py --json benchmarks/results/gguf_weights.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from spec_tot.adapters.local.config import EngineConfig
from spec_tot.adapters.local.engine.llm_engine import LLMEngine
from spec_tot.graphs.math import math_inputs, smollm2_folder
from spec_tot.requests import GenerateRequest, SamplingParams
from spec_tot.rounds import Run, schedule_rounds, summarize_rounds, summary_line

__all__ = ["main"]


def _engine(folder: str, weights: str) -> LLMEngine:
    config = EngineConfig(
        model=folder, weights=weights, block_size=16, num_kv_blocks=2048, max_num_seqs=64,
        max_model_len=1024, saturation_batch=32, enable_prefix_caching=False,
        token_speculation=False,
    )  # fmt: skip
    return LLMEngine(config)


def _prompts(engine: LLMEngine, n: int) -> list[tuple[int, ...]]:
    tokenizer = engine.tokenizer
    out = []
    for item in math_inputs(n):
        chat = [{"role": "user", "content": item["question"]}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        out.append(tuple(tokenizer.encode(text)))
    return out


def _generate(engine: LLMEngine, prompts: list[tuple[int, ...]], new: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start = time.monotonic_ns()
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{start}-{i}", params, prompt_ids=ids))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for result in engine.step():
            outputs[result.request_id] = list(result.completions[0].token_ids)
    return [outputs[f"r{start}-{i}"] for i in range(len(prompts))]


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    same, prefix = 0, []
    for x, y in zip(a, b, strict=True):
        first = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        same += first == len(x)
        prefix.append(first / len(x))
    return {"identical": same / len(a), "mean_prefix_share": sum(prefix) / len(prefix)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--agreement", type=int, default=16, help="prompts compared greedily")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = str(smollm2_folder())
    engines = {w: _engine(folder, w) for w in ("float", "gguf")}
    model = engines["gguf"].loaded.model
    layer_path, head_path = model.layer(0).o_linear.quant, model.head_linear.quant
    batches = [int(b) for b in args.batches.split(",")]
    prompts = _prompts(engines["float"], max([*batches, args.agreement]))
    cells = [f"{w}@{b}" for b in batches for w in ("float", "gguf")]
    runs = []
    for rnd, cell in schedule_rounds(cells, args.rounds, seed=0):
        weights, batch = cell.split("@")
        started = time.perf_counter()
        out = _generate(engines[weights], prompts[: int(batch)], args.new)
        seconds = time.perf_counter() - started
        runs.append(Run(rnd, cell, {"tokens_per_s": sum(map(len, out)) / seconds}))
    summary = summarize_rounds(
        runs, control=lambda c: None if c.startswith("float") else "float@" + c.split("@")[1],
        metric="tokens_per_s",
    )  # fmt: skip
    alone = {w: [_generate(e, [p], args.new)[0] for p in prompts[: args.agreement]]
             for w, e in engines.items()}  # fmt: skip
    result: dict[str, Any] = {
        "model": folder, "threads": args.threads, "new_tokens": args.new,
        "rounds": args.rounds,
        "max_rows": layer_path.max_rows if layer_path else 0,
        "head_max_rows": head_path.max_rows if head_path else 0,
        "cpu": os.uname().machine, "cells": {k: v.to_dict() for k, v in summary.items()},
        "agreement": _agreement(alone["float"], alone["gguf"]),
    }  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    print(f"max_rows={result['max_rows']} head_max_rows={result['head_max_rows']} "
          f"agreement={result['agreement']}")  # fmt: skip
    print("summary: " + summary_line(summary, "tokens_per_s"))


if __name__ == "__main__":
    main()
