"""What every route of ``spec-tot serve`` shares: the backend, the live requests, the engine's
limits, and the model and server descriptions."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from spec_tot.errors import ConfigError

from ..backend import LocalBackend
from .limits import Admission, ServeLimits
from .live import LiveRequests
from .schema import Limits

__all__ = ["BodyTimeout", "BodyTooLarge", "ClientGone", "ServeContext"]

T = TypeVar("T")


class BodyTooLarge(ValueError):
    """Over ``max_body_bytes``: a 413."""


class BodyTimeout(ValueError):
    """The body did not arrive within ``body_timeout_s``: a 408."""


class ClientGone(Exception):
    """The client went away while its work ran (its samples were aborted): nobody reads an
    answer, and it is not a server error."""


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (ignoring anything but ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ServeContext:
    def __init__(
        self,
        backend: LocalBackend,
        model_path: str,
        model_name: str,
        serve_limits: ServeLimits | None = None,
    ) -> None:
        self.backend = backend
        self.serve_limits = serve_limits or ServeLimits()
        self.admission = Admission(self.serve_limits)
        self.connections: Any = None  # the ConnectionGuard, once server_config serves this
        self.stream_stats: dict[str, float] = {"stalled": 0, "max_stall_to_abort_s": 0.0}
        self.live = LiveRequests(backend)
        self.model_path = model_path
        self.model_name = model_name
        self.version = "spec-tot-serve (SGLang 0.5.23 native API)"

    @functools.cached_property
    def limits(self) -> Limits:
        """What a request may ask, from the engine's own limits (read once it has started:
        the server's startup starts it)."""
        policy = self.backend.policy
        cap = self.serve_limits.max_samples_per_request
        if policy is None:
            return Limits(vocab_size=0, max_len=0, max_prompt_chars=0, max_samples=cap)
        return Limits(
            vocab_size=policy.vocab_size,
            max_len=policy.max_len,
            # the engine's own bound: its longest token's characters per position
            max_prompt_chars=policy.max_prompt_chars,
            max_samples=cap,
        )

    async def read_json(self, request: Request) -> Any:
        """The body as JSON; a bad body is a ``ConfigError``. The body is refused past
        ``max_body_bytes`` (``BodyTooLarge``), or not whole within ``body_timeout_s``
        (``BodyTimeout``); while it is read and parsed its bytes count against the server's
        ``max_buffered_body_bytes`` (``ServerBusy`` past it)."""
        limits = self.serve_limits
        cap = limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise BodyTooLarge(f"body: {declared} bytes; this server's max_body_bytes is {cap}")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                async for chunk in request.stream():
                    if size + len(chunk) > cap:
                        raise BodyTooLarge(f"body: over {cap} bytes (max_body_bytes)")
                    self.admission.take_body(len(chunk))
                    size += len(chunk)
                    chunks.append(chunk)
            raw = b"".join(chunks)
            chunks.clear()
            if not raw.strip():
                raise ConfigError("body", "expected a JSON object, got an empty body")
            try:
                return json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise ConfigError("body", f"not valid JSON ({exc})") from None
        except TimeoutError:
            raise BodyTimeout(
                f"body: not received within {limits.body_timeout_s} s (body_timeout_s)"
            ) from None
        finally:
            self.admission.give_body(size)

    def decode_token(self, token_id: int) -> str:
        tokenizer = self.backend.tokenizer
        return str(tokenizer.decode([token_id])) if tokenizer is not None else ""

    # -- running ---------------------------------------------------------------------------
    async def until_disconnect(self, request: Request, work: Awaitable[T]) -> T:
        """Await ``work``; a client that goes away cancels it (and so aborts its samples)
        and raises ``ClientGone``.

        The body has been read, so the server's next message is ``http.disconnect``: one
        waiter per request, no polling (a timer per request woke the event loop hundreds of
        times a second under load, and each wake-up waits for the GIL the engine holds)."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise ClientGone(request.url.path)
        finally:
            for pending in (task, gone):
                if not pending.done():
                    pending.cancel()
            await asyncio.gather(task, gone, return_exceptions=True)

    async def flush_prefix_cache(self) -> bool:
        return await self.backend.flush_prefix_cache()

    # -- descriptions ----------------------------------------------------------------------
    async def load(self) -> dict[str, Any]:
        """SGLang's ``/v1/loads`` core row (``load_snapshot.py`` ``LoadSnapshot``), as the
        engine stands now: ``flush()`` waits for the engine thread to handle every command
        sent before it (the aborts of clients that just went away included) and refreshes
        its figures, which otherwise change only when a step runs."""
        await self.backend.flush()
        stats = self.backend.stats()
        total_blocks = stats.get("num_total_blocks", 0.0)
        used_blocks = total_blocks - stats.get("num_free_blocks", 0.0)
        block = self.backend.capabilities.extra.get("block_size", 0.0)
        caps = self.backend.capabilities
        return {
            "dp_rank": 0,
            "num_running_reqs": int(stats.get("num_running", 0)),
            "num_waiting_reqs": int(stats.get("num_waiting", 0)),
            "num_used_tokens": int(used_blocks * block),
            "max_total_num_tokens": int(total_blocks * block),
            "max_running_requests": caps.max_running_requests,
            "token_usage": round(used_blocks / total_blocks, 6) if total_blocks else 0.0,
            "kv_blocks_total": int(total_blocks),
            "kv_blocks_used": int(used_blocks),
            "kv_blocks_free": int(stats.get("num_free_blocks", 0)),
        }

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "served_model_name": self.model_name,
            "tokenizer_path": self.model_path,
            "is_generation": self.backend.policy is not None,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": None,
            "architectures": None,
        }

    async def server_info(self) -> dict[str, Any]:
        caps = self.backend.capabilities
        load = await self.load()
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.model_name,
            "context_length": self.limits.max_len,
            "max_running_requests": caps.max_running_requests,
            "max_total_num_tokens": load["max_total_num_tokens"],
            "max_req_input_len": max(0, self.limits.max_len - 1),
            "enable_priority_scheduling": True,
            "schedule_low_priority_values_first": True,
            "stream_output": False,
            "is_embedding": self.backend.policy is None,
            "engine_dedup": caps.engine_dedup,
            "saturation_batch": caps.saturation_batch,
            "internal_states": [load],
            "serve_limits": dataclasses.asdict(self.serve_limits),
            "in_flight": {
                "samples": self.admission.samples,
                "tokens": self.admission.tokens,
                "body_bytes": self.admission.body_bytes,
            },
            "streams": dict(self.stream_stats),
            "connections": None
            if self.connections is None
            else {
                "open": self.connections.open,
                "cap": self.connections.cap,
                **self.connections.counts,
            },
            **{k: load[k] for k in ("num_running_reqs", "num_waiting_reqs", "token_usage")},
            **{k: load[k] for k in ("kv_blocks_total", "kv_blocks_used", "kv_blocks_free")},
            "version": self.version,
        }
