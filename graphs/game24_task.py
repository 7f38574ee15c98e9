"""Game of 24: puzzles, exact solver and the step format of the ToT paper.

A puzzle is four numbers ("4 4 6 8"); a solution is three steps, one a line, each combining two of
the numbers still left, e.g. ``8/2=4 (left: 4 4 6)``. Numbers in ``left`` are sorted by value;
a fraction is written ``8/3`` and a negative ``-5``; an operand that is not a plain non-negative
integer is parenthesised (``3-(8/3)=1/3``). All arithmetic uses exact ``Fraction``s.

This module is the single source of truth for the training script, the evaluation script and the
ToT graph: the policy prompt is :func:`prompt`, the process-reward input is :func:`prm_input`.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from spec_tot.errors import ConfigError

__all__ = [
    "BAD_TOKEN",
    "GOOD_TOKEN",
    "NUM_PUZZLES",
    "STEP_TAG",
    "TARGET",
    "TEST_RANKS",
    "TRAIN_RANKS",
    "ParsedStep",
    "Puzzle",
    "apply_step",
    "asset_dir",
    "build_tokenizer",
    "check_answer",
    "expression",
    "forced_suffix",
    "format_number",
    "format_step",
    "is_legal_step",
    "is_terminal",
    "legal_steps",
    "load_puzzles",
    "parse_numbers",
    "parse_step",
    "prm_input",
    "prompt",
    "remaining_numbers",
    "solutions",
    "solvable",
]

TARGET = Fraction(24)
NUM_PUZZLES = 1362
TRAIN_RANKS = (1, 900)  # the only ranks any model may be trained on
TEST_RANKS = (901, 1000)  # the ToT paper's test range
STEP_TAG = "<step>"  # process-reward tag after each step; scored position
GOOD_TOKEN = "<good>"
BAD_TOKEN = "<bad>"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "0123456789+-*/=() :.,\n" + "abcdefghijklmnopqrstuvwxyz"

Numbers = tuple[Fraction, ...]
NumbersLike = str | Sequence[int | Fraction]

_NUM = r"-?\d+(?:/\d+)?"
_OPERAND = rf"\({_NUM}\)|-?\d+"
_STEP_RE = re.compile(
    rf"^\s*({_OPERAND})\s*([+\-*/])\s*({_OPERAND})\s*=\s*({_NUM})\s*\(\s*left:\s*([^()]*)\)\s*$"
)
_NUM_RE = re.compile(rf"^{_NUM}$")


@dataclass(frozen=True)
class Puzzle:
    """One row of the packaged ``24.csv`` (ranked by human solve time)."""

    rank: int
    text: str  # "4 4 6 8"
    numbers: tuple[int, ...]


@dataclass(frozen=True)
class ParsedStep:
    """``a op b = result (left: ...)`` with exact values; ``left`` as written."""

    a: Fraction
    op: str
    b: Fraction
    result: Fraction
    left: Numbers


def asset_dir(name: str = "") -> Path:
    """Folder of the packaged Game-of-24 assets (``policy``, ``prm`` or the root for '')."""
    path = Path(str(resources.files("spec_tot.graphs"))) / "assets" / "game24"
    return path / name if name else path


def load_puzzles(start: int = 1, end: int = NUM_PUZZLES) -> list[Puzzle]:
    """Puzzles with rank in ``[start, end]`` (inclusive), in rank order."""
    if not 1 <= start <= NUM_PUZZLES:
        raise ConfigError("start", f"rank must be in 1..{NUM_PUZZLES}, got {start}")
    if not start <= end <= NUM_PUZZLES:
        raise ConfigError("end", f"rank must be in {start}..{NUM_PUZZLES}, got {end}")
    text = resources.files("spec_tot.graphs").joinpath("assets/game24/24.csv").read_text()
    out = []
    for row in csv.DictReader(text.splitlines()):
        rank = int(row["Rank"])
        if start <= rank <= end:
            nums = tuple(int(x) for x in row["Puzzles"].split())
            out.append(Puzzle(rank, " ".join(map(str, nums)), nums))
    return out


def format_number(x: Fraction) -> str:
    """``4``, ``-5`` or ``8/3``."""
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def _operand(x: Fraction) -> str:
    return str(x) if x.denominator == 1 and x >= 0 else f"({format_number(x)})"


def _value(text: str) -> Fraction | None:
    text = text.strip()
    if text.isdigit():  # the common case, without Fraction's string parsing
        return Fraction(int(text))
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    if not _NUM_RE.match(text):
        return None
    try:
        return Fraction(text)
    except ZeroDivisionError:
        return None


def parse_numbers(numbers: NumbersLike, field: str = "puzzle") -> Numbers:
    """Exact numbers of a puzzle given as text ("4 4 6 8") or a sequence."""
    if isinstance(numbers, str):
        values = [_value(t) for t in numbers.split()]
        if not values or any(v is None for v in values):
            raise ConfigError(field, f"expected space-separated numbers, got {numbers!r}")
        return tuple(v for v in values if v is not None)
    if all(type(x) is Fraction for x in numbers):
        return tuple(numbers)  # already exact: no new Fraction objects
    return tuple(Fraction(x) for x in numbers)


def _apply(a: Fraction, op: str, b: Fraction) -> Fraction | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b if b != 0 else None


def parse_step(step: str) -> ParsedStep | None:
    """Parse one step line; ``None`` when it does not follow the format."""
    m = _STEP_RE.match(step)
    if m is None:
        return None
    a, b, result = _value(m.group(1)), _value(m.group(3)), _value(m.group(4))
    left = [_value(t) for t in m.group(5).split()]
    if a is None or b is None or result is None or not left or any(v is None for v in left):
        return None
    return ParsedStep(a, m.group(2), b, result, tuple(v for v in left if v is not None))


def _remove(numbers: Numbers, *values: Fraction) -> list[Fraction] | None:
    rest = list(numbers)
    for v in values:
        if v not in rest:
            return None
        rest.remove(v)
    return rest


def apply_step(numbers_before: NumbersLike, step: str) -> Numbers | None:
    """Numbers left (sorted) after a legal step, else ``None``."""
    before = parse_numbers(numbers_before)
    parsed = parse_step(step)
    if parsed is None or _apply(parsed.a, parsed.op, parsed.b) != parsed.result:
        return None
    rest = _remove(before, parsed.a, parsed.b)
    if rest is None:
        return None
    after = tuple(sorted([*rest, parsed.result]))
    return after if tuple(sorted(parsed.left)) == after else None


def is_legal_step(numbers_before: NumbersLike, step: str) -> bool:
    """Operands available, arithmetic exact and ``left`` the right multiset (any order)."""
    return apply_step(numbers_before, step) is not None


def remaining_numbers(puzzle: NumbersLike, steps: Sequence[str]) -> Numbers | None:
    """Numbers left after a trace of steps; ``None`` if any step is illegal."""
    numbers: Numbers | None = parse_numbers(puzzle)
    for step in steps:
        if numbers is None:
            return None
        numbers = apply_step(numbers, step)
    return numbers


def is_terminal(numbers: NumbersLike) -> bool:
    """A state is terminal when a single number is left (solved iff it is 24)."""
    return len(parse_numbers(numbers, "numbers")) <= 1


def check_answer(puzzle: NumbersLike, steps: Sequence[str]) -> bool:
    """True iff the puzzle has four numbers and the steps are three legal ones ending at 24."""
    start = parse_numbers(puzzle)
    left = remaining_numbers(start, steps)
    return len(start) == 4 and len(steps) == 3 and left == (TARGET,)


def format_step(numbers_before: NumbersLike, a: int | Fraction, op: str, b: int | Fraction) -> str:
    """Canonical text of the step ``a op b`` taken from ``numbers_before``."""
    before, fa, fb = parse_numbers(numbers_before), Fraction(a), Fraction(b)
    if op not in ("+", "-", "*", "/"):
        raise ConfigError("op", f"expected one of + - * /, got {op!r}")
    result = _apply(fa, op, fb)
    rest = _remove(before, fa, fb)
    if result is None or rest is None:
        raise ConfigError("step", f"{a} {op} {b} is not possible from {before}")
    left = " ".join(format_number(x) for x in sorted([*rest, result]))
    return f"{_operand(fa)}{op}{_operand(fb)}={format_number(result)} (left: {left})"


_PARTIAL_RE = re.compile(rf"^\s*({_OPERAND})\s*([+\-*/])\s*({_OPERAND})\s*=(.*)$")


def forced_suffix(numbers_before: NumbersLike, partial: str) -> str | None:
    """The rest of a step line that its operation forces: once ``a op b =`` is written from
    ``numbers_before``, the result and ``(left: ...)`` follow (canonical form, as
    ``format_step`` writes them). ``None`` when ``partial`` has no operation yet, names
    numbers that are not there, or already departs from the forced text."""
    m = _PARTIAL_RE.match(partial)
    if m is None:
        return None
    full = _forced_text(parse_numbers(numbers_before), m.group(1), m.group(2), m.group(3))
    written = m.group(4)
    return full[len(written) :] if full is not None and full.startswith(written) else None


@lru_cache(maxsize=1 << 14)
def _forced_text(numbers: Numbers, left: str, op: str, right: str) -> str | None:
    """What follows ``left op right =`` from ``numbers``. Cached: the engine's drafter asks
    once per decoded token of a step line, and every token after the ``=`` of a line asks
    about the same operation (12% of the engine's step time at 32 queries before)."""
    a, b = _value(left), _value(right)
    if a is None or b is None:
        return None
    result = _apply(a, op, b)
    rest = _remove(numbers, a, b)
    if result is None or rest is None:
        return None
    ordered = " ".join(format_number(x) for x in sorted([*rest, result]))
    return f"{format_number(result)} (left: {ordered})"


@lru_cache(maxsize=1 << 16)
def _moves(numbers: Numbers) -> tuple[tuple[str, Numbers], ...]:
    out: dict[str, Numbers] = {}
    for i in range(len(numbers)):
        for j in range(len(numbers)):
            a, b = numbers[i], numbers[j]
            if i == j:
                continue
            rest = [x for k, x in enumerate(numbers) if k not in (i, j)]
            for op in "+-*/":
                result = _apply(a, op, b)
                if (op in "+*" and a < b) or result is None:
                    continue  # commutative ops: larger operand first
                after = tuple(sorted([*rest, result]))
                left = " ".join(format_number(x) for x in after)
                step = f"{_operand(a)}{op}{_operand(b)}={format_number(result)} (left: {left})"
                out.setdefault(step, after)
    return tuple(out.items())


def legal_steps(numbers: NumbersLike) -> list[str]:
    """Every distinct legal next step in canonical form (commutative ops larger operand first)."""
    return [step for step, _ in _moves(tuple(sorted(parse_numbers(numbers, "numbers"))))]


@lru_cache(maxsize=1 << 16)
def _solvable(numbers: Numbers) -> bool:
    if len(numbers) == 1:
        return numbers[0] == TARGET
    return any(_solvable(after) for _, after in _moves(numbers))


def solvable(numbers: NumbersLike) -> bool:
    """True iff the numbers can still reach 24 exactly (any intermediate values allowed)."""
    nums = tuple(sorted(parse_numbers(numbers, "numbers")))
    return bool(nums) and _solvable(nums)


def solutions(puzzle: NumbersLike, allow_negative: bool = True) -> list[tuple[str, ...]]:
    """All distinct solution traces (canonical steps) that reach 24 from ``puzzle``."""
    out: list[tuple[str, ...]] = []

    def walk(numbers: Numbers, trace: tuple[str, ...]) -> None:
        if len(numbers) == 1:
            if numbers[0] == TARGET:
                out.append(trace)
            return
        for step, after in _moves(numbers):
            if (allow_negative or min(after) >= 0) and _solvable(after):
                walk(after, (*trace, step))

    walk(tuple(sorted(parse_numbers(puzzle))), ())
    return out


def expression(puzzle: NumbersLike, steps: Sequence[str]) -> str | None:
    """Display form of a trace, e.g. ``(8/2)*(3+4) = 28``; ``None`` if a step is illegal."""
    pool: list[tuple[Fraction, str]] = [(x, format_number(x)) for x in parse_numbers(puzzle)]
    for step in steps:
        parsed = parse_step(step)
        if parsed is None or apply_step([v for v, _ in pool], step) is None:
            return None
        terms = []
        for value in (parsed.a, parsed.b):
            k = next(k for k, (v, _) in enumerate(pool) if v == value)
            text = pool.pop(k)[1]
            terms.append(text if text.isdigit() else f"({text})")
        pool.append((parsed.result, f"{terms[0]}{parsed.op}{terms[1]}"))
    return " , ".join(f"{text} = {format_number(v)}" for v, text in pool)


def prompt(puzzle: str, steps: Sequence[str]) -> str:
    """Policy prompt: the puzzle line then one line per step; the model writes the next line."""
    return f"{puzzle}\n" + "".join(s + "\n" for s in steps)


def prm_input(puzzle: str, steps: Sequence[str]) -> str:
    """Process-reward input: each step followed by STEP_TAG, scored at every tag position."""
    return f"{puzzle}\n" + "".join(s + STEP_TAG + "\n" for s in steps)


def build_tokenizer() -> Any:
    """Character-level ``PreTrainedTokenizerFast`` (adds ``<bos>``; decode(encode(x)) == x)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, STEP_TAG, GOOD_TOKEN, BAD_TOKEN))}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens([STEP_TAG, GOOD_TOKEN, BAD_TOKEN])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast: Any = PreTrainedTokenizerFast  # untyped in transformers
    return fast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
