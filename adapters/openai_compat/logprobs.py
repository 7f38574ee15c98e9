"""Logprobs over the completions protocol: ``logprobs: k`` asks for the sampled token's
logprob and the top k at each position (``choices[i].logprobs``: ``tokens``,
``token_logprobs``, ``top_logprobs`` as ``{token text: logprob}``). The protocol speaks token
*texts*; ``SamplingParams.logprob_token_ids`` names ids, so they are read through the served
model's tokenizer (the backend's ``tokenizer`` folder) from the top 20, where an id outside
them has logprob -inf. Without a tokenizer, ids are unknown (-1) and no ids can be given."""

from __future__ import annotations

import math
from typing import Any

from spec_tot.errors import ConfigError
from spec_tot.requests import SamplingParams, TokenLogprob

__all__ = ["logprobs_asked", "parse_logprobs"]

_TOP_FOR_IDS = 20  # vLLM's default --max-logprobs


def logprobs_asked(sampling: SamplingParams, tokenizer: Any) -> int | None:
    """The ``logprobs`` field of the body (None: leave it out)."""
    if sampling.logprob_token_ids:
        if tokenizer is None:
            raise ConfigError(
                "logprob_token_ids",
                "an OpenAI-compatible server answers token texts: give the backend the served "
                "model's tokenizer folder (tokenizer=DIR) to read ids",
            )
        return max(sampling.logprobs or 0, _TOP_FOR_IDS)
    return sampling.logprobs


def parse_logprobs(
    block: Any, sampling: SamplingParams, tokenizer: Any
) -> tuple[TokenLogprob, ...]:
    """One ``TokenLogprob`` per generated position of a choice's ``logprobs`` block."""
    if not isinstance(block, dict):
        return ()
    texts = block.get("tokens") or []
    values = block.get("token_logprobs") or []
    tops = block.get("top_logprobs") or []
    wanted = [(i, _text(tokenizer, i)) for i in sampling.logprob_token_ids]
    keep = sampling.logprobs or 0
    out = []
    for j, value in enumerate(values):
        top = tops[j] if j < len(tops) and isinstance(tops[j], dict) else {}
        best = sorted(top.items(), key=lambda kv: -float(kv[1]))[:keep]
        out.append(
            TokenLogprob(
                token_id=_id(tokenizer, texts[j] if j < len(texts) else ""),
                logprob=float(value) if value is not None else -math.inf,
                top=tuple((_id(tokenizer, t), float(lp)) for t, lp in best),
                given=tuple((i, float(top.get(t, -math.inf))) for i, t in wanted),
            )
        )
    return tuple(out)


def _text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def _id(tokenizer: Any, text: str) -> int:
    if tokenizer is None:
        return -1
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else -1
