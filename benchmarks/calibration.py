"""Start-up calibration: do fresh starts agree, and what does the cache save?

Each start is a new process building the shipped Game-of-24 backend (policy + PRM) with
an empty calibration cache of its own (``SPEC_TOT_CACHE_DIR``), so it measures the step-cost
curve and the reward knee from scratch; then one more start reuses the last cache. Reports
the saturation batch, reward knee (tokens) and reward batch latency of every start, the
largest relative spread between fresh starts, and start-up seconds with and without the
cache. JSON via ``--json PATH``, one summary line.

    python benchmarks/calibration.py --starts 2 --json /tmp/calibration.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["main"]

_CHILD = """
import json, time, torch
torch.set_num_threads({threads})
start = time.perf_counter()
from spec_tot.adapters.local import create_local
from spec_tot.graphs import game24_task as task
policy, prm = str(task.asset_dir("policy")), str(task.asset_dir("prm"))
backend = create_local(policy_path=policy, prm_path=prm)
caps = backend.capabilities
print(json.dumps({{
    "startup_s": time.perf_counter() - start,
    "saturation_batch": caps.saturation_batch,
    "reward_batch_tokens": caps.reward_batch_tokens,
    "reward_batch_s": caps.reward_batch_s,
    "step_curve_s": {{k: v for k, v in caps.extra.items() if k.startswith("step_s_")}},
}}))
"""


def _start(cache_dir: str, threads: int) -> dict[str, Any]:
    env = {**os.environ, "SPEC_TOT_CACHE_DIR": cache_dir}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(threads=threads)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / min(values) if min(values) > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--starts", type=int, default=2, help="fresh starts (empty caches)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    fresh = []
    cache_dir = ""
    for i in range(args.starts):
        cache_dir = tempfile.mkdtemp(prefix="spec-tot-calibration-")
        fresh.append(_start(cache_dir, args.threads))
        print(f"fresh start {i + 1}: {fresh[-1]}", flush=True)
    cached = _start(cache_dir, args.threads)
    print(f"cached start: {cached}")
    fields = ("saturation_batch", "reward_batch_tokens", "reward_batch_s")
    spreads = {f: round(_spread([float(s[f]) for s in fresh]), 3) for f in fields}
    summary = {
        "fresh": fresh,
        "cached": cached,
        "spread": spreads,
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    startup = sum(s["startup_s"] for s in fresh) / len(fresh)
    print(
        "calibration spread over fresh starts: "
        + ", ".join(f"{f} {v:.1%}" for f, v in spreads.items())
        + f"; start-up {startup:.2f}s fresh, {cached['startup_s']:.2f}s cached"
    )


if __name__ == "__main__":
    main()
