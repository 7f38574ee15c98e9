"""Reward scoring over a remote model, shared by the HTTP backends: the texts a batch of
traces is scored as (one per trace or per step prefix), the scores spread back per item,
and the math that turns a raw logit or a judge's logprobs into a score."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from spec_tot.requests import RewardItem

__all__ = ["judge_probability", "reward_texts", "sigmoid", "spread_scores"]


def reward_texts(
    items: Sequence[RewardItem], template: str, per_step: bool, suffix: str = ""
) -> tuple[list[str], list[tuple[int, int]]]:
    """One text per item (the whole trace), or one per step prefix when ``per_step``; and
    each item's (start, count) span in that flat list, so one request scores the batch."""
    texts: list[str] = []
    spans: list[tuple[int, int]] = []
    for item in items:
        uptos = range(1, len(item.steps) + 1) if per_step else [len(item.steps)]
        spans.append((len(texts), len(uptos)))
        texts.extend(
            template.format(question=item.question, steps="\n".join(item.steps[:k])) + suffix
            for k in uptos
        )
    return texts, spans


def spread_scores(
    values: Sequence[float],
    spans: Sequence[tuple[int, int]],
    items: Sequence[RewardItem],
    per_step: bool,
) -> list[tuple[float, ...]]:
    """Back to one tuple per item with one score per step (an outcome score is repeated)."""
    out: list[tuple[float, ...]] = []
    for item, (start, count) in zip(items, spans, strict=True):
        got = tuple(values[start : start + count])
        out.append(got if per_step else got * len(item.steps))
    return out


def sigmoid(value: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, value))))


def judge_probability(logprobs: dict[Any, float], good: Any, bad: Any | None) -> float:
    """P(good) from the judge's first-token logprobs; renormalised over {good, bad} when a
    bad token is given, so mass on unrelated tokens does not drag every score down."""
    p_good = math.exp(logprobs[good]) if good in logprobs else 0.0
    if bad is None:
        return p_good
    p_bad = math.exp(logprobs[bad]) if bad in logprobs else 0.0
    return p_good / (p_good + p_bad) if p_good + p_bad > 0 else 0.0
