"""Two builds of the project on the same job: is the newer one slower?

Each build is installed into a folder of its own (``pip install --no-deps --target DIR
<tree>``); every run is ``python -m spec_tot run`` in a fresh interpreter with that folder
first on ``PYTHONPATH`` (the CLI's main job unless ``--args`` says otherwise), from a
neutral working directory. Rounds are interleaved (order shuffled per round, seeded), round
0 is a warm-up and dropped; per round the ratio new/old of queries/s; the median ratio with
a bootstrap 90% interval, and whether the answers match.

    python benchmarks/versus.py --old /tmp/v_old --new /tmp/v_new --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from engine_process import bootstrap

__all__ = ["main"]


def run_once(site: str, extra: list[str], workdir: str) -> dict[str, Any]:
    out = Path(workdir) / "run.json"
    env = {**os.environ, "PYTHONPATH": site}
    command = [sys.executable, "-m", "spec_tot", "run", "--json", str(out), *extra]
    subprocess.run(command, cwd=workdir, env=env, check=True, capture_output=True, text=True)
    rows = json.loads(out.read_text())
    row = rows[0] if isinstance(rows, list) else rows
    return {"queries_per_s": row["metrics"]["queries_per_s"], "solved": row["metrics"]["solved"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--args", default="", help="extra arguments of `spec-tot run`")
    ap.add_argument("--json")
    args = ap.parse_args()
    extra = shlex.split(args.args)
    builds = {"old": args.old, "new": args.new}
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as workdir:
        for rnd in range(args.rounds + 1):
            order = list(builds)
            rng.shuffle(order)
            for name in order:
                row = run_once(builds[name], extra, workdir)
                print(f"round {rnd} {name}: {row['queries_per_s']:.2f} q/s "
                      f"{row['solved']} solved", flush=True)  # fmt: skip
                if rnd:
                    runs[name].append(row)
    ratios = [
        n["queries_per_s"] / o["queries_per_s"]
        for n, o in zip(runs["new"], runs["old"], strict=True)
    ]
    lo, hi = bootstrap(ratios, level=0.9)
    result = {
        "runs": runs,
        "ratios": ratios,
        "median": statistics.median(ratios),
        "ci90": [lo, hi],
        "same_solved": [
            n["solved"] == o["solved"] for n, o in zip(runs["new"], runs["old"], strict=True)
        ],
        "args": extra,
    }
    result["summary"] = (
        f"new/old queries/s {result['median']:.3f}x [{lo:.3f}, {hi:.3f}] over {len(ratios)} "
        f"rounds; old {statistics.median(r['queries_per_s'] for r in runs['old']):.2f}, new "
        f"{statistics.median(r['queries_per_s'] for r in runs['new']):.2f} q/s"
    )
    print(result["summary"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
