"""What SGLang's native replies and requests mean, read without the network: an output
object as a ``Completion``, its speculative-decoding figures, and the two facts the shared
pool sizes deadlines from (``SGLANG_WIRE``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spec_tot.adapters.http import WireProtocol, positive_int
from spec_tot.requests import Completion, FinishReason

__all__ = [
    "SGLANG_WIRE",
    "output_tokens",
    "parse_output",
    "request_budget",
    "speculation_counts",
]


def parse_output(out: dict[str, Any], ids: Sequence[int] | None = None) -> Completion:
    """One SGLang output object -> Completion (``ids`` overrides incremental stream ids)."""
    meta = out.get("meta_info") or {}
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    token_ids = tuple(ids if ids is not None else out.get("output_ids") or ())
    return Completion(
        text=str(out.get("text", "")),
        token_ids=token_ids,
        num_tokens=int(meta.get("completion_tokens", len(token_ids))),
        finish_reason=FinishReason.from_wire(kind),
    )


def speculation_counts(meta: Any) -> dict[str, float]:
    """One output's speculative-decoding figures (the backend module's docstring), under the
    embedded engine's stat keys; empty when the server sent none."""
    if not isinstance(meta, dict) or not isinstance(meta.get("spec_verify_ct"), int):
        return {}
    passes = meta["spec_verify_ct"]
    counts = {
        "num_verify_rows": passes,
        "num_decode_rows": passes,
        "num_decode_tokens": meta.get("completion_tokens"),
        "num_draft_tokens": meta.get("spec_draft_token_num"),
        "num_accepted_tokens": meta.get("spec_accept_token_num"),
    }
    return {
        key: value
        for key, value in counts.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def request_budget(body: Any) -> int | None:
    """The most output tokens a ``/generate`` body asks for: ``sampling_params.max_new_tokens``
    (one dict, or one per prompt of a batch: the largest, as a batch's prompts run side by
    side). None for a body that generates nothing (classify, abort)."""
    if not isinstance(body, dict):
        return None
    params = body.get("sampling_params")
    per_prompt = params if isinstance(params, list) else [params]
    budgets = [positive_int(p.get("max_new_tokens")) for p in per_prompt if isinstance(p, dict)]
    return max((b for b in budgets if b is not None), default=None)


def output_tokens(reply: Any) -> float | None:
    """Output tokens per sample of a ``/generate`` reply: the longest ``meta_info
    .completion_tokens`` (the samples ran side by side)."""
    items = reply if isinstance(reply, list) else [reply]
    counts = [
        item["meta_info"].get("completion_tokens")
        for item in items
        if isinstance(item, dict) and isinstance(item.get("meta_info"), dict)
    ]
    numbers = [float(c) for c in counts if isinstance(c, int | float)]
    return max(numbers) if numbers else None


SGLANG_WIRE = WireProtocol(request_budget=request_budget, reply_tokens=output_tokens)
