"""Issue 47's acceptance grid: Game of 24, {beam, REBASE, rStar, REST-MCTS*} x {1, 4, 16,
32} in flight, ``baseline`` / ``dedup`` / ``full``, one ``spec-tot bench --rounds`` per
(policy, concurrency) with 4x the concurrency in queries (2x at 32), so every cell's
ratio comes from interleaved rounds in one process (order shuffled, warm-up dropped).

Per cell: ``full`` over ``dedup`` (the control: engine dedup, no speculation) with its 90%
bootstrap interval and launched / adopted speculative nodes; ``dedup`` over ``baseline``;
``full`` over ``baseline`` (the rStar-at-one-query criterion).

    python benchmarks/policy_grid.py --seed 0 --rounds 5 --out results/policy_grid/seed0

Writes one ``spec-tot bench`` JSON per cell under ``--out``, and ``grid.json`` there:
{"cells": [...], "summary": one line}; prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from spec_tot.rounds import Run, summarize_rounds

POLICIES = ("beam", "rebase", "rstar", "rest_mcts")
CONCURRENCY = (1, 4, 16, 32)


def _queries(concurrency: int) -> int:
    return 4 * concurrency if concurrency < 32 else 2 * concurrency


def _bench(policy: str, concurrency: int, args: argparse.Namespace, path: Path) -> None:
    command = [
        sys.executable, "-m", "spec_tot", "bench", "--program", "game24", "--search", policy,
        "--modes", "baseline,dedup,full", "--concurrency", str(concurrency),
        "--queries", str(_queries(concurrency)), "--rounds", str(args.rounds),
        "--control", "dedup", "--seed", str(args.seed), "--json", str(path),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def _cell(policy: str, concurrency: int, payload: dict[str, Any]) -> dict[str, Any]:
    runs = [Run(int(r["round"]), r["mode"], r["metrics"]) for r in payload["runs"]]
    vs_dedup = summarize_rounds(runs, lambda m: None if m == "dedup" else "dedup")
    vs_base = summarize_rounds(runs, lambda m: None if m == "baseline" else "baseline")
    full, dedup = vs_dedup["full"], vs_dedup["dedup"]
    return {
        "policy": policy,
        "concurrency": concurrency,
        "queries": _queries(concurrency),
        "full_vs_dedup": full.ratio,
        "interval": list(full.interval or ()),
        "launched": full.launched,
        "adopted": full.adopted,
        "dedup_vs_baseline": vs_base["dedup"].ratio,
        "full_vs_baseline": vs_base["full"].ratio,
        "full_vs_baseline_interval": list(vs_base["full"].interval or ()),
        "solved": {m: list(vs_dedup[m].solved) for m in ("baseline", "dedup", "full")},
        "dedup_qps": dedup.median,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cells = []
    for policy in args.policies.split(","):
        for concurrency in map(int, args.concurrency.split(",")):
            path = args.out / f"{policy}_c{concurrency}.json"
            _bench(policy, concurrency, args, path)
            cell = _cell(policy, concurrency, json.loads(path.read_text()))
            lo, hi = cell["interval"]
            print(f"{policy}@{concurrency}: full {cell['full_vs_dedup']:.2f}x dedup "
                  f"[{lo:.2f}, {hi:.2f}] ({cell['launched']}/{cell['adopted']}), "
                  f"full {cell['full_vs_baseline']:.2f}x baseline, "
                  f"solved {cell['solved']}", flush=True)  # fmt: skip
            cells.append(cell)
    summary = "; ".join(
        f"{c['policy']}@{c['concurrency']} {c['full_vs_dedup']:.2f}x "
        f"[{c['interval'][0]:.2f}, {c['interval'][1]:.2f}]"
        for c in cells
    )
    line = f"game24 seed {args.seed}, full / dedup: {summary}"
    (args.out / "grid.json").write_text(json.dumps({"cells": cells, "summary": line}, indent=1))
    print(line)


if __name__ == "__main__":
    sys.exit(main())
