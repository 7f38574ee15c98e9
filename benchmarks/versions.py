"""The main job at two checkouts of spec-tot, before and after a change, in one run.

``spec-tot run`` (Game of 24, the bundled model and PRM, REBASE width 8, ``full``, 32 in
flight, 100 puzzles: the README's main job) from this checkout ("after") and from
``--before REV`` ("before", a git revision checked out into a temporary worktree), each run
a fresh process, interleaved in a seeded shuffled order per round after a dropped warm-up
(``spec_tot.rounds``). The before side runs on this interpreter's packages (torch and the
rest) with its own ``spec_tot`` first on the path: a throwaway virtual environment whose
path files name the worktree and then this environment's site-packages, so neither side
sees the other's code and the child processes it starts inherit the same.

Figure: queries/s, ratio after / before per round, median with a bootstrap 90% interval;
solved counts and launched/adopted speculative nodes per run.

    python benchmarks/versions.py --before 0f35945 --rounds 5 --json v.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import site
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spec_tot.rounds import Run, schedule_rounds, summarize_rounds

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def before_interpreter(rev: str) -> Iterator[str]:
    """A Python that imports spec-tot at ``rev`` and this environment's other packages."""
    with tempfile.TemporaryDirectory(prefix="spec-tot-before-") as tmp:
        tree, venv = Path(tmp) / "tree", Path(tmp) / "venv"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(tree), rev], check=True)  # fmt: skip
        try:
            # the layout maps spec_tot.adapters / .graphs onto top-level folders (pyproject)
            for sub in ("adapters", "graphs"):
                (tree / "spec_tot" / sub).symlink_to(tree / sub, target_is_directory=True)
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                           check=True)  # fmt: skip
            python = venv / "bin" / "python"
            packages = Path(
                subprocess.check_output(
                    [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                    text=True,
                ).strip()
            )
            # path files are read in name order: the worktree's spec_tot before this one's
            (packages / "a_spec_tot_before.pth").write_text(f"{tree}\n")
            (packages / "b_environment.pth").write_text(f"{site.getsitepackages()[0]}\n")
            yield str(python)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tree)], check=False)  # fmt: skip


def one_run(python: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    command = [python, "-m", "spec_tot", "run", "--queries", str(args.queries),
               "--concurrency", str(args.concurrency), "--json", str(out)]  # fmt: skip
    # from a neutral folder: this checkout's spec_tot must not shadow the before side's
    subprocess.run(command, check=True, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL)
    metrics = json.loads(out.read_text())[0]["metrics"]  # spec-tot run: a list of rows
    keys = ("queries_per_s", "solved", "speculative_nodes", "speculative_hits")
    return {key: float(metrics.get(key, 0)) for key in keys}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="a git revision of this repository")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    head = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                   text=True).strip()  # fmt: skip
    runs: list[Run] = []
    with before_interpreter(args.before) as before, tempfile.TemporaryDirectory() as tmp:
        pythons = {"before": before, "after": sys.executable}
        for rnd, cell in schedule_rounds(list(pythons), args.rounds, args.seed):
            figures = one_run(pythons[cell], args, Path(tmp) / f"{rnd}-{cell}.json")
            runs.append(Run(rnd, cell, figures))
            print(f"round {rnd} {cell}: {figures}", flush=True)
    summary = summarize_rounds(runs, lambda cell: "before" if cell == "after" else None)
    after, first = summary["after"], summary["before"]
    lo, hi = after.interval or (float("nan"), float("nan"))
    line = (
        f"main job after ({head}) / before ({args.before}): {after.ratio:.2f}x [{lo:.2f}, "
        f"{hi:.2f}] ({after.median:.2f} vs {first.median:.2f} q/s), solved "
        f"{list(after.solved)} vs {list(first.solved)}, launched/adopted {after.launched}/"
        f"{after.adopted} vs {first.launched}/{first.adopted}"
    )
    result = {"before": args.before, "after": head, "rounds": args.rounds,
              "queries": args.queries, "concurrency": args.concurrency,
              "runs": [{"round": r.round, "cell": r.cell, **r.figures} for r in runs],
              "summary": {k: v.to_dict() for k, v in summary.items()}, "line": line}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(line)


if __name__ == "__main__":
    main()
