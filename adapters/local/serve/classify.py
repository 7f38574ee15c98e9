"""SGLang's ``/classify`` on the embedded PRM: a reward model served with ``--is-embedding``
(SGLang 0.5.23 ``srt/entrypoints/http_server.py`` ``classify_request``, body
``srt/managers/io_struct.py`` ``EmbeddingReqInput``, reply built in
``srt/managers/tokenizer_manager.py`` ``_handle_batch_output``).

Body: ``text`` (one string or a list) or ``input_ids`` (one list of the reward model's
token ids or a list of them), ``rid`` (a string, or one per prompt; a batch expands one
string to ``{rid}_{i}``), ``sampling_params`` (accepted and unused, as in SGLang, which sets
``max_new_tokens`` to 0 itself), ``priority``, ``log_metrics``, ``routing_key``; the
multimodal, LoRA and pooling options only at their no-op defaults. One prompt answers
``{"embedding": [reward], "meta_info": {"id", "finish_reason": {"type": "length", "length":
0}, "prompt_tokens", "weight_version", "num_retractions"}}``; a batch answers a list of
those in order.

The reward is the PRM's ``logit(good) - logit(bad)`` at the text's last step tag (a raw
logit, as a reward head gives; ``sigmoid`` of it is the step score), so any text can be
scored. A text that holds no step tag is read in the layout of a step-by-step answer: its
first line is the question and every later line one step, each followed by the tag (the
Math-Shepherd layout the PRM was trained on), which is how spec-tot's SGLang adapter sends
``{question}\\n{steps}``. A text already tagged is scored as given (the tag appended at
its end if missing); token ids likewise (the tag's ids appended unless they end with them).
Every length is checked before any tokenising or allocation: a bad one is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spec_tot.errors import ConfigError
from spec_tot.requests import RewardItem, check_text

from ..backend import LocalBackend
from ..core.messages import RewardInfo
from ..engine.prm import build_prm_text
from .fields import Inert, check_known, opt_bool, opt_int, opt_str, token_ids
from .schema import MAX_SAMPLES, check_samples, is_nested, request_ids

__all__ = ["ClassifyBatch", "parse_classify", "score_batch"]

_TOP = {"text", "input_ids", "rid", "sampling_params", "priority", "log_metrics", "routing_key",
        "external_trace_header"}  # fmt: skip
_INERT = {
    name: Inert()
    for name in (
        "input_embeds", "image_data", "video_data", "audio_data", "lora_path", "lora_id",
        "modalities", "dimensions", "embed_override_token_id", "embed_overrides",
        "positional_embed_overrides", "multi_item_delimiter_indices", "token_indices_to_pool",
        "decision_layout", "http_worker_ipc",
    )
} | {
    name: Inert(False)
    for name in ("return_pooled_hidden_states", "return_prompt_token_ids",
                 "is_cross_encoder_request", "background")
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ClassifyBatch:
    """What to score: each prompt as a text ending with the step tag, or as token ids ending
    with the tag's ids."""

    prompts: tuple[str | tuple[int, ...], ...]
    rids: tuple[str, ...]
    fields: tuple[str, ...]  # the client's name of each prompt, for errors
    single: bool
    key: str = "text"  # text or input_ids


def parse_classify(
    body: Any, prm: RewardInfo | None, max_samples: int = MAX_SAMPLES
) -> ClassifyBatch:
    """Validate a ``/classify`` body; a bad field raises ``ConfigError`` naming it."""
    if not isinstance(body, dict):
        raise ConfigError("body", "expected a JSON object")
    check_known(body, _TOP, _INERT)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ConfigError("text", "give exactly one of text and input_ids")
    if prm is None:
        raise ConfigError("text", "this server has no reward model (start it with a PRM)")
    key, value = ("text", text) if text is not None else ("input_ids", ids)
    single = isinstance(value, str) if key == "text" else not is_nested(value)
    rows = [value] if single else value
    if not isinstance(rows, list) or not rows:
        kind = "a string" if key == "text" else "a list of token ids"
        raise ConfigError(key, f"expected {kind} or a non-empty list of them")
    check_samples(len(rows), None, max_samples, key)
    fields = tuple(key if single else f"{key}[{i}]" for i in range(len(rows)))
    prompts = tuple(
        _text(row, field, prm) if key == "text" else _ids(row, field, prm)
        for row, field in zip(rows, fields, strict=True)
    )
    _dummy_sampling(body.get("sampling_params"), len(rows))
    opt_int(body, "priority", "priority", 0)
    opt_bool(body, "log_metrics", "log_metrics", True)
    opt_str(body, "routing_key", "routing_key")
    rids = request_ids(body.get("rid"), len(rows), not single)
    return ClassifyBatch(prompts, tuple(rids), fields, single, key)


def _text(text: Any, field: str, prm: RewardInfo) -> str:
    if not isinstance(text, str):
        raise ConfigError(field, "expected a string (text pairs for cross-encoders: not served)")
    check_text(text, field, allow_empty=False)
    if len(text) > prm.max_chars:  # before any tokenising: it cannot fit
        raise ConfigError(field, f"{len(text)} characters cannot fit in {prm.max_len} tokens")
    tag = prm.step_tag
    if tag not in text and "\n" in text:
        # The step-by-step layout, ``question + "\\n" + "\\n".join(steps)`` read back exactly
        # (a blank line is an empty step): tag every step, as PrmScorer.score does.
        question, *steps = text.split("\n")
        tagged, _ = build_prm_text(RewardItem("classify", question, tuple(steps)), tag)
        return tagged[:-1]  # ends with the last step's tag (the newline after it dropped)
    return text if text.endswith(tag) else text + tag


def _ids(row: Any, field: str, prm: RewardInfo) -> tuple[int, ...]:
    ids = token_ids(row, field, prm.vocab_size)
    tag = tuple(prm.tag_ids)
    tagged = ids if ids[-len(tag) :] == tag else ids + tag
    if len(tagged) > prm.max_len:
        raise ConfigError(field, f"{len(tagged)} tokens with the step tag; the PRM reads "
                          f"at most {prm.max_len}")  # fmt: skip
    return tagged


def _dummy_sampling(params: Any, count: int) -> None:
    """SGLang's ``EmbeddingReqInput.sampling_params``: kept for compatibility and unused."""
    entries = params if isinstance(params, list) else [params]
    if isinstance(params, list) and len(params) != count:
        raise ConfigError("sampling_params", f"{len(params)} entries for {count} prompts")
    for i, entry in enumerate(entries):
        if entry is not None and not isinstance(entry, dict):
            field = f"sampling_params[{i}]" if isinstance(params, list) else "sampling_params"
            raise ConfigError(field, "expected an object")


async def score_batch(backend: LocalBackend, batch: ClassifyBatch) -> list[dict[str, Any]]:
    """The rows of the reply, in order. A prompt the PRM still refuses (more tokens than it
    reads, known only once tokenised) is a ``ConfigError`` naming the client's field."""
    tokenizer = backend.reward_tokenizer
    assert tokenizer is not None  # parse_classify refused a server without a PRM
    try:
        rewards = await backend.classify(list(batch.prompts))
    except ConfigError as exc:  # PrmScorer names text[i] / input_ids[i] of its own list
        head, _, rest = exc.field.partition("[")
        index, _, tail = rest.partition("]")
        if head not in ("text", "input_ids") or not index.isdigit():
            raise
        message = str(exc)[len(exc.field) + 2 :]
        raise ConfigError(batch.fields[int(index)] + tail, message) from None
    rows = []
    for rid, prompt, reward in zip(batch.rids, batch.prompts, rewards, strict=True):
        tokens = len(tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else len(prompt)
        meta = {
            "id": rid,
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": tokens,
            "weight_version": "default",
            "num_retractions": 0,
        }
        rows.append({"embedding": [reward], "meta_info": meta})
    return rows
