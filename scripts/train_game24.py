"""Train the tiny Game-of-24 policy and process reward model shipped in graphs/assets/game24.

Seeded and deterministic: the run is fixed by --seed and the step counts; the defaults
(3,002 policy steps, 1,800 PRM steps, about 19 + 16 minutes on 1 CPU thread) rebuild the shipped
models. ``--minutes`` / ``--prm-minutes`` instead choose a step count from the speed of the
first 20 steps; the count is logged in ``training_log.json`` and the ``--*-steps`` flags replay it.

    python scripts/train_game24.py --which both                      # the shipped models
    python scripts/train_game24.py --out /tmp/smoke --minutes 1 --prm-minutes 1 --prm-samples 2

Policy: a small LlamaForCausalLM trained on the exact solver's solution traces for ranks 1-900
(a seeded subset held out for validation). Each training sequence is drawn by walking the trie
of distinct solution traces with a uniform choice at every level, so the root sees every first
step that keeps the puzzle solvable equally often (first-step diversity).

PRM: the same architecture, initialised from the policy, trained on the policy's own sampled
candidates (ranks 1-900) labelled by the solver, mixed with solver traces and corruptions; the
loss is a two-way good/bad cross entropy at each STEP_TAG position, classes balanced.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from spec_tot.graphs import game24_task as g24

VAL_PUZZLES = 50
MAX_NEW_TOKENS = 150
Trie = dict[str, Any]


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def split_training_puzzles(seed: int) -> tuple[list[g24.Puzzle], list[g24.Puzzle]]:
    """(train, validation) puzzles, both drawn from TRAIN_RANKS only."""
    puzzles = g24.load_puzzles(*g24.TRAIN_RANKS)
    order = np.random.default_rng(seed).permutation(len(puzzles))
    val = {int(i) for i in order[:VAL_PUZZLES]}
    train = [p for i, p in enumerate(puzzles) if i not in val]
    return train, [p for i, p in enumerate(puzzles) if i in val]


def solution_trie(puzzle: str) -> Trie:
    traces = g24.solutions(puzzle, allow_negative=False) or g24.solutions(puzzle)
    trie: Trie = {}
    for trace in traces:
        node = trie
        for step in trace:
            node = node.setdefault(step, {})
    return trie


def sample_trace(trie: Trie, rng: np.random.Generator) -> list[str]:
    steps: list[str] = []
    while trie:
        keys = sorted(trie)
        step = keys[int(rng.integers(len(keys)))]
        steps.append(step)
        trie = trie[step]
    return steps


def model_config(tok: Any, args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def encode(tok: Any, text: str) -> list[int]:
    ids: list[int] = tok(text)["input_ids"]
    return ids


def pad_batch(seqs: Sequence[list[int]], labels: Sequence[list[int]], pad: int) -> dict[str, Any]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, y) in enumerate(zip(seqs, labels, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(y)] = torch.tensor(y)
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def policy_example(tok: Any, puzzle: str, steps: list[str]) -> tuple[list[int], list[int]]:
    """Token ids and labels (loss only on the steps and the final <eos>)."""
    head = encode(tok, g24.prompt(puzzle, []))
    ids = [*encode(tok, g24.prompt(puzzle, steps)), tok.eos_token_id]
    return ids, [-100] * len(head) + ids[len(head) :]


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_loop(
    model: LlamaForCausalLM,
    next_batch: Any,
    loss_fn: Any,
    val_fn: Any,
    steps: int | None,
    minutes: float,
    lr: float,
    log: dict[str, Any],
) -> None:
    """AdamW with warmup + cosine; total steps fixed up front or calibrated on 20 steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    t0, total, step, running = time.time(), steps, 0, []
    while total is None or step < total:
        if total is None and step == 20:
            total = max(200, int(minutes * 60 / ((time.time() - t0) / 20) * 0.9))
            print(f"calibrated: {total} steps for {minutes} min", flush=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total or 10**9, lr)
        model.train()
        loss = loss_fn(model, next_batch())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running.append(loss.item())
        step += 1
        if step % 100 == 0 or step == total:
            model.eval()
            with torch.no_grad():
                val = val_fn(model)
            entry = {
                "step": step,
                "train_loss": float(np.mean(running)),
                "wall_s": time.time() - t0,
            }
            entry.update(val)
            log["curve"].append(entry)
            running = []
            print(json.dumps(entry), flush=True)
    log["steps"] = total
    log["train_wall_s"] = time.time() - t0


def generate_traces(
    model: LlamaForCausalLM,
    tok: Any,
    puzzles: Sequence[str],
    n: int = 1,
    temperature: float = 0.0,
    batch: int = 128,
) -> list[list[list[str]]]:
    """Per puzzle, ``n`` traces (up to three step lines each) from transformers generate."""
    tok.padding_side = "left"
    out: list[list[list[str]]] = []
    per = max(1, batch // n)
    model.eval()
    for k in range(0, len(puzzles), per):
        chunk = list(puzzles[k : k + per])
        enc = tok([g24.prompt(p, []) for p in chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = model.generate(
                **enc,
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_k=0 if temperature > 0 else None,
                num_return_sequences=n,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for i in range(len(chunk)):
            out.append([split_steps(t) for t in texts[i * n : (i + 1) * n]])
    return out


def split_steps(text: str) -> list[str]:
    steps = []
    for line in text.split("\n")[:3]:
        for tag in (g24.STEP_TAG, g24.GOOD_TOKEN, g24.BAD_TOKEN):
            line = line.replace(tag, "")  # never seen in training; keeps one tag per step
        if not line:
            break
        steps.append(line)
    return steps


def step_labels(puzzle: str, steps: Sequence[str]) -> list[bool]:
    """Good iff every step so far is legal and the numbers left can still reach 24."""
    labels, state, ok = [], g24.parse_numbers(puzzle), True
    for step in steps:
        after = g24.apply_step(state, step) if ok else None
        ok = after is not None and g24.solvable(after)
        labels.append(ok)
        state = after if after is not None else state
    return labels


def policy_metrics(model: LlamaForCausalLM, tok: Any, puzzles: Sequence[str]) -> dict[str, float]:
    """Greedy single-path solve rate, step legality (up to the first illegal step)."""
    traces = [t[0] for t in generate_traces(model, tok, puzzles)]
    solved = legal = total = first_legal = 0
    for puzzle, steps in zip(puzzles, traces, strict=True):
        solved += g24.check_answer(puzzle, steps)
        state: tuple[Fraction, ...] | None = g24.parse_numbers(puzzle)
        for i, step in enumerate(steps):
            state = g24.apply_step(state, step) if state is not None else None
            total += 1
            legal += state is not None
            first_legal += i == 0 and state is not None
            if state is None:
                break
    n = max(1, len(puzzles))
    return {
        "greedy_solve_rate": solved / n,
        "step_legality": legal / max(1, total),
        "first_step_legality": first_legal / n,
    }


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels], scores[~labels]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    ranks = np.argsort(np.argsort(np.concatenate([pos, neg]), kind="stable"), kind="stable")
    ranks = ranks.astype(np.float64) + 1
    allv = np.concatenate([pos, neg])  # average ranks of ties
    for v in np.unique(allv):
        idx = allv == v
        ranks[idx] = ranks[idx].mean()
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def prm_batch(
    tok: Any, items: Sequence[tuple[str, list[str], list[bool]]], good: int, bad: int
) -> dict[str, Any]:
    tag = tok.convert_tokens_to_ids(g24.STEP_TAG)
    seqs, labs = [], []
    for puzzle, steps, labels in items:
        ids = encode(tok, g24.prm_input(puzzle, steps))
        lab = [-100] * len(ids)
        tags = [i for i, t in enumerate(ids) if t == tag]
        for pos, ok in zip(tags, labels, strict=True):
            lab[pos] = good if ok else bad
        seqs.append(ids)
        labs.append(lab)
    return pad_batch(seqs, labs, tok.pad_token_id)


def prm_scores(model: LlamaForCausalLM, batch: dict[str, Any], good: int, bad: int) -> Any:
    """(two-way logits at tag positions, targets 1=good) for a PRM batch."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    at = batch["labels"] != -100
    pair = logits[at][:, [bad, good]]
    return pair, (batch["labels"][at] == good).long()


def prm_eval(
    model: LlamaForCausalLM, tok: Any, items: Sequence[tuple[str, list[str], list[bool]]]
) -> dict[str, float]:
    good, bad = (tok.convert_tokens_to_ids(t) for t in (g24.GOOD_TOKEN, g24.BAD_TOKEN))
    scores, targets = [], []
    model.eval()
    with torch.no_grad():
        for k in range(0, len(items), 256):
            pair, y = prm_scores(model, prm_batch(tok, items[k : k + 256], good, bad), good, bad)
            scores.append(torch.softmax(pair, -1)[:, 1].numpy())
            targets.append(y.numpy().astype(bool))
    s, y = np.concatenate(scores), np.concatenate(targets)
    pred = s >= 0.5
    return {
        "prm_accuracy": float((pred == y).mean()),
        "prm_balanced_accuracy": float(0.5 * (pred[y].mean() + (~pred[~y]).mean())),
        "prm_auc": auc(s, y),
        "prm_steps": float(len(y)),
        "prm_good_fraction": float(y.mean()),
    }


def candidate_items(
    model: LlamaForCausalLM, tok: Any, puzzles: Sequence[str], n: int, temperature: float
) -> list[tuple[str, list[str], list[bool]]]:
    items = []
    for puzzle, traces in zip(
        puzzles, generate_traces(model, tok, puzzles, n, temperature), strict=True
    ):
        for steps in traces:
            if steps:
                items.append((puzzle, steps, step_labels(puzzle, steps)))
    return items


def corrupt(puzzle: str, steps: list[str], rng: np.random.Generator) -> list[str]:
    """A solver trace with one step replaced by a dead-end legal step or an arithmetic slip."""
    k = int(rng.integers(len(steps)))
    state = g24.remaining_numbers(puzzle, steps[:k]) or g24.parse_numbers(puzzle)
    out = steps[:k]
    dead = [s for s in g24.legal_steps(state) if not g24.solvable(g24.apply_step(state, s) or ())]
    if dead and rng.random() < 0.6:
        out.append(dead[int(rng.integers(len(dead)))])
    else:
        step = steps[k]
        lhs, rest = step.split("=", 1)
        value, left = rest.split(" ", 1)
        if rng.random() < 0.5 and g24.parse_numbers(value):
            wrong = g24.parse_numbers(value)[0] + int(rng.choice([-2, -1, 1, 2]))
            out.append(f"{lhs}={g24.format_number(wrong)} {left}")
        else:
            nums = left.removeprefix("(left: ").removesuffix(")").split()
            if len(nums) > 1 and rng.random() < 0.5:
                nums.pop(int(rng.integers(len(nums))))
            else:
                nums.insert(int(rng.integers(len(nums) + 1)), str(int(rng.integers(1, 14))))
            out.append(f"{lhs}={value} (left: {' '.join(nums)})")
    state2 = g24.remaining_numbers(puzzle, out)
    while state2 is not None and len(state2) > 1 and len(out) < 3:
        nxt = g24.legal_steps(state2)
        out.append(nxt[int(rng.integers(len(nxt)))])
        state2 = g24.remaining_numbers(puzzle, out)
    return out


def train_policy(args: argparse.Namespace, tok: Any, out: Path) -> None:
    seed_all(args.seed)
    train, val = split_training_puzzles(args.seed)
    tries = {p.text: solution_trie(p.text) for p in train}
    rng = np.random.default_rng(args.seed + 1)
    val_rng = np.random.default_rng(args.seed + 2)
    val_ex = [  # 8 solver traces for each held-out puzzle
        policy_example(tok, p.text, sample_trace(solution_trie(p.text), val_rng))
        for p in val
        for _ in range(8)
    ]
    names = [p.text for p in train]

    def next_batch() -> dict[str, Any]:
        ex = []
        for i in rng.integers(len(names), size=args.batch):
            ex.append(policy_example(tok, names[i], sample_trace(tries[names[i]], rng)))
        return pad_batch([e[0] for e in ex], [e[1] for e in ex], tok.pad_token_id)

    def loss_fn(model: LlamaForCausalLM, batch: dict[str, Any]) -> Any:
        return model(**batch).loss

    def val_fn(model: LlamaForCausalLM) -> dict[str, float]:
        batch = pad_batch([e[0] for e in val_ex], [e[1] for e in val_ex], tok.pad_token_id)
        return {"val_loss": float(model(**batch).loss)}

    model = LlamaForCausalLM(model_config(tok, args))
    log: dict[str, Any] = {
        "model": "policy",
        "seed": args.seed,
        "train_ranks": list(g24.TRAIN_RANKS),
        "val_ranks": sorted(p.rank for p in val),
        "batch": args.batch,
        "lr": args.lr,
        "layers": args.layers,
        "hidden": args.hidden,
        "params": sum(p.numel() for p in model.parameters()),
        "curve": [],
    }
    print(f"policy: {log['params']} params, {len(train)} train puzzles", flush=True)
    train_loop(model, next_batch, loss_fn, val_fn, args.policy_steps, args.minutes, args.lr, log)
    test = [p.text for p in g24.load_puzzles(*g24.TEST_RANKS)]
    log["test_ranks"] = list(g24.TEST_RANKS)
    log["test"] = policy_metrics(model, tok, test)
    log["train_sample"] = policy_metrics(model, tok, names[:100])
    log["val"] = policy_metrics(model, tok, [p.text for p in val])
    print(json.dumps({k: log[k] for k in ("test", "train_sample", "val")}), flush=True)
    save(model, tok, out / "policy", log)


def train_prm(args: argparse.Namespace, tok: Any, out: Path) -> None:
    seed_all(args.seed)
    policy = LlamaForCausalLM.from_pretrained(out / "policy", local_files_only=True)
    train, val = split_training_puzzles(args.seed)
    good, bad = (tok.convert_tokens_to_ids(t) for t in (g24.GOOD_TOKEN, g24.BAD_TOKEN))
    t0 = time.time()
    torch.manual_seed(args.seed + 3)
    train_names = [p.text for p in train]
    cands = candidate_items(policy, tok, train_names, args.prm_samples, args.temperature)
    val_items = candidate_items(policy, tok, [p.text for p in val], 16, args.temperature)
    print(f"sampled {len(cands)} candidate traces in {time.time() - t0:.0f}s", flush=True)
    rng = np.random.default_rng(args.seed + 4)
    solved = {n: g24.solutions(n, allow_negative=False) or g24.solutions(n) for n in train_names}
    synthetic = []
    for name, traces in solved.items():
        for _ in range(2):
            steps = list(traces[int(rng.integers(len(traces)))])
            synthetic.append((name, steps, [True] * len(steps)))
            bad_steps = corrupt(name, steps, rng)
            synthetic.append((name, bad_steps, step_labels(name, bad_steps)))
    pool = cands + synthetic
    flat = [lab for _, _, labels in pool for lab in labels]
    pos = float(np.mean(flat))
    weights = torch.tensor([0.5 / (1 - pos), 0.5 / pos], dtype=torch.float32)  # [bad, good]

    def next_batch() -> dict[str, Any]:
        idx = rng.integers(len(pool), size=args.batch)
        return prm_batch(tok, [pool[int(i)] for i in idx], good, bad)

    def loss_fn(model: LlamaForCausalLM, batch: dict[str, Any]) -> Any:
        pair, y = prm_scores(model, batch, good, bad)
        return torch.nn.functional.cross_entropy(pair, y, weight=weights)

    def val_fn(model: LlamaForCausalLM) -> dict[str, float]:
        return prm_eval(model, tok, val_items)

    model = LlamaForCausalLM.from_pretrained(out / "policy", local_files_only=True)
    log: dict[str, Any] = {
        "model": "prm",
        "seed": args.seed,
        "init": "policy",
        "train_ranks": list(g24.TRAIN_RANKS),
        "val_ranks": sorted(p.rank for p in val),
        "policy_candidates": len(cands),
        "synthetic_traces": len(synthetic),
        "good_fraction": pos,
        "class_weights": weights.tolist(),
        "sampling_temperature": args.temperature,
        "samples_per_puzzle": args.prm_samples,
        "curve": [],
    }
    train_loop(
        model, next_batch, loss_fn, val_fn, args.prm_steps, args.prm_minutes, args.prm_lr, log
    )
    torch.manual_seed(args.seed + 5)
    test = [p.text for p in g24.load_puzzles(*g24.TEST_RANKS)]
    log["test"] = prm_eval(model, tok, candidate_items(policy, tok, test, 16, args.temperature))
    print(json.dumps(log["test"]), flush=True)
    save(model, tok, out / "prm", log)
    tags = {"step_tag": g24.STEP_TAG, "good_token": g24.GOOD_TOKEN, "bad_token": g24.BAD_TOKEN}
    (out / "prm" / "prm.json").write_text(json.dumps(tags, indent=2) + "\n")


def save(model: LlamaForCausalLM, tok: Any, folder: Path, log: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=64,
    )
    model.save_pretrained(folder, safe_serialization=True)
    g24.build_tokenizer().save_pretrained(folder)  # fresh: no padding state from generate
    (folder / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=g24.asset_dir())
    ap.add_argument("--which", choices=["policy", "prm", "both"], default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=None, help="policy time budget (else steps)")
    ap.add_argument("--prm-minutes", type=float, default=None, help="PRM time budget (else steps)")
    ap.add_argument("--policy-steps", type=int, default=3002, help="the shipped policy's count")
    ap.add_argument("--prm-steps", type=int, default=1800, help="the shipped PRM's count")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--prm-lr", type=float, default=1e-3)
    ap.add_argument("--prm-samples", type=int, default=16, help="policy samples per puzzle")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.minutes is not None:
        args.policy_steps = None  # calibrate a step count for the time budget, logged
    if args.prm_minutes is not None:
        args.prm_steps = None
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    tok = g24.build_tokenizer()
    if args.which in ("policy", "both"):
        train_policy(args, tok, args.out)
    if args.which in ("prm", "both"):
        train_prm(args, tok, args.out)


if __name__ == "__main__":
    main()
