"""Logprobs over the completions protocol: ``logprobs: k`` asks for the sampled token's
logprob and the top k at each position (``choices[i].logprobs``: ``tokens``,
``token_logprobs``, ``top_logprobs`` as ``{token text: logprob}``). The protocol speaks token
*texts*; ``SamplingParams.logprob_token_ids`` names ids, so they are read through the served
model's tokenizer (the backend's ``tokenizer`` folder) from the top 20, where an id outside
them has logprob -inf. Without a tokenizer, ids are unknown (-1) and no ids can be given.

llama.cpp's ``llama-server`` answers the same request in the chat completions' shape:
``logprobs: {content: [{id, token, logprob, top_logprobs: [{id, token, logprob}]}]}``, with
the ids themselves, which are read as given."""

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
    if isinstance(block.get("content"), list):
        return _parse_chat_shape(block["content"], sampling, tokenizer)
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


def _parse_chat_shape(
    positions: list[Any], sampling: SamplingParams, tokenizer: Any
) -> tuple[TokenLogprob, ...]:
    """llama-server's shape: each position and each of its top entries carry their ``id``
    (else their ``token`` text, read through the tokenizer)."""

    def _entry_id(entry: dict[str, Any]) -> int:
        given = entry.get("id")
        if isinstance(given, int) and not isinstance(given, bool):
            return given
        return _id(tokenizer, str(entry.get("token", "")))

    keep = sampling.logprobs or 0
    out = []
    for position in positions:
        if not isinstance(position, dict):
            continue
        top: dict[int, float] = {}
        for entry in position.get("top_logprobs") or []:
            if isinstance(entry, dict) and entry.get("logprob") is not None:
                top.setdefault(_entry_id(entry), float(entry["logprob"]))
        value = position.get("logprob")
        best = sorted(top.items(), key=lambda kv: -kv[1])[:keep]
        out.append(
            TokenLogprob(
                token_id=_entry_id(position),
                logprob=float(value) if value is not None else -math.inf,
                top=tuple(best),
                given=tuple((i, top.get(i, -math.inf)) for i in sampling.logprob_token_ids),
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
