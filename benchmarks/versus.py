"""Two builds of the project on the same job: is the newer one slower?

Each build is installed into a folder of its own (``pip install --no-deps --target DIR
<tree>``); every run is ``python -m spec_tot run`` in a fresh interpreter with that folder
first on ``PYTHONPATH`` (the CLI's main job unless ``--args`` says otherwise), from a
neutral working directory. Rounds come from ``spec_tot.rounds`` (one dropped warm-up run,
then both builds per round in a seeded shuffled order); per round the ratio new/old of
queries/s; the median ratio with a bootstrap 90% interval, and whether the answers match.

    python benchmarks/versus.py --old /tmp/v_old --new /tmp/v_new --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from spec_tot.rounds import Run, schedule_rounds, summarize_rounds

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
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as workdir:
        for rnd, name in schedule_rounds(list(builds), args.rounds, args.seed):
            row = run_once(builds[name], extra, workdir)
            print(f"round {rnd} {name}: {row['queries_per_s']:.2f} q/s "
                  f"{row['solved']} solved", flush=True)  # fmt: skip
            runs.append(Run(rnd, name, row))
    cells = summarize_rounds(runs, lambda cell: "old" if cell == "new" else None)
    new = cells["new"]
    assert new.ratio is not None and new.interval is not None  # internal: every round ran
    lo, hi = new.interval
    result = {
        "runs": [{"round": r.round, "build": r.cell, **r.figures} for r in runs],
        "ratios": list(new.ratios),
        "median": new.ratio,
        "ci90": [lo, hi],
        "same_solved": len(set(cells["old"].solved) | set(new.solved)) == 1,
        "args": extra,
    }
    result["summary"] = (
        f"new/old queries/s {new.ratio:.3f}x [{lo:.3f}, {hi:.3f}] over {len(new.ratios)} "
        f"rounds; old {cells['old'].median:.2f}, new {new.median:.2f} q/s"
    )
    print(result["summary"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
