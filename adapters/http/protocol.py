"""The seam between the shared pool and a backend's wire protocol: the two facts a deadline
needs, which only the backend can read from its own bodies."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["WireProtocol", "positive_int"]


def _no_budget(body: Any) -> int | None:
    return None


def _no_tokens(reply: Any) -> float | None:
    return None


def positive_int(value: Any) -> int | None:
    """``value`` when it is an int > 0 (never a bool), else None: what a budget field holds."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


@dataclass(frozen=True, slots=True)
class WireProtocol:
    """What the pool asks of a backend's protocol (the default knows nothing: every request
    gets the deadline floor and no speed is learned).

    - ``request_budget(body)``: the most output tokens the JSON request ``body`` (as given
      to ``EndpointPool.send``: None for a request without one) asks for, or None for a
      request that generates nothing (scoring, abort). The deadline is sized from it.
    - ``reply_tokens(reply)``: output tokens per sample in a decoded JSON reply, or None
      when it does not say; asked only of a request with a budget. With the time the
      request took, it teaches the pool the worker's speed. A streamed reply is never
      decoded here: its reader reports it with ``EndpointPool.observe``.
    """

    request_budget: Callable[[Any], int | None] = _no_budget
    reply_tokens: Callable[[Any], float | None] = _no_tokens

    def tokens_of(self, response: httpx.Response) -> float | None:
        """``reply_tokens`` of a response whose body was read; None for a streamed one or a
        body that is not JSON."""
        try:
            raw = response.content
        except httpx.ResponseNotRead:
            return None  # streamed: the caller may report it with EndpointPool.observe
        try:
            value = json.loads(raw) if raw else None
        except ValueError:
            return None
        return self.reply_tokens(value)
