"""Server-sent events as the completion servers send them: ``data: {...}`` lines ending in
``data: [DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from spec_tot.errors import BackendError

__all__ = ["sse_events"]


async def sse_events(response: httpx.Response, where: str) -> AsyncIterator[dict[str, Any]]:
    """Decode ``data: {...}`` events until ``data: [DONE]``. A stream that ends without
    ``[DONE]`` was cut (server died, proxy dropped it): that is an error, not a short answer."""
    try:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments / keep-alives
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if isinstance(event, dict) and "error" in event:
                raise BackendError(where, f"server error in stream: {event['error']}")
            yield event
    except (httpx.HTTPError, ValueError) as exc:
        raise BackendError(where, f"stream broken: {exc!r}") from exc
    raise BackendError(where, "stream ended before [DONE]")
