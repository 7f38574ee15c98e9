"""Shared async HTTP machinery for the serving adapters (SGLang, OpenAI-compatible).

One ``EndpointPool`` owns an ``httpx.AsyncClient`` and a list of worker URLs. Every call
goes through ``EndpointPool.send``, which:

- routes by a *routing key* (the query segment of a hierarchical request id) so that all
  requests of one query land on one worker and reuse its prefix (radix) cache;
- fails over to another healthy worker when that one is down, and remembers the new home;
- retries, with jittered exponential backoff and a bounded number of attempts, only what is
  safe to retry: a refused/unsent connection, 502/503/504, and a connection lost before any
  byte of the response arrived (the server saw no complete request, or says it did nothing);
- keeps a circuit breaker per worker (open after k consecutive failures, half-open after a
  cooldown, one probe at a time) and a concurrency limit per worker;
- raises one ``BackendError`` naming the URL(s) when every attempt failed.

Sleep, clock and randomness are injectable so tests run without real waiting.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from spec_tot.errors import BackendError, BackendTimeoutError, ConfigError

__all__ = [
    "RETRYABLE_STATUS",
    "CircuitBreaker",
    "Endpoint",
    "EndpointPool",
    "HttpConfig",
    "query_key",
]

# 502/503/504: a proxy or an overloaded server that did not run the request.
RETRYABLE_STATUS = frozenset({502, 503, 504})

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]


def query_key(request_id: str) -> str:
    """The routing key of a hierarchical id ``query/node/...``: its first segment."""
    return request_id.split("/", 1)[0]


@dataclass(frozen=True, slots=True)
class HttpConfig:
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # long generations stream slowly; the caller sets deadlines
    max_retries: int = 3  # extra attempts after the first one
    backoff_base_s: float = 0.05
    backoff_max_s: float = 2.0
    breaker_threshold: int = 3  # consecutive failures that open a worker's breaker
    breaker_cooldown_s: float = 5.0
    max_concurrency: int = 512  # per worker; above it callers queue here, not in the server
    affinity_size: int = 65_536  # remembered query -> worker homes (LRU)

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ConfigError("max_retries", f"must be >= 0, got {self.max_retries}")
        if self.breaker_threshold < 1:
            raise ConfigError("breaker_threshold", "must be >= 1")
        if self.max_concurrency < 1:
            raise ConfigError("max_concurrency", "must be >= 1")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ConfigError("read_timeout_s", "timeouts must be > 0")


@dataclass
class CircuitBreaker:
    """closed -> (k consecutive failures) -> open -> (cooldown) -> half-open: one probe.
    The probe's success closes the breaker; its failure reopens it for another cooldown."""

    threshold: int
    cooldown_s: float
    clock: Clock
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.cooldown_s else "open"

    def available(self) -> bool:
        """May a request be sent now? (Does not claim the half-open probe.)"""
        state = self.state
        return state == "closed" or (state == "half_open" and not self.probing)

    def acquire(self) -> bool:
        """Claim the right to send; in half-open only one caller gets it (the probe)."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self.probing:
            self.probing = True
            return True
        return False

    def success(self) -> None:
        self.failures, self.opened_at, self.probing = 0, None, False

    def failure(self) -> None:
        self.failures += 1
        self.probing = False
        if self.opened_at is not None or self.failures >= self.threshold:
            self.opened_at = self.clock()


@dataclass
class Endpoint:
    url: str
    breaker: CircuitBreaker
    semaphore: asyncio.Semaphore
    inflight: int = 0
    attempts: int = 0  # every send attempt, for tests and stats

    def __repr__(self) -> str:
        return f"Endpoint({self.url!r}, {self.breaker.state}, inflight={self.inflight})"


class _Retryable(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class EndpointPool:
    urls: list[str]
    config: HttpConfig = field(default_factory=HttpConfig)
    client: httpx.AsyncClient | None = None
    sleep: Sleep = asyncio.sleep
    clock: Clock = time.monotonic
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigError("urls", "give at least one server URL")
        self.urls = [u.rstrip("/") for u in self.urls]
        if len(set(self.urls)) != len(self.urls):
            raise ConfigError("urls", "duplicate server URL")
        self.endpoints = {
            u: Endpoint(
                u,
                CircuitBreaker(
                    self.config.breaker_threshold, self.config.breaker_cooldown_s, self.clock
                ),
                asyncio.Semaphore(self.config.max_concurrency),
            )
            for u in self.urls
        }
        self._home: OrderedDict[str, str] = OrderedDict()
        self._homed: Counter[str] = Counter()
        self._owns_client = self.client is None
        if self.client is None:
            timeout = httpx.Timeout(
                self.config.read_timeout_s, connect=self.config.connect_timeout_s
            )
            # No keep-alive cap: many concurrent streams per worker is the normal case.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self.client = httpx.AsyncClient(timeout=timeout, limits=limits)

    @property
    def http(self) -> httpx.AsyncClient:
        assert self.client is not None
        return self.client

    async def aclose(self) -> None:
        if self._owns_client and self.client is not None:
            await self.client.aclose()

    # -- routing -------------------------------------------------------------------------------
    def candidates(self, key: str | None) -> list[Endpoint]:
        """Workers to try, best first: the key's home if healthy, then the least loaded."""
        healthy = [e for e in self.endpoints.values() if e.breaker.available()]
        # New queries go to the least busy worker, then the one homing fewest queries.
        healthy.sort(key=lambda e: (e.inflight, self._homed[e.url], self.urls.index(e.url)))
        home = self._home.get(key) if key is not None else None
        if home is not None:
            self._home.move_to_end(key)  # type: ignore[arg-type]
            first = [e for e in healthy if e.url == home]
            healthy = first + [e for e in healthy if e.url != home]
        return healthy

    def home_of(self, key: str) -> str | None:
        return self._home.get(key)

    def _settle(self, key: str | None, endpoint: Endpoint) -> None:
        if key is None:
            return
        old = self._home.get(key)
        if old != endpoint.url:
            if old is not None:
                self._homed[old] -= 1
            self._homed[endpoint.url] += 1
        self._home[key] = endpoint.url
        self._home.move_to_end(key)
        while len(self._home) > self.config.affinity_size:
            self._homed[self._home.popitem(last=False)[1]] -= 1

    def forget(self, key: str) -> None:
        old = self._home.pop(key, None)
        if old is not None:
            self._homed[old] -= 1

    def _backoff(self, attempt: int) -> float:
        delay = min(self.config.backoff_max_s, self.config.backoff_base_s * 2.0**attempt)
        return delay * (0.5 + 0.5 * self.rng.random())  # jitter spreads retry storms

    # -- sending -------------------------------------------------------------------------------
    @asynccontextmanager
    async def send(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        key: str | None = None,
        only: str | None = None,
        on_attempt: Callable[[str], None] | None = None,
    ) -> AsyncIterator[tuple[Endpoint, httpx.Response]]:
        """Open a response (headers read, body not yet) on the best worker, retrying what is
        safe. ``only`` pins one worker (no failover), e.g. to abort where a request runs;
        ``on_attempt`` is told each worker tried.
        The response is closed, and the worker's slot released, when the block exits."""
        errors: list[str] = []
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                await self.sleep(self._backoff(attempt - 1))
            if only is not None:
                pinned = self.endpoints.get(only.rstrip("/"))
                if pinned is None:
                    raise BackendError(only, "not a configured endpoint")
                pool = [pinned] if pinned.breaker.available() else []
            else:
                pool = self.candidates(key)
            endpoint = next((e for e in pool if e.breaker.acquire()), None)
            if endpoint is None:
                names = only or ", ".join(self.urls)
                errors.append(f"{names}: circuit open")
                continue
            endpoint.attempts += 1
            self._settle(key, endpoint)  # now, so a query's concurrent requests follow it
            if on_attempt is not None:
                on_attempt(endpoint.url)  # the caller must know where to abort, before any reply
            where = endpoint.url + path
            async with endpoint.semaphore:
                endpoint.inflight += 1
                try:
                    response = await self._open(endpoint, method, path, body)
                except _Retryable as exc:
                    endpoint.inflight -= 1
                    endpoint.breaker.failure()
                    errors.append(f"{where}: {exc.reason}")
                    continue
                except BaseException:
                    endpoint.inflight -= 1
                    endpoint.breaker.probing = False  # a cancelled probe frees the slot
                    raise
                try:
                    yield endpoint, response
                    return
                finally:
                    endpoint.inflight -= 1
                    await response.aclose()
        target = errors[-1].split(": ", 1)[0] if errors else ", ".join(self.urls)
        detail = "; ".join(errors)
        raise BackendError(target, f"failed after {len(errors)} attempt(s): {detail}")

    async def _open(self, endpoint: Endpoint, method: str, path: str, body: Any) -> httpx.Response:
        where = endpoint.url + path
        request = self.http.build_request(method, where, json=body)
        try:
            response = await self.http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise _Retryable(f"cannot connect ({type(exc).__name__})") from exc
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            # Lost before the status line: no byte of a response, safe to send again.
            raise _Retryable(f"connection lost before a response ({type(exc).__name__})") from exc
        except httpx.TimeoutException as exc:
            # The server may still be working on it; resending would duplicate the work.
            endpoint.breaker.failure()
            raise BackendTimeoutError(where, f"no response within the deadline ({exc!r})") from exc
        if response.status_code in RETRYABLE_STATUS:
            text = (await response.aread()).decode(errors="replace")[:200]
            await response.aclose()
            raise _Retryable(f"HTTP {response.status_code} {text}".strip())
        if response.status_code >= 400:
            text = (await response.aread()).decode(errors="replace")[:500]
            await response.aclose()
            if response.status_code >= 500:
                endpoint.breaker.failure()
            else:
                endpoint.breaker.success()  # a 4xx is our fault, the worker is alive
            raise BackendError(where, f"HTTP {response.status_code}: {text}")
        endpoint.breaker.success()
        return response

    async def json(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        key: str | None = None,
        only: str | None = None,
    ) -> tuple[str, Any]:
        """Send and decode a JSON body; returns (worker URL, value)."""
        async with self.send(method, path, body, key=key, only=only) as (endpoint, response):
            try:
                raw = await response.aread()
            except httpx.HTTPError as exc:
                raise BackendError(endpoint.url + path, f"response cut short: {exc!r}") from exc
            try:
                value = json.loads(raw) if raw else None
            except ValueError as exc:
                raise BackendError(endpoint.url + path, f"bad JSON: {raw[:200]!r}") from exc
            return endpoint.url, value
