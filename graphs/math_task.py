"""Step-by-step math word problems: data, steps, answers (no graph here; ``math.py`` is).

- **Data**: ``load_problems(path, n)`` reads JSONL in GSM8K's format (``question``,
  ``answer`` ending in ``#### 42``) or MATH's (``problem``, ``solution`` with a
  ``\\boxed{...}``), every line checked, errors naming the file and line.
- **Steps**: ``split_steps`` cuts a model's text into steps, one per line or per ``\\n\\n``
  paragraph.
- **Answers**: ``extract_answer`` finds the final answer in a solution: ``#### n`` (GSM8K),
  the last ``\\boxed{...}`` (MATH), "the answer is ...", else the last number;
  ``normalize_answer`` makes ``1,000.00``, ``$1000`` and ``1000`` equal, ``\\frac{1}{2}``
  ``1/2`` and ``0.5`` equal, and keeps signs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from spec_tot.errors import ConfigError

__all__ = [
    "STEP_SEPARATORS",
    "Problem",
    "answers_match",
    "extract_answer",
    "extract_boxed",
    "load_problems",
    "normalize_answer",
    "split_steps",
]

STEP_SEPARATORS = {"line": "\n", "paragraph": "\n\n"}
MAX_DATASET_BYTES = 256 * 2**20  # a dataset file larger than this is a mistake

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+"
_HASHES = re.compile(r"####\s*(.+)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*\$?\s*(" + _NUMBER + r"|\\frac\{[^{}]*\}\{[^{}]*\})",
                        re.IGNORECASE)  # fmt: skip
_LAST_NUMBER = re.compile(_NUMBER)
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}$")
_FRAC_SHORT = re.compile(r"^\\[dt]?frac(\d)(\d)$")


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem: its text, its reference answer (normalised) and where it came from."""

    question: str
    answer: str
    source: str  # "file:line"


def split_steps(text: str, step: str = "line") -> list[str]:
    """The non-empty steps of ``text``: one per line, or one per ``\\n\\n`` paragraph."""
    if step not in STEP_SEPARATORS:
        raise ConfigError("step", f"must be one of {sorted(STEP_SEPARATORS)}, got {step!r}")
    return [s.strip() for s in text.split(STEP_SEPARATORS[step]) if s.strip()]


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None  # unbalanced: no answer


def extract_answer(text: str) -> str | None:
    """The final answer of a solution, normalised; None when it states none. Tried in
    order: the last ``#### n`` line, the last ``\\boxed{}``, the last "the answer is n",
    then the last number in the text."""
    hashes = _HASHES.findall(text)
    if hashes:
        return normalize_answer(hashes[-1])
    boxed = extract_boxed(text)
    if boxed is not None:
        return normalize_answer(boxed)
    stated = _ANSWER_IS.findall(text)
    if stated:
        return normalize_answer(stated[-1])
    numbers = _LAST_NUMBER.findall(text)
    return normalize_answer(numbers[-1]) if numbers else None


def normalize_answer(text: str) -> str | None:
    """A canonical form: numbers as exact fractions in lowest terms (``1,000`` -> ``1000``,
    ``-0.50`` -> ``-1/2``, ``\\frac{1}{2}`` -> ``1/2``), other answers with spaces, ``$``,
    ``\\left``/``\\right`` and a trailing period removed. None for an empty answer."""
    s = text.strip().rstrip(".").strip()
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("$", "")
    s = re.sub(r"\\text\{[^{}]*\}", "", s)
    s = re.sub(r"\s+", "", s)
    if s.startswith("\\boxed{") and s.endswith("}"):
        s = s[len("\\boxed{") : -1]
    if not s:
        return None
    value = _as_number(s)
    if value is None:
        return s
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


def _as_number(s: str) -> Fraction | None:
    sign = -1 if s.startswith("-") else 1
    body = s[1:] if sign < 0 else s
    match = _FRAC.match(body) or _FRAC_SHORT.match(body)
    if match:
        num, den = (_as_number(match.group(1)), _as_number(match.group(2)))
        if num is None or den is None or den == 0:
            return None
        return sign * num / den
    if "/" in body and body.count("/") == 1:
        num, den = (_as_number(p) for p in body.split("/"))
        if num is None or den is None or den == 0:
            return None
        return sign * num / den
    body = body.rstrip("%")
    if re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d+)?", body):
        body = body.replace(",", "")
    try:
        return sign * Fraction(body) if re.fullmatch(r"\d*\.?\d+|\d+\.", body) else None
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, reference: str | None) -> bool:
    """Whether two (normalised or raw) answers are the same."""
    if predicted is None or reference is None:
        return False
    a, b = normalize_answer(predicted), normalize_answer(reference)
    return a is not None and a == b


def _problem(row: Any, where: str) -> Problem:
    if not isinstance(row, dict):
        raise ConfigError(where, f"expected a JSON object, got {type(row).__name__}")
    if "question" in row and "answer" in row:  # GSM8K
        question, solution = row["question"], row["answer"]
        if not isinstance(solution, str) or not _HASHES.search(solution):
            raise ConfigError(where, "a GSM8K answer must end with '#### <answer>'")
        answer = normalize_answer(_HASHES.findall(solution)[-1])
    elif "problem" in row and "solution" in row:  # MATH
        question, solution = row["problem"], row["solution"]
        boxed = extract_boxed(solution) if isinstance(solution, str) else None
        answer = normalize_answer(row.get("answer") or boxed or "")
    else:
        raise ConfigError(where, "expected GSM8K (question, answer) or MATH (problem, solution)")
    if not isinstance(question, str) or not question.strip():
        raise ConfigError(where, "the question is empty or not a string")
    if answer is None:
        raise ConfigError(where, "no reference answer found")
    return Problem(question.strip(), answer, where)


def load_problems(
    path: str | Path, n: int | None = None, *, option: str = "dataset"
) -> list[Problem]:
    """The first ``n`` problems (all when None) of a JSONL file in GSM8K's or MATH's format.
    Errors name ``option``, the file and the line."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(option, f"{str(file)!r} is not a regular file")
    if file.stat().st_size > MAX_DATASET_BYTES:
        raise ConfigError(option, f"{str(file)!r} is over {MAX_DATASET_BYTES} bytes")
    if n is not None and n < 1:
        raise ConfigError("queries", f"must be >= 1, got {n}")
    out: list[Problem] = []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if n is not None and len(out) >= n:
                break
            if not line.strip():
                continue
            where = f"{option} {file.name}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(where, f"not JSON ({exc.msg})") from None
            out.append(_problem(row, where))
    if n is not None and len(out) < n:
        raise ConfigError("queries", f"{str(file)!r} holds {len(out)} problems; asked for {n}")
    return out
