"""Event streams that a client which stops reading cannot grow.

A stream writes SSE events into the connection's transport; once ``stream_buffer_bytes`` wait
unsent (the transport's high-water mark, set per stream) uvicorn's ``send`` blocks, so the
stream is paused: its samples keep running, and ``merge_updates`` keeps only the latest
(cumulative) update of each, so nothing piles up. A send blocked for ``stream_stall_s`` ends
the stream: its samples are aborted (their KV blocks freed), its in-flight count released
and its connection dropped with whatever it had not read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .connections import CONNECTION_KEY
from .limits import ServeLimits

__all__ = ["BoundedStream"]


class BoundedStream(StreamingResponse):
    """``text/event-stream`` of ``chunks``; ``release()`` runs once when it ends, however."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        limits: ServeLimits,
        release: Callable[[], None],
        stats: dict[str, float] | None = None,
    ) -> None:
        """``stats``: counts streams dropped for stalling (``stalled``) and the longest
        wait from a blocked send to the drop (``max_stall_to_abort_s``)."""
        super().__init__(chunks, media_type="text/event-stream")
        self.limits = limits
        self.release = release
        self.stats = stats
        self.stalled: float | None = None  # seconds the last send was blocked

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        loop = asyncio.get_running_loop()
        async for chunk in self.body_iterator:
            started = loop.time()
            try:
                async with asyncio.timeout(self.limits.stream_stall_s):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except TimeoutError:
                self.stalled = loop.time() - started  # the client read nothing meanwhile
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        conn = (scope.get("extensions") or {}).get(CONNECTION_KEY)
        if conn is not None:
            conn.set_write_limit(self.limits.stream_buffer_bytes)
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()  # aborts every sample still running
            self.release()
            if self.stalled is not None:
                if conn is not None:
                    conn.abort()
                    await asyncio.sleep(0)  # let connection_lost land before uvicorn looks
                if self.stats is not None:
                    self.stats["stalled"] += 1
                    longest = max(self.stats["max_stall_to_abort_s"], self.stalled)
                    self.stats["max_stall_to_abort_s"] = round(longest, 3)
