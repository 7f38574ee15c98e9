"""The decoder's matmuls alone: MKL (``F.linear``) vs oneDNN on packed weights, float32.

Shapes of SmolLM2-135M (30 layers of fused q/k/v, o, fused gate/up, down projections, then
the tied 49,152 x 576 LM head: 540 MB of weights, far past the L3 cache, as in a real decode
step) and of the random 4 x 128 Llama, at 1..1024 rows. Each (rows, kernel) cell times one
pass over every weight; the kernels are interleaved within a round, rounds repeated, medians
reported with the per-round ratio to MKL (median, bootstrap 95% interval). oneDNN's weights
are packed for ``--pack-rows`` rows each (the layout ``linear.py`` picks from). ``--bf16``
adds oneDNN on bf16 packed weights (inputs cast to bf16 and the outputs back to float32
inside the timed call), the dtype vLLM's CPU build runs by default.

    python benchmarks/linear_kernels.py --json benchmarks/results/linear_kernels.json
    python benchmarks/linear_kernels.py --rows 1,8,32 --pack-rows 32 --bf16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["main"]

SHAPES = {
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
    "random": ([(384, 128), (128, 128), (1024, 128), (128, 512)], 4, (256, 128)),
}


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return out


def _pass(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    weights: list[torch.Tensor],
    inputs: list[torch.Tensor],
) -> Callable[[], None]:
    def run() -> None:
        for x, w in zip(inputs, weights, strict=True):
            fn(x, w)

    return run


def _onednn_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _onednn(x.to(torch.bfloat16), w).float()


def _bootstrap(values: list[float], n: int = 2000) -> list[float]:
    rng = random.Random(0)
    draws = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return [round(draws[int(0.025 * n)], 3), round(draws[int(0.975 * n) - 1], 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--rows", default="1,2,4,16,64,256,1024")
    parser.add_argument("--pack-rows", default="16,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--bf16", action="store_true", help="also oneDNN on bf16 weights")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer, layers, head = SHAPES[args.model]
    plain = [torch.randn(*s) * 0.02 for _ in range(layers) for s in layer]
    plain.append(torch.randn(*head) * 0.02)
    hints = [int(h) for h in args.pack_rows.split(",")]
    results: dict[str, dict[str, object]] = {}
    with torch.inference_mode():
        packed = {h: [torch.ops.mkldnn._reorder_linear_weight(w, h) for w in plain] for h in hints}
        halves = [
            torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), hints[0])
            for w in (plain if args.bf16 else [])
        ]
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = [torch.randn(rows, w.shape[1]) for w in plain]
            cells = {"mkl": _pass(F.linear, plain, inputs)}
            for h, weights in packed.items():
                cells[f"onednn_pack{h}"] = _pass(_onednn, weights, inputs)
            if halves:
                cells[f"onednn_bf16_pack{hints[0]}"] = _pass(_onednn_bf16, halves, inputs)
            times: dict[str, list[float]] = {k: [] for k in cells}
            order = list(cells)
            rng = random.Random(rows)
            for rnd in range(args.rounds + 1):  # round 0: warm-up, dropped
                rng.shuffle(order)
                for name in order:
                    start = time.perf_counter()
                    cells[name]()
                    if rnd:
                        times[name].append(time.perf_counter() - start)
            row: dict[str, object] = {
                k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()
            }
            speedups: dict[str, float] = {}
            for name in cells:
                if name != "mkl":
                    ratios = [a / b for a, b in zip(times["mkl"], times[name], strict=True)]
                    speedups[name] = round(statistics.median(ratios), 3)
                    row[f"{name}_speedup"] = speedups[name]
                    row[f"{name}_speedup_ci95"] = _bootstrap(ratios)
            results[str(rows)] = row
            best = max(speedups, key=speedups.__getitem__)
            print(f"{rows:>5} rows: mkl {row['mkl']} ms, best {best} {speedups[best]}x", flush=True)
    summary = {
        "model_shapes": args.model,
        "ms_per_pass": results,
        "threads": args.threads,
        "rounds": args.rounds,
        "weights_mb": round(sum(w.numel() for w in plain) * 4 / 2**20, 1),
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    line = ", ".join(
        f"{r} rows " + "/".join(f"{v[f'onednn_pack{h}_speedup']}x" for h in hints)
        for r, v in results.items()
    )
    print(
        f"oneDNN (packed for {'/'.join(map(str, hints))} rows) vs MKL, {args.model} matmuls, "
        f"{args.threads} threads, median of {args.rounds} interleaved rounds: {line}"
    )


if __name__ == "__main__":
    main()
