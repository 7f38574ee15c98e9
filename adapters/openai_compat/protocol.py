"""What the OpenAI-compatible servers' replies and requests mean, read without the network:
the two facts the shared pool sizes deadlines from (``OPENAI_WIRE``) and vLLM's
speculative-decoding counters on its Prometheus page."""

from __future__ import annotations

from typing import Any

from spec_tot.adapters.http import WireProtocol, positive_int

__all__ = ["OPENAI_WIRE", "output_tokens", "parse_vllm_speculation", "request_budget"]

# vLLM's Prometheus counter names (without the ``_total`` suffix) -> this library's stat keys
_VLLM_SPEC = {
    "vllm:spec_decode_num_drafts": "num_verify_rows",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def parse_vllm_speculation(text: str) -> dict[str, float]:
    """The speculative-decoding counters in a Prometheus text page, summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_num_"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].removesuffix("_total")
        key = _VLLM_SPEC.get(name)
        if key is None:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def request_budget(body: Any) -> int | None:
    """The most output tokens a completions body asks for: ``max_tokens`` (or
    ``max_completion_tokens``). Its ``n`` samples run side by side, so ``n`` does not
    multiply it. None for a body that generates nothing (pooling)."""
    if not isinstance(body, dict):
        return None
    return positive_int(body.get("max_tokens", body.get("max_completion_tokens")))


def output_tokens(reply: Any) -> float | None:
    """Output tokens per sample of a completions reply: ``usage.completion_tokens`` over
    the choices."""
    if not isinstance(reply, dict) or not isinstance(reply.get("usage"), dict):
        return None
    total = reply["usage"].get("completion_tokens")
    choices = reply.get("choices")
    per = len(choices) if isinstance(choices, list) and choices else 1
    return float(total) / per if isinstance(total, int | float) else None


OPENAI_WIRE = WireProtocol(request_budget=request_budget, reply_tokens=output_tokens)
