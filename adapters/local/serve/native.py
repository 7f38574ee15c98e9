"""SGLang's native routes on the embedded engine (SGLang 0.5.23
``srt/entrypoints/http_server.py``): ``/generate`` (POST, PUT), ``/abort_request``,
``/health``, ``/health_generate``, ``/model_info`` and ``/get_model_info``, ``/server_info`` and
``/get_server_info``, ``/flush_cache``, ``/v1/loads``, ``/metrics`` and ``/classify``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from spec_tot.errors import ConfigError

from .classify import parse_classify, score_batch
from .context import BodyTimeout, BodyTooLarge, ClientGone, ServeContext
from .fields import check_known, opt_bool, opt_str
from .limits import ServerBusy, prompt_tokens
from .live import run_samples
from .outputs import error_body, merge_updates, sample_json, sse
from .schema import parse_generate
from .streams import BoundedStream

__all__ = ["guarded", "internal_error", "native_routes"]

_log = logging.getLogger("spec_tot.serve")


def native_routes(ctx: ServeContext) -> list[Route]:
    return NativeApi(ctx).routes()


class NativeApi:
    """SGLang's native routes over one server's context."""

    def __init__(self, ctx: ServeContext) -> None:
        self.ctx = ctx

    async def generate(self, request: Request) -> Response:
        body = await self.ctx.read_json(request)
        held: list[Callable[[], None]] = []

        def admit(samples: int, tokens: int) -> None:
            field = "sampling_params.max_new_tokens"
            held.append(self.ctx.admission.hold(samples, tokens, field))

        try:
            batch = parse_generate(body, self.ctx.limits, admit)
            engine_requests = self.ctx.live.claim(batch)
        except BaseException:
            for release in held:
                release()
            raise
        release = held[0]
        rids = [s.rid for s in batch.samples]
        if batch.stream:
            events = _stream(self.ctx, batch, engine_requests, rids)
            return BoundedStream(events, self.ctx.serve_limits, release, self.ctx.stream_stats)
        try:
            results = await self.ctx.until_disconnect(
                request, run_samples(self.ctx.backend, engine_requests)
            )
        finally:
            self.ctx.live.release(batch)
            release()
        decode = self.ctx.decode_token
        outs = [
            sample_json(rid, r.completions[0].text, r.completions[0].token_ids, r,
                        batch.logprobs, decode)
            for rid, r in zip(rids, results, strict=True)
        ]  # fmt: skip
        return JSONResponse(outs[0] if batch.single else outs)

    async def abort_request(self, request: Request) -> Response:
        body = await self.ctx.read_json(request)
        if not isinstance(body, dict):
            raise ConfigError("body", "expected a JSON object")
        check_known(body, {"rid", "abort_all", "abort_message"}, {})
        rid = opt_str(body, "rid", "rid") or ""
        if opt_bool(body, "abort_all", "abort_all", False):
            await self.ctx.live.abort_all()
        elif rid:
            await self.ctx.live.abort(rid)
        return Response(status_code=200)  # as SGLang: an rid that is not live is ignored

    async def health(self, _request: Request) -> Response:
        return Response(status_code=200)

    async def model_info(self, _request: Request) -> Response:
        return JSONResponse(self.ctx.model_info())

    async def server_info(self, _request: Request) -> Response:
        return JSONResponse(await self.ctx.server_info())

    async def flush_cache(self, _request: Request) -> Response:
        if await self.ctx.flush_prefix_cache():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(
            "Cache not flushed: requests are running or waiting.\n", status_code=400
        )

    async def loads(self, _request: Request) -> Response:
        return JSONResponse(
            {
                "timestamp": time.time(),
                "version": self.ctx.version,
                "loads": [await self.ctx.load()],
            }
        )

    async def metrics(self, _request: Request) -> Response:
        load = await self.ctx.load()
        lines = []
        for name, key in (
            ("sglang:num_running_reqs", "num_running_reqs"),
            ("sglang:num_queue_reqs", "num_waiting_reqs"),
            ("sglang:num_used_tokens", "num_used_tokens"),
            ("sglang:token_usage", "token_usage"),
        ):
            lines += [
                f"# TYPE {name} gauge",
                f'{name}{{model_name="{self.ctx.model_name}"}} {load[key]}',
            ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def classify(self, request: Request) -> Response:
        batch = parse_classify(
            await self.ctx.read_json(request),
            self.ctx.backend.reward,
            self.ctx.limits.max_samples,
        )
        tokens = sum(prompt_tokens(p) for p in batch.prompts)
        release = self.ctx.admission.hold(len(batch.prompts), tokens, batch.key)
        try:
            rows = await self.ctx.until_disconnect(request, score_batch(self.ctx.backend, batch))
        finally:
            release()
        return JSONResponse(rows[0] if batch.single else rows)

    def routes(self) -> list[Route]:
        return [
            Route("/generate", guarded(self.generate), methods=["POST", "PUT"]),
            Route("/abort_request", guarded(self.abort_request), methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
            Route("/v1/loads", self.loads, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/classify", guarded(self.classify), methods=["POST", "PUT"]),
        ]


def guarded(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A ``ValueError`` from the input (``ConfigError`` names its field) is a 400, a body
    over the size cap a 413, one too slow a 408, a server past an in-flight limit a 429 with
    ``Retry-After``; anything else is a server fault, answered as a JSON 500."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except ClientDisconnect:
            return Response(status_code=400)  # gone before its body arrived: nobody reads it
        except ClientGone:  # gone while its samples ran: a normal event, logged once
            _log.info("client disconnected during %s %s", request.method, request.url.path)
            return Response(status_code=499)  # nginx's "client closed request": unread
        except ServerBusy as exc:
            body = error_body(str(exc), exc.limit, 429)
            retry = {"Retry-After": str(exc.retry_after_s)}
            return JSONResponse(body, status_code=429, headers=retry)
        except BodyTooLarge as exc:  # the rest of the body is never read: close after
            body = error_body(str(exc), "body", 413)
            return JSONResponse(body, status_code=413, headers={"Connection": "close"})
        except BodyTimeout as exc:
            body = error_body(str(exc), "body", 408)
            return JSONResponse(body, status_code=408, headers={"Connection": "close"})
        except ConfigError as exc:
            return JSONResponse(error_body(str(exc), exc.field), status_code=400)
        except ValueError as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        except Exception as exc:
            return internal_error(exc)

    return run


def internal_error(exc: Exception) -> Response:
    """A server fault, never an input error (those are 4xx): logged, answered as a JSON 500
    that says what went wrong."""
    _log.exception("spec-tot serve: internal error")
    message = f"internal error: {type(exc).__name__}: {exc}"
    return JSONResponse(error_body(message, None, 500), status_code=500)


async def _stream(
    ctx: ServeContext, batch: Any, requests: list[Any], rids: list[str]
) -> AsyncIterator[bytes]:
    """One cumulative event per update of each sample (``index`` for a batch), then
    ``[DONE]``; an error mid-stream is one ``{"error": ...}`` event, as SGLang sends."""
    last: dict[int, int] = {}
    interval = [s.stream_interval for s in batch.samples]
    try:
        async for up in merge_updates(ctx.backend, requests):
            if up.result is None and len(up.token_ids) - last.get(up.index, 0) < interval[up.index]:
                continue
            last[up.index] = len(up.token_ids)
            out = sample_json(
                rids[up.index], up.text, up.token_ids, up.result, batch.logprobs, ctx.decode_token
            )
            if not batch.single:
                out["index"] = up.index
            yield sse(out)
    except ConfigError as exc:
        yield sse(error_body(str(exc), exc.field))
    except ValueError as exc:
        yield sse(error_body(str(exc)))
    except asyncio.CancelledError:
        raise
    finally:
        ctx.live.release(batch)
    yield b"data: [DONE]\n\n"
