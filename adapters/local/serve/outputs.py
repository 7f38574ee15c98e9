"""Response bodies in SGLang 0.5.23's shapes (``tokenizer_manager.py`` ``_handle_batch_output``
and ``schedule_batch.py`` finish reasons) and per-sample update streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from spec_tot.requests import Completion, FinishReason, GenerateRequest, GenerateResult

from ..backend import LocalBackend
from .live import engine_prefix

__all__ = ["Update", "error_body", "finish_reason", "merge_updates", "sample_json", "sse"]


@dataclass(frozen=True, slots=True)
class Update:
    """The state of one sample so far (cumulative); ``result`` is set on its last update."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    result: GenerateResult | None = None


def finish_reason(completion: Completion) -> dict[str, Any]:
    """``{"type": "stop", "matched": ...}``, ``{"type": "length", "length": n}`` or
    ``{"type": "abort", "message": ...}``."""
    if completion.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": completion.num_tokens}
    if completion.finish_reason is FinishReason.ABORT:
        return {"type": "abort", "message": "Abort request"}
    return {"type": "stop", "matched": completion.matched_stop}


def sample_json(
    rid: str,
    text: str,
    token_ids: Sequence[int],
    result: GenerateResult | None,
    logprobs: Any = None,
    decode: Any = None,
) -> dict[str, Any]:
    completion = result.completions[0] if result is not None else None
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason(completion) if completion is not None else None,
        "prompt_tokens": result.prompt_tokens if result is not None else 0,
        "completion_tokens": len(token_ids),
        "cached_tokens": result.cached_prompt_tokens if result is not None else 0,
        "weight_version": "default",
    }
    if logprobs is not None and result is not None:
        meta.update(logprob_meta(result, logprobs, decode))
    return {"text": text, "output_ids": list(token_ids), "meta_info": meta}


def logprob_meta(result: GenerateResult, opts: Any, decode: Any) -> dict[str, Any]:
    """SGLang's logprob fields (``tokenizer_manager.py`` ``add_logprob_to_meta_info``): each
    entry ``[logprob, token_id, text or None]``; top-k and given ids per position."""

    def entry(token: int, logprob: float | None) -> list[Any]:
        return [logprob, token, decode(token) if opts.text and decode is not None else None]

    def rows(items: Sequence[Any]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"token": [], "top": [], "given": []}
        for item in items:
            if item is None:  # the first prompt token has no logprob
                out["token"].append([None, None, None])
                out["top"].append(None)
                out["given"].append(None)
                continue
            out["token"].append(entry(item.token_id, item.logprob))
            out["top"].append([entry(t, lp) for t, lp in item.top])
            out["given"].append([entry(t, lp) for t, lp in item.given])
        return out

    completion = result.completions[0]
    output = rows(completion.logprobs or ())
    meta: dict[str, Any] = {
        "output_token_logprobs": output["token"],
        "output_token_logprobs_length": len(output["token"]),
    }
    prompt = rows(result.prompt_logprobs) if opts.prompt_from is not None else None
    meta["input_token_logprobs"] = prompt["token"] if prompt else []
    if opts.top > 0:
        meta["output_top_logprobs"] = output["top"]
        meta["input_top_logprobs"] = prompt["top"] if prompt else []
    if opts.given:
        meta["output_token_ids_logprobs"] = output["given"]
        meta["input_token_ids_logprobs"] = prompt["given"] if prompt else []
    return meta


def error_body(message: str, field: str | None = None, code: int = 400) -> dict[str, Any]:
    """The error object SGLang and OpenAI clients read (``error.message``). A message or
    field may quote the client's text (an unknown key, a bad value): lone surrogates in it
    are escaped, so the error itself always encodes as UTF-8."""
    kind = "invalid_request_error" if code < 500 else "internal_error"
    message = _encodable(message)
    param = None if field is None else _encodable(field)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _one(
    backend: LocalBackend,
    index: int,
    request: GenerateRequest,
    prompt_tokens: Callable[[GenerateRequest], int],
) -> AsyncIterator[Update]:
    """The engine's per-token updates of one sample (cumulative text and ids)."""
    async for up in backend.stream(request):
        result = None
        if up.completion is not None:
            # The stream carries no usage: the prompt is counted by merge_updates.
            tokens = prompt_tokens(request)
            result = GenerateResult(request.request_id, (up.completion,), tokens)
            yield Update(index, up.completion.text, up.completion.token_ids, result)
        else:
            yield Update(index, up.text, up.token_ids, None)


async def merge_updates(
    backend: LocalBackend, requests: Sequence[GenerateRequest]
) -> AsyncIterator[Update]:
    """Updates of every sample as they come (SGLang's ``_stream_batch_responses``). Updates
    are cumulative, so while the consumer is slow (its client reads slowly, or not at all)
    only each sample's latest one waits: what waits is bounded by the samples' own text,
    never by how long the client stalls."""
    latest: dict[int, Update] = {}  # index -> its newest update not yet taken
    ready = asyncio.Event()
    failures: list[BaseException] = []
    counted: dict[str, int] = {}
    open_samples = len(requests)

    def prompt_tokens(request: GenerateRequest) -> int:
        # Tokenised on the event loop once per distinct prompt, not once per sample.
        if request.prompt_ids is not None:
            return len(request.prompt_ids)
        text = request.prompt or ""
        if text not in counted:
            counted[text] = backend.count_tokens(text)
        return counted[text]

    async def pump(index: int, request: GenerateRequest) -> None:
        nonlocal open_samples
        try:
            async for update in _one(backend, index, request, prompt_tokens):
                latest.pop(index, None)  # a newer update replaces the untaken one
                latest[index] = update
                ready.set()
        except Exception as exc:
            failures.append(exc)
        finally:
            open_samples -= 1
            ready.set()

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        while True:
            await ready.wait()
            ready.clear()
            if failures:
                raise failures[0]
            while latest:
                index = next(iter(latest))
                yield latest.pop(index)
            if not open_samples and not latest:
                return
    finally:
        if open_samples:  # stopped early: one prefix abort, not one engine scan per sample
            await backend.abort(engine_prefix(requests))
        for task in tasks:
            task.cancel()  # the backend drops what is left of each sample
        await asyncio.gather(*tasks, return_exceptions=True)
