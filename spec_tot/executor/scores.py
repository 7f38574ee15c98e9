"""Calling a scorer and checking what it returns.

A scorer is a ``RewardBackend`` or a plain (sync or async) callable over a batch of
``RewardItem``s returning one score, or one tuple of per-step scores, per item. Every score
must be a finite real number (not a string, not a bool), within the backend's stated
``score_range`` when it has one; a tuple holds one score per step (or a single outcome
score). ``check_score`` judges one item's score, so that a bad one fails only its query.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from spec_tot._private.compiled import maybe_await
from spec_tot.backends import RewardBackend
from spec_tot.errors import ExecutionError
from spec_tot.requests import RewardItem

__all__ = ["Scorer", "call_scorer", "check_score", "score_range"]

Scorer = RewardBackend | Any


async def call_scorer(scorer: Scorer, items: Sequence[RewardItem]) -> list[Any]:
    """The scorer's raw answer for ``items``: one entry per item (checked), unjudged."""
    if isinstance(scorer, RewardBackend):
        raw: Any = await scorer.score(items)
    else:
        raw = await maybe_await(scorer(list(items)))
    if isinstance(raw, str | bytes) or not hasattr(raw, "__iter__"):
        raise ExecutionError(f"scorer returned {type(raw).__name__}, not a list of scores")
    scores = list(raw)
    if len(scores) != len(items):
        raise ExecutionError(f"scorer returned {len(scores)} scores for {len(items)} items")
    return scores


def score_range(scorer: Scorer) -> tuple[float, float] | None:
    return scorer.score_range if isinstance(scorer, RewardBackend) else None


def check_score(
    value: Any, item: RewardItem, bounds: tuple[float, float] | None
) -> tuple[float, ...]:
    """``value`` as per-step scores for ``item``, or ``ValueError`` saying what is wrong."""
    if isinstance(value, str | bytes):
        raise ValueError(f"score for {item.request_id} is the string {value!r}, not a number")
    try:
        size = len(value)
    except TypeError:  # a scalar (a 0-d tensor too)
        return (_number(value, item, bounds),)
    steps = tuple(_number(v, item, bounds) for v in value)
    if size not in (1, len(item.steps)):
        raise ValueError(
            f"{size} scores for {item.request_id}, which has {len(item.steps)} steps "
            "(one per step, or one for the trace)"
        )
    return steps


def _number(value: Any, item: RewardItem, bounds: tuple[float, float] | None) -> float:
    if isinstance(value, bool | str | bytes) or not hasattr(value, "__float__"):
        raise ValueError(f"score for {item.request_id} is {value!r}, not a real number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"score for {item.request_id} is {number}, not finite")
    if bounds is not None and not bounds[0] <= number <= bounds[1]:
        raise ValueError(
            f"score for {item.request_id} is {number}, outside the scorer's range {bounds}"
        )
    return number
