"""One request's attempts on the pool's workers: what ends an attempt (``TryAgain``), the
record of a request's attempts (``Tries``), one send and its failures sorted into the safe
to retry and the not (``open_once``), and the errors and backoff of the pool's one retry
loop (``pool.py``)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from spec_tot.errors import BackendError, BackendTimeoutError

from .config import HttpConfig
from .endpoint import Endpoint

__all__ = [
    "RETRYABLE_STATUS",
    "Tries",
    "TryAgain",
    "backoff",
    "decode_json",
    "default_client",
    "gave_up",
    "miss_reason",
    "open_once",
]

# 502/503/504: a proxy or an overloaded server that did not run the request.
RETRYABLE_STATUS = frozenset({502, 503, 504})


class TryAgain(Exception):
    """An attempt ended before the caller had a reply: another worker (or this one, after
    a backoff) may be tried. ``missed``: the worker gave no (complete) answer in time and
    may still be working on it (never resent there)."""

    def __init__(self, reason: str, missed: bool) -> None:
        super().__init__(reason)
        self.reason, self.missed = reason, missed


async def open_once(http: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """Send ``request`` (the reply's headers read, its body not): ``TryAgain`` for what is
    safe to send again (refused, lost before any byte, 502/503/504) or was missed (a read
    timeout: resent only elsewhere); any other reply, an error status included, is returned."""
    try:
        response = await http.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise TryAgain(f"cannot connect ({type(exc).__name__})", False) from exc
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        # Lost before the status line: no byte of a response, safe to send again.
        why = f"connection lost before a response ({type(exc).__name__})"
        raise TryAgain(why, False) from exc
    except httpx.TimeoutException as exc:
        # The server may still be working on it: resend only to another worker.
        why = f"no response within the read timeout ({type(exc).__name__})"
        raise TryAgain(why, True) from exc
    if response.status_code in RETRYABLE_STATUS:
        text = (await response.aread()).decode(errors="replace")[:200]
        await response.aclose()
        raise TryAgain(f"HTTP {response.status_code} {text}".strip(), False)
    return response


async def decode_json(endpoint: Endpoint, response: httpx.Response) -> tuple[str, Any]:
    """A reply's JSON body: (worker URL, value)."""
    where = endpoint.url + response.request.url.path
    try:
        raw = await response.aread()
    except httpx.HTTPError as exc:
        raise BackendError(where, f"response cut short: {exc!r}") from exc
    try:
        value = json.loads(raw) if raw else None
    except ValueError as exc:
        raise BackendError(where, f"bad JSON: {raw[:200]!r}") from exc
    return endpoint.url, value


@dataclass
class Tries:
    """One request's attempts: what each failed with, the workers that may still run it
    (``missed``: never sent it again), the cut replies it may still resend (``cuts``) and
    those it did (``resent``: attempts on top of the retries)."""

    path: str
    cuts: int = 0
    resent: int = 0
    errors: list[str] = field(default_factory=list)
    missed: set[str] = field(default_factory=set)

    def failed(self, endpoint: Endpoint, again: TryAgain) -> None:
        if again.missed:
            self.missed.add(endpoint.url)
        self.errors.append(f"{endpoint.url + self.path}: {again.reason}")

    async def workers(
        self,
        retries: int,
        pause: Callable[[int], Awaitable[None]],
        urls: list[str],
        only: str | None,
        pick: Callable[[], Endpoint | None],
    ) -> AsyncIterator[Endpoint]:
        """The worker of each attempt (``pick``; None: none now), ``pause``-d between them,
        until the caller stops asking or the attempts run out: ``retries`` after the first,
        plus one per resent cut reply; then the error naming every attempt. None is left
        once every worker (``only``'s one) may still be running it."""
        attempt = -1
        while (attempt := attempt + 1) < retries + 1 + self.resent:
            if self.missed and all(
                u in self.missed for u in ([only.rstrip("/")] if only else urls)
            ):
                break  # no worker left that has not let this request's deadline pass
            if attempt:
                await pause(attempt - 1)
            endpoint = pick()
            if endpoint is not None:
                yield endpoint
        raise gave_up(self.errors, self.missed, urls)

    def cut(self, exc: BaseException) -> TryAgain | None:
        """One more attempt for a failure while consuming an opened reply, when the
        connection cut it and a resend is left; else None (the failure stands)."""
        cause = exc if isinstance(exc, httpx.TransportError) else exc.__cause__
        if isinstance(cause, httpx.TransportError) and self.cuts > 0:
            self.cuts -= 1
            self.resent += 1
            return TryAgain(f"reply cut by the connection ({type(cause).__name__})", False)
        return None


def miss_reason(
    reason: str, timer: asyncio.Timeout, deadline: float, endpoint: Endpoint
) -> tuple[bool, str]:
    """Why an attempt ended without an answer: ``released`` (the worker was found stopped
    and cut the deadline short: what was seen), else ``reason`` (its deadline passed, or
    the worker missed it)."""
    released = timer.expired() and (timer.when() or 0.0) < deadline
    if released:
        seen = endpoint.stopped_reason or "the worker stopped answering (its breaker opened)"
        return True, f"released: {seen}"
    return False, reason


def gave_up(errors: list[str], missed: set[str], urls: list[str]) -> BackendError:
    """The error of a request no attempt answered (a timeout if a worker may run it)."""
    target = errors[-1].split(": ", 1)[0] if errors else ", ".join(urls)
    kind = BackendTimeoutError if missed else BackendError
    return kind(target, f"failed after {len(errors)} attempt(s): {'; '.join(errors)}")


def default_client(config: HttpConfig) -> httpx.AsyncClient:
    timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
    # No connection cap: many concurrent streams per worker is the normal case. No
    # keep-alive: httpcore 1.0.9 hands one idle connection to every request of a
    # burst that enters its pool together, and all but one then open new connections
    # one after another (encode/httpcore#1110-#1111, fixed in pydantic/httpx2#1075),
    # so the executor's bursts reached the server as a trickle (Game of 24 over
    # spec-tot serve: 2-3x slower, the engine's merging of identical prompts lost).
    # A fresh connection per request costs one handshake, made in parallel.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


def backoff(config: HttpConfig, rng: random.Random, attempt: int) -> float:
    delay = min(config.backoff_max_s, config.backoff_base_s * 2.0**attempt)
    return delay * (0.5 + 0.5 * rng.random())  # jitter spreads retry storms
