"""``spec-tot serve``: the embedded engine behind SGLang's native HTTP protocol (a subset).

So the SGLang adapter can be run end to end against real generation on any machine. Routes:
- ``POST /generate``: ``text`` or ``input_ids``; ``sampling_params`` (``n``, ``temperature``,
  ``top_p``, ``top_k``, ``max_new_tokens``, ``stop``, ``stop_token_ids``, ``sampling_seed``);
  ``rid``; ``priority``; ``stream``. One dict back for n == 1, else a list whose ids are
  ``f"{rid}_{i}"``, as SGLang answers. With ``stream`` the answer comes as server-sent events
  (``data: {...}`` then ``data: [DONE]``); the engine has no incremental detokenised output,
  so each sample arrives as one event when it is finished. A client that disconnects has its
  request aborted.
- ``POST /abort_request`` ``{"rid", "abort_all"}``: aborts every live rid starting with
  ``rid`` (SGLang's scheduler rule), and the parent rid of an ``f"{rid}_{i}"`` sample.
- ``GET /health``, ``GET /health_generate``, ``GET /get_server_info``.
- ``POST /classify`` ``{"text": ...}``: the PRM's score of the last step as a logit, in
  ``[{"embedding": [logit]}]``. The text is the question on its first line, then one step per
  line (the SGLang adapter's default reward template).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from spec_tot.errors import ConfigError
from spec_tot.requests import (
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Priority,
    RewardItem,
    SamplingParams,
)

from .backend import LocalBackend

__all__ = ["create_server_app", "parse_generate"]

_SAMPLE_ID = re.compile(r"^(.*)_(\d+)$")
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


def parse_generate(body: Any) -> tuple[GenerateRequest, bool]:
    """A ``GenerateRequest`` (and the stream flag) from a /generate body; ConfigError names
    the bad field."""
    if not isinstance(body, dict):
        raise ConfigError("body", "expected a JSON object")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ConfigError("sampling_params", "expected an object")
    stop = params.get("stop") or ()
    seed = params.get("sampling_seed")
    sampling = SamplingParams(
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=int(params.get("top_k", -1)),
        max_tokens=int(params.get("max_new_tokens", 128)),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(int(t) for t in params.get("stop_token_ids") or ()),
        seed=int(seed) if seed is not None else None,
    )
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ConfigError("text", "give exactly one of text and input_ids")
    if text is not None and not isinstance(text, str):
        raise ConfigError("text", "batched prompts are not supported: send one per request")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
        raise ConfigError("input_ids", "expected one list of token ids")
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise ConfigError("rid", "expected one string")
    priority = body.get("priority")
    request = GenerateRequest(
        request_id=rid,
        sampling=sampling,
        prompt=text,
        prompt_ids=tuple(ids) if ids is not None else None,
        n=int(params.get("n", 1)),
        # Reported as schedule_low_priority_values_first: 0 (or none) is committed work.
        priority=Priority.SPECULATIVE if priority and int(priority) > 0 else Priority.COMMITTED,
    )
    return request, bool(body.get("stream", False))


def _sample_json(result: GenerateResult, index: int, completion: Completion) -> dict[str, Any]:
    rid = result.request_id if len(result.completions) == 1 else f"{result.request_id}_{index}"
    return {
        "text": completion.text,
        "output_ids": list(completion.token_ids),
        "index": index,
        "meta_info": {
            "id": rid,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": completion.num_tokens,
            "cached_tokens": result.cached_prompt_tokens,
            "finish_reason": {"type": _FINISH[completion.finish_reason]},
        },
    }


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_server_app(backend: LocalBackend, *, model_path: str = "") -> Starlette:
    live: set[str] = set()

    async def generate(request: Request) -> Response:
        try:
            gen, stream = parse_generate(await request.json())
        except (ConfigError, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        if gen.request_id in live:
            return _error(400, f"rid {gen.request_id!r} is already running")
        live.add(gen.request_id)
        task = asyncio.create_task(backend.generate(gen))

        async def watch() -> None:
            while not task.done():
                if await request.is_disconnected():
                    await backend.abort(gen.request_id)
                    return
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            result = await task
        except Exception as exc:
            return _error(500, f"{type(exc).__name__}: {exc}")
        finally:
            watcher.cancel()
            live.discard(gen.request_id)
        samples = [_sample_json(result, i, c) for i, c in enumerate(result.completions)]
        if stream:
            return StreamingResponse(_events(samples), media_type="text/event-stream")
        return JSONResponse(samples[0] if gen.n == 1 else samples)

    async def abort_request(request: Request) -> Response:
        body = await request.json()
        if body.get("abort_all"):
            targets = set(live)
        else:
            rid = str(body.get("rid") or "")
            if not rid:
                return _error(400, "rid: give a request id or abort_all")
            targets = {r for r in live if r.startswith(rid)}
            sample = _SAMPLE_ID.match(rid)
            if sample and sample.group(1) in live:
                targets.add(sample.group(1))
        for rid in targets:
            await backend.abort(rid)
        return JSONResponse({"aborted": sorted(targets)})

    async def health(_request: Request) -> Response:
        return Response(status_code=200)

    async def server_info(_request: Request) -> Response:
        caps = backend.capabilities
        return JSONResponse(
            {
                "model_path": model_path,
                "max_running_requests": caps.max_running_requests,
                "max_total_num_tokens": int(
                    caps.extra.get("num_kv_blocks", 0) * caps.extra.get("block_size", 0)
                ),
                "enable_priority_scheduling": True,
                "schedule_low_priority_values_first": True,
                "engine_dedup": True,
                "saturation_batch": caps.saturation_batch,
                "version": "spec-tot-serve",
            }
        )

    async def classify(request: Request) -> Response:
        body = await request.json()
        texts = body.get("text")
        single = isinstance(texts, str)
        texts = [texts] if single else texts
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return _error(400, "text: expected a string or a list of strings")
        items = []
        for i, text in enumerate(texts):
            question, *steps = text.split("\n")
            steps = [s for s in steps if s.strip()]
            if not steps:
                return _error(400, f"text[{i}]: no step after the question line")
            items.append(
                RewardItem(request_id=f"classify-{i}", question=question, steps=tuple(steps))
            )
        try:
            scores = await backend.score(items)
        except Exception as exc:
            return _error(500, f"{type(exc).__name__}: {exc}")
        rows = [{"embedding": [_logit(s[-1])], "index": i} for i, s in enumerate(scores)]
        return JSONResponse(rows[0] if single else rows)

    routes = [
        Route("/generate", generate, methods=["POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/classify", classify, methods=["POST"]),
    ]
    return Starlette(routes=routes)


async def _events(samples: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for sample in samples:
        yield b"data: " + json.dumps(sample).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))
