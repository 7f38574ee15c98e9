"""Response bodies in SGLang 0.5.23's shapes (``tokenizer_manager.py`` ``_handle_batch_output``
and ``schedule_batch.py`` finish reasons) and per-sample update streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from spec_tot.requests import Completion, FinishReason, GenerateRequest, GenerateResult

from ..backend import LocalBackend

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
    return {"type": "stop", "matched": getattr(completion, "matched_stop", None)}


def sample_json(
    rid: str, text: str, token_ids: Sequence[int], result: GenerateResult | None
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
    return {"text": text, "output_ids": list(token_ids), "meta_info": meta}


def error_body(message: str, field: str | None = None, code: int = 400) -> dict[str, Any]:
    """The error object SGLang and OpenAI clients read (``error.message``)."""
    kind = "invalid_request_error" if code < 500 else "internal_error"
    return {"error": {"message": message, "type": kind, "param": field, "code": code}}


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _one(
    backend: LocalBackend, index: int, request: GenerateRequest
) -> AsyncIterator[Update]:
    stream = getattr(backend, "stream", None)
    if stream is None:  # an engine without incremental output: one update at the end
        result = await backend.generate(request)
        c = result.completions[0]
        yield Update(index, c.text, c.token_ids, result)
        return
    async for result in stream(request):
        c = result.completions[0]
        done = c.finish_reason is not None and getattr(result, "finished", True)
        yield Update(index, c.text, c.token_ids, result if done else None)


async def merge_updates(
    backend: LocalBackend, requests: Sequence[GenerateRequest]
) -> AsyncIterator[Update]:
    """Updates of every sample as they come (SGLang's ``_stream_batch_responses``)."""
    queue: asyncio.Queue[Update | BaseException | None] = asyncio.Queue()

    async def pump(index: int, request: GenerateRequest) -> None:
        try:
            async for update in _one(backend, index, request):
                await queue.put(update)
        except Exception as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # a cancelled sample is aborted in the engine by the backend
        await asyncio.gather(*tasks, return_exceptions=True)
