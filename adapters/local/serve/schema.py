"""SGLang's ``/generate`` body (``GenerateReqInput`` and ``SamplingParams`` of SGLang 0.5.23,
``srt/managers/io_struct.py`` and ``srt/sampling/sampling_params.py``) -> engine requests.

Single or batched prompts (``text`` or ``input_ids``), ``sampling_params`` as one dict or one
per prompt, ``rid`` as one string or one per prompt, ``n`` parallel samples. Each sample
becomes its own engine request, so one sample can be aborted alone. A parameter the engine
does not implement is accepted only at its no-op default; anything else is a 400 naming it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from spec_tot.errors import ConfigError
from spec_tot.requests import GenerateRequest, Priority, SamplingParams, check_text
from spec_tot.seeds import sample_seed

from .fields import (
    Inert,
    check_known,
    opt_bool,
    opt_float,
    opt_int,
    stop_strings,
    token_ids,
)
from .limits import demand

__all__ = [
    "MAX_SAMPLES",
    "GenerateBatch",
    "Limits",
    "Logprobs",
    "Sample",
    "check_samples",
    "is_nested",
    "parse_generate",
    "request_ids",
    "sample_sampling",
]

# SGLang sampling parameters the engine does not implement, at the values that change
# nothing (SGLang's frontend sends every one of them with each request).
_INERT_SAMPLING = {
    "min_p": Inert(0.0, 0),
    "frequency_penalty": Inert(0.0, 0),
    "presence_penalty": Inert(0.0, 0),
    "repetition_penalty": Inert(1.0, 1),
    "regex": Inert(),
    "json_schema": Inert(),
    "ebnf": Inert(),
    "structural_tag": Inert(),
    "stop_regex": Inert("", [], ()),
    "beam_width": Inert(),
    "logit_bias": Inert({}),
    "custom_params": Inert({}),
    "watermark": Inert(),
    "skip_special_tokens": Inert(True),
    "spaces_between_special_tokens": Inert(True),
    "no_stop_trim": Inert(False),
}
_SAMPLING = {
    "max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "n",
    "sampling_seed", "stream_interval", "min_new_tokens", "ignore_eos",
}  # fmt: skip
_INERT_TOP = {
    "input_embeds": Inert(),
    "image_data": Inert(),
    "video_data": Inert(),
    "audio_data": Inert(),
    "lora_path": Inert(),
    "lora_id": Inert(),
    "session_params": Inert(),
    "custom_logit_processor": Inert(),
    "return_hidden_states": Inert(False),
    "return_routed_experts": Inert(False),
    "return_prompt_token_ids": Inert(False),
    "return_bytes": Inert(False),
    "return_entropy": Inert(False),
    "background": Inert(False),
    "modalities": Inert(),
    "bootstrap_host": Inert(),
    "bootstrap_port": Inert(),
    "bootstrap_room": Inert(),
    "data_parallel_rank": Inert(),
}
# Read, or metadata with no effect on the answer.
_TOP = {
    "text", "input_ids", "sampling_params", "rid", "stream", "priority", "log_metrics",
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
    "return_text_in_logprobs",
    "no_logs", "custom_labels", "routing_key", "conversation_id", "extra_key",
}  # fmt: skip
MAX_SAMPLES = 4096  # per HTTP request (prompts x n), unless ServeLimits says otherwise


@dataclass(frozen=True, slots=True)
class Limits:
    """What the engine holds: prompts are checked against these before any tokenising."""

    vocab_size: int
    max_len: int  # prompt + output tokens
    max_prompt_chars: int  # a text longer than this cannot fit: refused before tokenising
    max_samples: int = MAX_SAMPLES  # per request: prompts x n (ServeLimits)


@dataclass(frozen=True, slots=True)
class Sample:
    """One engine request (one sample) and the rid the client knows it by."""

    rid: str
    request: GenerateRequest
    stream_interval: int = 1


@dataclass(frozen=True, slots=True)
class GenerateBatch:
    samples: tuple[Sample, ...]  # prompt-major, then sample: SGLang's output order
    item_rids: tuple[str, ...]  # one per prompt; for n > 1 each also names its samples
    single: bool  # one prompt and n == 1: the answer is one object, not a list
    stream: bool
    logprobs: Logprobs | None = None  # return_logprob: what meta_info reports


@dataclass(frozen=True, slots=True)
class Logprobs:
    top: int  # top_logprobs_num
    given: tuple[int, ...]  # token_ids_logprob
    prompt_from: int | None  # logprob_start_len (None: output only)
    text: bool  # return_text_in_logprobs


# SamplingParams field -> the SGLang name a client sent.
_SGLANG_NAME = {"max_tokens": "max_new_tokens", "seed": "sampling_seed", "min_tokens":
                "min_new_tokens"}  # fmt: skip


def parse_generate(
    body: Any, limits: Limits, admit: Callable[[int, int], None] | None = None
) -> GenerateBatch:
    """Validate a ``/generate`` body; a bad field raises ``ConfigError`` naming it.
    ``admit(samples, tokens)`` is called once every field is checked and before any sample
    is built (``Admission.hold``: a full server refuses a request for what it costs to
    read, never for what it costs to build)."""
    if not isinstance(body, dict):
        raise ConfigError("body", "expected a JSON object")
    check_known(body, _TOP, _INERT_TOP)
    prompts, key = _prompts(body, limits)
    count = len(prompts)
    params = body.get("sampling_params")
    if isinstance(params, list):
        if len(params) != count:
            raise ConfigError("sampling_params", f"{len(params)} entries for {count} prompts")
        parsed = [_sampling(p, limits, f"sampling_params[{i}]") for i, p in enumerate(params)]
    else:
        parsed = [_sampling(params, limits, "sampling_params")] * count
    ns = {n for _, n, _ in parsed}
    if len(ns) > 1:
        raise ConfigError("sampling_params.n", "must be the same for every prompt of a batch")
    n = ns.pop()
    check_samples(count, n, limits.max_samples, "sampling_params.n")
    batch = isinstance(body.get(key), list) and (key == "text" or is_nested(body.get(key)))
    item_rids = request_ids(body.get("rid"), count, batch)
    priority = opt_int(body, "priority", "priority", 0)
    stream = opt_bool(body, "stream", "stream", False)
    logprobs = _logprobs(body, limits)
    if logprobs is not None:
        parsed = [
            (replace(sp, logprobs=logprobs.top, logprob_token_ids=logprobs.given), n_, k)
            for sp, n_, k in parsed
        ]
    if admit is not None:
        max_tokens = [sp.max_tokens for sp, _, _ in parsed]
        admit(count * n, n * demand(prompts, max_tokens, limits.max_len))
    samples = []
    for i, prompt in enumerate(prompts):
        sampling, _, interval = parsed[i]
        width = len(str(n - 1))
        for j in range(n):
            rid = item_rids[i] if n == 1 else f"{item_rids[i]}_{j:0{width}d}"
            samples.append(
                Sample(
                    rid,
                    GenerateRequest(
                        request_id=rid,
                        sampling=sample_sampling(sampling, j),
                        prompt=prompt if isinstance(prompt, str) else None,
                        prompt_ids=None if isinstance(prompt, str) else prompt,
                        # Reported as schedule_low_priority_values_first: <= 0 is committed.
                        priority=Priority.SPECULATIVE if priority > 0 else Priority.COMMITTED,
                        prompt_logprobs_from=logprobs.prompt_from if logprobs else None,
                    ),
                    interval,
                )
            )
    return GenerateBatch(tuple(samples), tuple(item_rids), not batch and n == 1, stream, logprobs)


def _logprobs(body: dict[str, Any], limits: Limits) -> Logprobs | None:
    """SGLang's logprob fields (one value for the whole batch)."""
    if not opt_bool(body, "return_logprob", "return_logprob", False):
        return None
    given = body.get("token_ids_logprob")
    start = opt_int(body, "logprob_start_len", "logprob_start_len", -1, lo=-1)
    return Logprobs(
        top=opt_int(body, "top_logprobs_num", "top_logprobs_num", 0, lo=0, hi=limits.vocab_size),
        given=() if given is None else token_ids(given, "token_ids_logprob", limits.vocab_size),
        prompt_from=None if start < 0 else start,
        text=opt_bool(body, "return_text_in_logprobs", "return_text_in_logprobs", False),
    )


def sample_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The sampling of sample ``index`` of a request's n samples: sample 0 (and any sample
    without a seed) is the request's own; the others get ``sample_seed``'s derived seed."""
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=sample_seed(sampling.seed, index))


def sampling_params(
    field: str, names: Mapping[str, str] | None = None, **values: Any
) -> SamplingParams:
    """``SamplingParams(**values)``; its own errors renamed to the client's field names
    (``names``: SamplingParams field -> the API's name; default SGLang's)."""
    try:
        return SamplingParams(**values)
    except ConfigError as exc:
        name = (_SGLANG_NAME if names is None else names).get(exc.field, exc.field)
        raise ConfigError(field + name, str(exc).split(": ", 1)[-1]) from None


def is_nested(value: Any) -> bool:
    # Any JSON value may arrive here (an int, an object): only a list can be nested.
    return isinstance(value, list) and bool(value) and isinstance(value[0], list)


def _prompts(body: dict[str, Any], limits: Limits) -> tuple[list[str | tuple[int, ...]], str]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ConfigError("text", "give exactly one of text and input_ids")
    if text is not None:
        texts = text if isinstance(text, list) else [text]
        if not texts:
            raise ConfigError("text", "is an empty batch")
        check_samples(len(texts), None, limits.max_samples, "text")
        for i, t in enumerate(texts):
            field = f"text[{i}]" if isinstance(text, list) else "text"
            if not isinstance(t, str):
                raise ConfigError(field, "expected a string")
            check_text(t, field, allow_empty=False)
            if len(t) > limits.max_prompt_chars:
                raise ConfigError(
                    field,
                    f"{len(t)} characters cannot fit the engine's {limits.max_len} tokens",
                )
        return list(texts), "text"
    if not isinstance(ids, list):
        raise ConfigError("input_ids", "expected a list of token ids or a list of such lists")
    rows = ids if is_nested(ids) else [ids]
    check_samples(len(rows), None, limits.max_samples, "input_ids")
    out: list[str | tuple[int, ...]] = []
    for i, row in enumerate(rows):
        field = f"input_ids[{i}]" if rows is ids else "input_ids"
        got = token_ids(row, field, limits.vocab_size)
        if len(got) >= limits.max_len:
            raise ConfigError(field, f"{len(got)} tokens; the engine holds {limits.max_len}")
        out.append(got)
    return out, "input_ids"


def check_samples(prompts: int, n: int | None, cap: int, field: str) -> None:
    """``prompts x n`` samples within ``cap`` (``max_samples_per_request``), checked before
    any sample is built (``n`` None: not read yet, at least 1): a ``ConfigError`` naming
    ``field`` and the limit."""
    if prompts * (n or 1) > cap:
        made = f"x n={n} make {prompts * n}" if n is not None else f"make at least {prompts}"
        raise ConfigError(
            field,
            f"{prompts} prompts {made} samples; this server's max_samples_per_request is {cap}",
        )


def request_ids(rid: Any, count: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        if not rid:
            raise ConfigError("rid", "must be a non-empty string")
        check_text(rid, "rid")  # echoed in every answer: it must encode
        return [f"{rid}_{i}" for i in range(count)] if batch else [rid]
    if not isinstance(rid, list) or len(rid) != count:
        raise ConfigError("rid", f"expected a string or a list of {count} strings")
    for i, r in enumerate(rid):
        if not isinstance(r, str) or not r:
            raise ConfigError(f"rid[{i}]", "expected a non-empty string")
        check_text(r, f"rid[{i}]")
    if len(set(rid)) != len(rid):
        raise ConfigError("rid", "request ids in a batch must be unique")
    return list(rid)


def _sampling(params: Any, limits: Limits, field: str) -> tuple[SamplingParams, int, int]:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(field, "expected an object")
    check_known(params, _SAMPLING, _INERT_SAMPLING, prefix=field + ".")
    f = field + "."
    max_new = opt_int(params, "max_new_tokens", f + "max_new_tokens", 128, lo=0)
    stop_ids = params.get("stop_token_ids")
    sampling = sampling_params(
        f,
        temperature=opt_float(params, "temperature", f + "temperature", 1.0),
        top_p=opt_float(params, "top_p", f + "top_p", 1.0),
        top_k=opt_int(params, "top_k", f + "top_k", -1),
        # null: up to the engine's length limit, as SGLang does.
        max_tokens=max_new if params.get("max_new_tokens") is not None else limits.max_len,
        stop=stop_strings(params.get("stop"), f + "stop"),
        stop_token_ids=()
        if stop_ids is None
        else token_ids(stop_ids, f + "stop_token_ids", limits.vocab_size, allow_empty=True),
        seed=opt_int(params, "sampling_seed", f + "sampling_seed", None, lo=-(2**63), hi=2**63 - 1),
        min_tokens=opt_int(params, "min_new_tokens", f + "min_new_tokens", 0, lo=0),
        ignore_eos=opt_bool(params, "ignore_eos", f + "ignore_eos", False),
    )
    n = opt_int(params, "n", f + "n", 1, lo=1, hi=limits.max_samples)
    interval = opt_int(params, "stream_interval", f + "stream_interval", 1, lo=1)
    return sampling, n, interval
