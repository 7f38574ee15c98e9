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
        self, chunks: AsyncIterator[bytes], limits: ServeLimits, release: Callable[[], None]
    ) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self.limits = limits
        self.release = release
        self.stalled = False

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        async for chunk in self.body_iterator:
            try:
                async with asyncio.timeout(self.limits.stream_stall_s):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except TimeoutError:
                self.stalled = True  # the client has read nothing for stream_stall_s
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
            if self.stalled and conn is not None:
                conn.abort()
                await asyncio.sleep(0)  # let connection_lost land before uvicorn looks
