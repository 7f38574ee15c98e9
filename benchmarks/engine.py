"""Embedded engine throughput vs transformers (static ``generate`` and continuous batching).

Same model (a random-init 4-layer, 128-wide Llama unless ``--model PATH``), same prompts,
greedy, a fixed number of new tokens (no eos), batch sizes 1, 4, 16, 64, one timed run each
after a small warm-up. Output tokens per second, JSON via ``--json PATH``, one summary line.

    python benchmarks/engine.py --json /tmp/engine.json
"""

from __future__ import annotations

import argparse
import json
import random
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


def make_ours(hf: Any) -> Callable[[Any, list[list[int]], int], int]:
    """Our engine, built once outside the timed region (a server keeps it warm), running
    greedy fixed-length requests to completion."""
    from spec_tot.adapters.local.config import EngineConfig
    from spec_tot.adapters.local.engine import LLMEngine
    from spec_tot.adapters.local.loader import from_hf_model
    from spec_tot.requests import GenerateRequest, SamplingParams

    config = EngineConfig(
        model_config={},
        block_size=16,
        num_kv_blocks=1024,
        max_num_seqs=128,
        max_model_len=1024,
        max_num_batched_tokens=8192,
        saturation_batch=32,
        enable_prefix_caching=False,  # nothing to share here; keep the comparison plain
    )
    engine = LLMEngine(config, from_hf_model(hf, "cpu", torch.float32))
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


def run_cb(hf: Any, prompts: list[list[int]], new: int) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.inference_mode():
        # persistent manager: its set-up (seconds on CPU) is paid once, in the warm-up
        out = hf.generate_batch(
            inputs=prompts, generation_config=config, progress_bar=False, persistent_manager=True
        )
    return sum(len(o.generated_tokens) for o in out.values())


def _time(fn: Callable[..., int], *args: Any) -> float:
    start = time.perf_counter()
    tokens = fn(*args)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="local HF folder (default: random 4x128)")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-cb", action="store_true", help="skip transformers' CB")
    parser.add_argument("--repeats", type=int, default=3, help="best of N timed runs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf = _hf_model(args.model)
    vocab = hf.config.vocab_size
    methods: dict[str, Callable[..., int]] = {"ours": make_ours(hf), "static": run_static}
    if not args.skip_cb:
        methods["transformers_cb"] = run_cb
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, dict[str, float]] = {str(b): {} for b in batches}
    # One method at a time, CB last: its persistent manager keeps a thread alive that would
    # otherwise compete with the others. Best of ``--repeats`` runs: noise only slows down.
    for name, fn in methods.items():
        try:
            fn(hf, _prompts(2, vocab, 99), 4)  # warm-up: first-call costs are not throughput
        except Exception as exc:  # an API missing in this transformers: report, go on
            print(f"{name}: unavailable ({exc!r})")
            continue
        for batch in batches:
            prompts = _prompts(batch, vocab, batch)
            best = max(_time(fn, hf, prompts, args.new_tokens) for _ in range(args.repeats))
            results[str(batch)][name] = round(best, 1)
    for batch in batches:
        print(
            f"batch {batch:3d}: "
            + "  ".join(f"{n} {v:8.1f} tok/s" for n, v in results[str(batch)].items())
        )
    ratios = {
        b: {k: round(r["ours"] / r[k], 2) for k in r if k != "ours"} for b, r in results.items()
    }
    summary = {
        "results_tok_s": results,
        "ratios_ours_over": ratios,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "model": args.model or "random llama 4x128",
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    line = "; ".join(
        f"b{b}: " + ", ".join(f"{v}x vs {k}" for k, v in r.items()) for b, r in ratios.items()
    )
    print(f"engine throughput ratio (ours / baseline): {line}")


if __name__ == "__main__":
    main()
