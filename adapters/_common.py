"""Helpers shared by the HTTP serving adapters (SGLang native, OpenAI-compatible):
subtree matching, SSE decoding, reward batching and score math, option splitting."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from spec_tot.errors import BackendError
from spec_tot.requests import Completion, FinishReason, GenerateRequest, GenerateResult, RewardItem

from ._http import HttpConfig

__all__ = [
    "aborted_result",
    "judge_probability",
    "reward_texts",
    "sigmoid",
    "split_http_options",
    "spread_scores",
    "sse_events",
]


def aborted_result(request: GenerateRequest) -> GenerateResult:
    comps = tuple(Completion("", finish_reason=FinishReason.ABORT) for _ in range(request.n))
    return GenerateResult(request.request_id, comps)


async def sse_events(response: httpx.Response, where: str) -> AsyncIterator[dict[str, Any]]:
    """Decode ``data: {...}`` events until ``data: [DONE]``. A stream that ends without
    ``[DONE]`` was cut (server died, proxy dropped it): that is an error, not a short answer."""
    try:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments / keep-alives
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if isinstance(event, dict) and "error" in event:
                raise BackendError(where, f"server error in stream: {event['error']}")
            yield event
    except (httpx.HTTPError, ValueError) as exc:
        raise BackendError(where, f"stream broken: {exc!r}") from exc
    raise BackendError(where, "stream ended before [DONE]")


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


def split_http_options(options: dict[str, Any]) -> HttpConfig:
    """Take ``http=HttpConfig(...)`` or loose HttpConfig fields out of factory options."""
    given = options.pop("http", None)
    if isinstance(given, HttpConfig):
        return given
    fields = {k: options.pop(k) for k in list(options) if k in HttpConfig.__dataclass_fields__}
    return HttpConfig(**fields)
