"""Evaluate the shipped Game-of-24 policy and PRM on the ToT paper's test ranks (901-1000).

Prints JSON: greedy single-path solve rate and step legality of the policy (transformers
``generate``), and the PRM's accuracy / AUC on the policy's own sampled candidates, labelled by
the exact solver (a step is good iff the trace is legal so far and can still reach 24).

    python scripts/eval_game24.py [--policy DIR] [--prm DIR] [--samples 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_game24 as tg

from spec_tot.graphs import game24_task as g24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", type=Path, default=g24.asset_dir("policy"))
    ap.add_argument("--prm", type=Path, default=g24.asset_dir("prm"))
    ap.add_argument("--start", type=int, default=g24.TEST_RANKS[0])
    ap.add_argument("--end", type=int, default=g24.TEST_RANKS[1])
    ap.add_argument("--samples", type=int, default=16, help="policy samples a puzzle for the PRM")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-prm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    puzzles = [p.text for p in g24.load_puzzles(args.start, args.end)]
    tok = AutoTokenizer.from_pretrained(args.policy, local_files_only=True)
    policy = AutoModelForCausalLM.from_pretrained(args.policy, local_files_only=True)
    report: dict[str, object] = {"ranks": [args.start, args.end], "puzzles": len(puzzles)}
    report.update(tg.policy_metrics(policy, tok, puzzles))
    if not args.skip_prm:
        prm = AutoModelForCausalLM.from_pretrained(args.prm, local_files_only=True)
        prm_tok = AutoTokenizer.from_pretrained(args.prm, local_files_only=True)
        torch.manual_seed(args.seed)
        items = tg.candidate_items(policy, tok, puzzles, args.samples, args.temperature)
        first = [labels[0] for _, _, labels in items]
        report["sampled_first_step_solvable"] = sum(first) / max(1, len(first))
        report.update(tg.prm_eval(prm, prm_tok, items))
    report["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
