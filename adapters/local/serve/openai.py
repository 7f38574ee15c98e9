"""OpenAI-compatible routes on the same port, as SGLang serves them (SGLang 0.5.23
``srt/entrypoints/openai/protocol.py``; OpenAI's API reference): ``GET /v1/models`` and
``/v1/models/{model}``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` with ``n``
and streaming. Chat prompts use the tokenizer's chat template, or a plain ``role: content``
layout when the model has none. Unimplemented parameters are a 400 naming them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from spec_tot.errors import ConfigError
from spec_tot.requests import (
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    check_text,
)

from .context import ServeContext
from .fields import Inert, check_known, opt_bool, opt_float, opt_int, stop_strings, token_ids
from .limits import demand
from .live import run_samples
from .native import guarded
from .outputs import error_body, merge_updates, sse
from .schema import Limits, check_samples, sample_sampling, sampling_params
from .streams import BoundedStream

__all__ = ["openai_routes"]

# min_tokens and ignore_eos as vLLM and SGLang take them (serving benchmarks send them).
_COMMON = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
           "stream", "stream_options", "stop_token_ids", "user", "min_tokens",
           "ignore_eos"}  # fmt: skip
_INERT = {
    "frequency_penalty": Inert(0.0, 0),
    "presence_penalty": Inert(0.0, 0),
    "repetition_penalty": Inert(1.0, 1),
    "min_p": Inert(0.0, 0),
    "logit_bias": Inert({}),
    "skip_special_tokens": Inert(True),
    "regex": Inert(),
    "json_schema": Inert(),
    "ebnf": Inert(),
    "best_of": Inert(1),
    "metadata": Inert({}),
    "store": Inert(False),
    "service_tier": Inert("auto", "default"),
    "rid": Inert(),
}
_COMPLETION_INERT = {**_INERT, "logprobs": Inert(0), "echo": Inert(False), "suffix": Inert("")}
_CHAT_INERT = {
    **_INERT,
    "logprobs": Inert(False),
    "top_logprobs": Inert(0),
    "response_format": Inert({"type": "text"}),
    "tools": Inert([]),
    "tool_choice": Inert("none", "auto"),
    "parallel_tool_calls": Inert(True, False),
    "reasoning_effort": Inert(),
    "modalities": Inert(["text"]),
}
_REASON = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


def openai_routes(ctx: ServeContext) -> list[Route]:
    def card() -> dict[str, Any]:
        return {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "spec-tot",
                "root": ctx.model_name, "max_model_len": ctx.limits.max_len}  # fmt: skip

    async def models(_request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [card()]})

    async def model(request: Request) -> Response:
        if request.path_params["model"] != ctx.model_name:
            return _no_model(request.path_params["model"])
        return JSONResponse(card())

    async def completions(request: Request) -> Response:
        body = _object(await ctx.read_json(request))
        check_known(body, _COMMON | {"prompt"}, _COMPLETION_INERT)
        raw = body.get("prompt")
        if isinstance(raw, list) and raw and isinstance(raw[0], str | list):
            # before any prompt is read: a 220 KB body once asked for 2.5 million samples
            n = opt_int(body, "n", "n", 1, lo=1, hi=128)
            check_samples(len(raw), n, ctx.limits.max_samples, "prompt")
        prompts = _prompts(raw, ctx.limits.vocab_size)
        return await _respond(ctx, request, body, prompts, chat=False, default_max=16)

    async def chat(request: Request) -> Response:
        body = _object(await ctx.read_json(request))
        check_known(body, _COMMON | {"messages", "max_completion_tokens"}, _CHAT_INERT)
        if body.get("max_completion_tokens") is not None:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        prompt = render_chat(ctx, body.get("messages"))
        return await _respond(ctx, request, body, [prompt], chat=True, default_max=None)

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
    ]


def render_chat(ctx: ServeContext, messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages", "expected a non-empty list of messages")
    plain = []
    chars = 0
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ConfigError(f"messages[{i}]", "expected an object with a role")
        content = msg.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ConfigError(f"messages[{i}].content[{j}]", "only text parts are served")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ConfigError(f"messages[{i}].content", "expected a string or text parts")
        check_text(msg["role"], f"messages[{i}].role")
        check_text(content, f"messages[{i}].content")
        chars += len(content) + len(msg["role"])
        if chars > ctx.limits.max_prompt_chars:  # before rendering: it cannot fit anyway
            raise ConfigError("messages", f"over {ctx.limits.max_prompt_chars} characters "
                              f"cannot fit the engine's {ctx.limits.max_len} tokens")  # fmt: skip
        plain.append({"role": msg["role"], "content": content})
    tokenizer = ctx.backend.tokenizer
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        return str(text)
    return "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ConfigError("body", "expected a JSON object")
    return body


def _prompts(prompt: Any, vocab_size: int) -> list[str | tuple[int, ...]]:
    if isinstance(prompt, str):
        check_text(prompt, "prompt", allow_empty=False)
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            for i, p in enumerate(prompt):
                check_text(p, f"prompt[{i}]", allow_empty=False)
            return list(prompt)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [token_ids(prompt, "prompt", vocab_size)]
        if all(isinstance(p, list) for p in prompt):
            return [token_ids(p, f"prompt[{i}]", vocab_size) for i, p in enumerate(prompt)]
    raise ConfigError("prompt", "expected a string, a list of strings, or token id list(s)")


def _no_model(name: str) -> Response:
    body = error_body(f"The model '{name}' does not exist", "model", 404)
    body["error"]["code"] = "model_not_found"
    return JSONResponse(body, status_code=404)


async def _respond(
    ctx: ServeContext,
    request: Request,
    body: dict[str, Any],
    prompts: list[str | tuple[int, ...]],
    *,
    chat: bool,
    default_max: int | None,
) -> Response:
    name = body.get("model")
    if not isinstance(name, str):
        raise ConfigError("model", "expected the model's name")
    if name not in (ctx.model_name, "default"):
        return _no_model(name)
    limits = ctx.limits
    n = opt_int(body, "n", "n", 1, lo=1, hi=128)
    _check_prompts(prompts, n, limits)
    sampling = _sampling(body, limits, default_max)
    stream = opt_bool(body, "stream", "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ConfigError("stream_options", "expected an object")
    usage_chunk = opt_bool(options, "include_usage", "stream_options.include_usage", False)
    tokens = n * demand(prompts, [sampling.max_tokens] * len(prompts), limits.max_len)
    release = ctx.admission.hold(len(prompts) * n, tokens, "max_tokens")  # before building
    live_id = f"openai/{uuid.uuid4().hex}"  # one prefix abort stops all its samples
    try:
        requests = [
            GenerateRequest(
                request_id=f"{live_id}/{i}/{j}",
                sampling=sample_sampling(sampling, j),
                prompt=p if isinstance(p, str) else None,
                prompt_ids=None if isinstance(p, str) else p,
            )
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
    except BaseException:
        release()
        raise
    head = {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        "created": int(time.time()),
        "model": name,
    }
    if stream:
        events = _events(ctx, requests, head, chat, usage_chunk, n)
        return BoundedStream(events, ctx.serve_limits, release, ctx.stream_stats)
    try:
        results = await ctx.until_disconnect(request, run_samples(ctx.backend, requests))
    finally:
        release()
    choices = [_choice(k, r.completions[0], chat) for k, r in enumerate(results)]
    usage = _usage(results, n)
    kind = "chat.completion" if chat else "text_completion"
    return JSONResponse({**head, "object": kind, "choices": choices, "usage": usage})


def _check_prompts(prompts: list[str | tuple[int, ...]], n: int, limits: Limits) -> None:
    check_samples(len(prompts), n, limits.max_samples, "n")
    for i, p in enumerate(prompts):
        if isinstance(p, str) and len(p) > limits.max_prompt_chars:
            raise ConfigError(f"prompt[{i}]", f"{len(p)} characters cannot fit the engine")
        if not isinstance(p, str) and len(p) >= limits.max_len:
            raise ConfigError(f"prompt[{i}]", f"{len(p)} tokens; the engine holds {limits.max_len}")


def _sampling(body: dict[str, Any], limits: Limits, default_max: int | None) -> SamplingParams:
    """The request's sampling parameters, every field checked (errors name it)."""
    max_tokens = opt_int(body, "max_tokens", "max_tokens", default_max, lo=0)
    stop_ids = body.get("stop_token_ids")
    return sampling_params(
        "",
        {},  # OpenAI's names are SamplingParams' own
        temperature=opt_float(body, "temperature", "temperature", 1.0),
        top_p=opt_float(body, "top_p", "top_p", 1.0),
        top_k=opt_int(body, "top_k", "top_k", -1),
        max_tokens=limits.max_len if max_tokens is None else max_tokens,
        stop=stop_strings(body.get("stop"), "stop"),
        stop_token_ids=() if stop_ids is None else token_ids(
            stop_ids, "stop_token_ids", limits.vocab_size, allow_empty=True),
        seed=opt_int(body, "seed", "seed", None, lo=-(2**63), hi=2**63 - 1),
        min_tokens=opt_int(body, "min_tokens", "min_tokens", 0, lo=0),
        ignore_eos=opt_bool(body, "ignore_eos", "ignore_eos", False),
    )  # fmt: skip


def _choice(index: int, c: Completion, chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index}
    if chat:
        out["message"] = {"role": "assistant", "content": c.text}
    else:
        out["text"] = c.text
    out.update(logprobs=None, finish_reason=_REASON[c.finish_reason])
    out["matched_stop"] = c.matched_stop
    return out


def _usage(results: list[GenerateResult], n: int) -> dict[str, int]:
    prompt = sum(r.prompt_tokens for r in results[::n])  # each prompt counted once
    completion = sum(r.completions[0].num_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


async def _events(
    ctx: ServeContext,
    requests: list[GenerateRequest],
    head: dict[str, Any],
    chat: bool,
    usage_chunk: bool,
    n: int,
) -> AsyncIterator[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    sent: dict[int, int] = {}
    finals: dict[int, GenerateResult] = {}
    try:
        async for up in merge_updates(ctx.backend, requests):
            delta = up.text[sent.get(up.index, 0) :]
            choice: dict[str, Any] = {"index": up.index}
            if chat:
                first = up.index not in sent
                choice["delta"] = {"role": "assistant", "content": delta} if first else {
                    "content": delta}  # fmt: skip
            else:
                choice["text"] = delta
            sent[up.index] = len(up.text)
            choice["logprobs"] = None
            choice["finish_reason"] = None
            if up.result is not None:
                finals[up.index] = up.result
                choice["finish_reason"] = _REASON[up.result.completions[0].finish_reason]
            yield sse({**head, "object": kind, "choices": [choice]})
        if usage_chunk:
            done = [finals[i] for i in sorted(finals)]
            yield sse({**head, "object": kind, "choices": [], "usage": _usage(done, n)})
    except ConfigError as exc:
        yield sse(error_body(str(exc), exc.field))
    except ValueError as exc:
        yield sse(error_body(str(exc)))
    yield b"data: [DONE]\n\n"
