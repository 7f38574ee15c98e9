"""Game of 24: solver, step format, tokenizer and the shipped tiny models (fast, CPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from spec_tot.errors import ConfigError
from spec_tot.graphs import game24_task as g24

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_solver_known_puzzles() -> None:
    assert g24.solvable("4 4 6 8")
    assert not g24.solvable("1 1 1 1")
    assert g24.solvable("3 3 8 8")  # needs fractions: 8/(3-8/3)
    assert not g24.solvable([1, 1, 2, 3])
    assert g24.solvable([24]) and not g24.solvable([23])
    sols = g24.solutions("3 3 8 8")
    assert sols and all(g24.check_answer("3 3 8 8", s) for s in sols)
    assert len(set(g24.solutions("4 4 6 8"))) == len(g24.solutions("4 4 6 8")) > 3
    for puzzle in g24.load_puzzles(1, 30):
        assert g24.solvable(puzzle.text)
        assert g24.solutions(puzzle.text, allow_negative=False)


def test_load_puzzles_ranges() -> None:
    all_ = g24.load_puzzles()
    assert len(all_) == g24.NUM_PUZZLES == 1362
    test = g24.load_puzzles(*g24.TEST_RANKS)
    assert [p.rank for p in test] == list(range(901, 1001))
    assert all(len(p.numbers) == 4 and p.text == " ".join(map(str, p.numbers)) for p in test)
    with pytest.raises(ConfigError) as err:
        g24.load_puzzles(0, 10)
    assert err.value.field == "start"
    with pytest.raises(ConfigError) as err:
        g24.load_puzzles(10, 5)
    assert err.value.field == "end"
    with pytest.raises(ConfigError):
        g24.parse_numbers("4 x 6 8")


def test_parse_and_legality() -> None:
    p = g24.parse_step("8/2=4 (left: 3 4 4)")
    assert p == g24.ParsedStep(
        Fraction(8), "/", Fraction(2), Fraction(4), (Fraction(3), Fraction(4), Fraction(4))
    )
    assert g24.parse_step("8 / 2 = 4 (left: 3 4 4)") == p  # ToT-paper spacing is accepted
    assert g24.parse_step("3-(8/3)=1/3 (left: 1/3 8)") is not None
    for bad in ("", "hello", "8/2=4", "8/2=4 (left: )", "8/3/3=1 (left: 1)"):
        assert g24.parse_step(bad) is None
    assert g24.is_legal_step("2 3 4 8", "8/2=4 (left: 3 4 4)")
    assert g24.is_legal_step("2 3 4 8", "8/2=4 (left: 4 3 4)")  # any order of `left`
    assert not g24.is_legal_step("2 3 4 8", "8/2=5 (left: 3 4 5)")  # arithmetic
    assert not g24.is_legal_step("2 3 4 8", "8/2=4 (left: 3 4)")  # left list
    assert not g24.is_legal_step("3 4 4 8", "8/2=4 (left: 3 4 4)")  # operand not available
    assert not g24.is_legal_step("2 2 4 8", "2*2=4 (left: 4 4 8 2)")
    assert not g24.is_legal_step("0 2 4 8", "8/0=0 (left: 0 2 4)")  # parses, not legal
    assert g24.apply_step("3 3 8 8", "8/3=8/3 (left: 8/3 3 8)") == (Fraction(8, 3), 3, 8)
    steps = g24.legal_steps("4 4 6 8")
    assert steps and all(g24.is_legal_step("4 4 6 8", s) for s in steps)
    assert g24.format_step("2 3 4 8", 8, "/", 2) == "8/2=4 (left: 3 4 4)"
    assert g24.format_step("3 8 8/3", 3, "-", Fraction(8, 3)) == "3-(8/3)=1/3 (left: 1/3 8)"
    with pytest.raises(ConfigError):
        g24.format_step("2 3 4 8", 5, "+", 2)


def test_trace_helpers() -> None:
    steps = ["8/2=4 (left: 3 4 4)", "3+4=7 (left: 4 7)", "7*4=28 (left: 28)"]
    assert g24.remaining_numbers("2 3 4 8", steps[:1]) == (3, 4, 4)
    assert g24.remaining_numbers("2 3 4 8", ["8/2=5 (left: 3 4 5)"]) is None
    assert not g24.is_terminal("3 4 4") and g24.is_terminal([28])
    assert not g24.check_answer("2 3 4 8", steps)
    assert g24.expression("2 3 4 8", steps) == "(3+4)*(8/2) = 28"
    good = ["4+4=8 (left: 6 8 8)", "8-6=2 (left: 2 8)", "8*2=16 (left: 16)"]
    assert not g24.check_answer("4 4 6 8", good)
    ok = ["6-4=2 (left: 2 4 8)", "8-2=6 (left: 4 6)", "6*4=24 (left: 24)"]
    assert g24.check_answer("4 4 6 8", ok) and not g24.check_answer("4 4 6 8", ok[:2])
    assert g24.expression("4 4 6 8", ok) == "(8-(6-4))*4 = 24"
    assert g24.prompt("4 4 6 8", ok[:1]) == "4 4 6 8\n6-4=2 (left: 2 4 8)\n"
    assert g24.prm_input("4 4 6 8", ok[:1]) == f"4 4 6 8\n6-4=2 (left: 2 4 8){g24.STEP_TAG}\n"


def test_tokenizer_round_trip() -> None:
    tok = g24.build_tokenizer()
    text = g24.prm_input("3 3 8 8", list(g24.solutions("3 3 8 8")[0]))
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) - 3 * 5 + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.convert_tokens_to_ids(g24.GOOD_TOKEN) != tok.convert_tokens_to_ids(g24.BAD_TOKEN)


@pytest.mark.parametrize("name", ["policy", "prm"])
def test_shipped_models(name: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = g24.asset_dir(name)
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size < 10 * 2**20
    assert json.loads((folder / "training_log.json").read_text())["curve"]
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert config.model_type == "llama" and config.vocab_size == len(tok)
    text = g24.prm_input("4 4 6 8", ["6-4=2 (left: 2 4 8)"])
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    enc = tok([text, "1 2 3 4\n"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (2, enc["input_ids"].shape[1], len(tok))
    if name == "prm":
        tags = json.loads((folder / "prm.json").read_text())
        assert tags == {"step_tag": "<step>", "good_token": "<good>", "bad_token": "<bad>"}
        assert all(tok.convert_tokens_to_ids(t) != tok.unk_token_id for t in tags.values())


def test_training_split_never_reaches_test_ranks() -> None:
    spec = importlib.util.spec_from_file_location("train_game24", SCRIPTS / "train_game24.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_game24", module)
    spec.loader.exec_module(module)
    train, val = module.split_training_puzzles(0)
    assert len(train) + len(val) == 900 and not {p.rank for p in train} & {p.rank for p in val}
    assert max(p.rank for p in train + val) <= g24.TRAIN_RANKS[1] < g24.TEST_RANKS[0]
