"""The worker pool every HTTP backend sends through (SGLang, OpenAI-compatible, plug-ins).

One ``EndpointPool`` owns an ``httpx.AsyncClient`` and a list of worker URLs. Every call
goes through ``EndpointPool.send``, which:

- routes by a *routing key* (the query segment of a hierarchical request id) so that all
  requests of one query land on one worker and reuse its prefix (radix) cache;
- fails over to another healthy worker when that one is down, and remembers the new home;
- retries, with jittered exponential backoff and a bounded number of attempts, only what is
  safe to retry: a refused/unsent connection, 502/503/504, and a connection lost before any
  byte of the response arrived (the server saw no complete request, or says it did nothing);
  for a request the server keeps no state of (``call(resend_cut=True)``), also a reply the
  connection cut after it opened, once. This loop is the only retry layer: backends hand
  it their reply readers (``call``) instead of resending themselves;
- gives each request a deadline: the worker's learned seconds per output token times the
  request's token budget (read by the backend's ``WireProtocol``), times a slack, plus a floor,
  under a cap; a request that misses it gives up on that worker and is sent to another
  healthy one (never again to the one that may still be running it);
- keeps a circuit breaker per worker (open after k consecutive failures or missed deadlines,
  half-open after a cooldown, one probe at a time) and a concurrency limit per worker; a
  worker whose breaker opens on missed deadlines (stopped, not dead) releases every request
  waiting on it at once; open breakers are probed on a timer (``GET /health``), so a worker
  comes back without waiting for new traffic;
- sends ``Authorization: Bearer <api_key>`` on every request when a key is configured;
- raises one ``BackendError`` naming the URL(s) when every attempt failed
  (``BackendTimeoutError`` when the last one missed its deadline).

Sleep, clock and randomness are injectable so tests run without real waiting.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from spec_tot.errors import BackendError, BackendTimeoutError, ConfigError

from .attempts import (
    RETRYABLE_STATUS,
    Tries,
    TryAgain,
    backoff,
    decode_json,
    default_client,
    miss_reason,
    open_once,
)
from .breaker import CircuitBreaker
from .config import HttpConfig
from .endpoint import Endpoint
from .probing import HealthProber
from .protocol import WireProtocol
from .queues import QueueReports
from .routing import StickyRoutes

__all__ = ["RETRYABLE_STATUS", "EndpointPool"]

T = TypeVar("T")
OnAttempt = Callable[[str], None] | None

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]


@dataclass
class EndpointPool:
    """The workers one backend talks to. ``protocol`` (required, so that no backend's pool
    falls back to the deadline floor unnoticed) reads its bodies' token budgets and its
    replies' output tokens: the module docstring says what the pool does with them."""

    urls: list[str]
    config: HttpConfig = field(default_factory=HttpConfig)
    client: httpx.AsyncClient | None = None
    protocol: WireProtocol = field(kw_only=True)
    sleep: Sleep = asyncio.sleep
    clock: Clock = time.monotonic
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigError("urls", "give at least one server URL")
        self.urls = [u.rstrip("/") for u in self.urls]
        if len(set(self.urls)) != len(self.urls):
            raise ConfigError("urls", "duplicate server URL")
        c = self.config
        self.endpoints = {
            u: Endpoint(
                u,
                CircuitBreaker(c.breaker_threshold, c.breaker_cooldown_s, self.clock),
                asyncio.Semaphore(c.max_concurrency),
            )
            for u in self.urls
        }
        self.routes = StickyRoutes(self.urls, self.endpoints, self.config.affinity_size)
        self._headers = (
            {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        )
        self._owns_client = self.client is None
        if self.client is None:
            self.client = default_client(self.config)
        self.prober = HealthProber(
            self.endpoints,
            self.client,
            health_path=self.config.health_path,
            cooldown_s=self.config.breaker_cooldown_s,
            timeout_s=self.config.probe_timeout_s,
            headers=self._headers,
            sleep=self.sleep,
            clock=self.clock,
            stall_s=self.config.stall_s,
        )
        self.queues = QueueReports(
            self.endpoints, self.client, (self.config.metrics_path, self.config.loads_path),
            self.config.queue_poll_s,
            timeout_s=self.config.probe_timeout_s, headers=self._headers,
        )  # fmt: skip

    @property
    def http(self) -> httpx.AsyncClient:
        assert self.client is not None
        return self.client

    def reported_load(self) -> float | None:
        """The workers' published queues summed (``queues.py``), None while none is known."""
        return self.queues.reported_load()

    def follow_load(self) -> None:
        """Read the queues all along, idle too (a backend's ``reported_load``)."""
        self.queues.follow()

    def home_of(self, key: str) -> str | None:
        """The worker that ``key``'s requests go to now, if it has one."""
        return self.routes.home_of(key)

    async def aclose(self) -> None:
        await self.queues.aclose()
        await self.prober.aclose()
        if self._owns_client and self.client is not None:
            await self.client.aclose()

    # -- deadlines and health ------------------------------------------------------------------
    def deadline_s(self, endpoint: Endpoint, budget: int | None) -> float:
        """Seconds a request with ``budget`` output tokens may take on ``endpoint``: its
        budget at the worker's learned speed, or, when longer, the work ahead of it (the
        requests in flight there, ``Endpoint.tokens_ahead``) and its own at the worker's
        learned throughput; times the slack, plus the floor, under the cap. A queue is not
        a failure: 64 requests in flight on one worker each get the time the queue takes."""
        c = self.config
        if not budget:
            return c.deadline_floor_s
        seconds = endpoint.seconds_for(budget, c.assumed_s_per_token)
        return min(c.deadline_cap_s, c.deadline_floor_s + c.deadline_slack * seconds)

    def observe(self, url: str, tokens: float, seconds: float) -> None:
        """Teach the pool a worker's speed from a finished generation (a streamed reply's)."""
        endpoint = self.endpoints.get(url.rstrip("/"))
        if endpoint is not None and tokens > 0 and seconds >= 0:
            endpoint.observe(tokens, seconds, self.config.speed_weight, endpoint.inflight)

    # -- sending: the one retry layer ------------------------------------------------------------
    @asynccontextmanager
    async def send(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        key: str | None = None,
        only: str | None = None,
        on_attempt: OnAttempt = None,
        budget: int | None = None,
    ) -> AsyncIterator[tuple[Endpoint, httpx.Response]]:
        """Open a response (headers read, body not yet) on the best worker, retrying what is
        safe. ``only`` pins one worker (no failover), e.g. to abort where a request runs;
        ``on_attempt`` is told each worker tried; ``budget`` (output tokens) sizes the
        deadline, read from the body when not given. The deadline covers the caller's block
        too (reading the body): past it the block is cancelled and ``BackendTimeoutError``
        raised. The response is closed, and the worker's slot released, when the block exits.
        Once the block has the response nothing is sent again (``call`` can)."""
        budget = budget if budget is not None else self.protocol.request_budget(body)
        tries = Tries(path)
        async with aclosing(self._tries(tries, key, only, on_attempt)) as endpoints:
            async for endpoint in endpoints:
                try:
                    async with self._on(endpoint, method, path, body, budget) as response:
                        yield endpoint, response
                    return
                except TryAgain as again:
                    tries.failed(endpoint, again)

    async def call(
        self,
        method: str,
        path: str,
        body: Any,
        consume: Callable[[Endpoint, httpx.Response], Awaitable[T]],
        *,
        resend_cut: bool = False,
        key: str | None = None,
        only: str | None = None,
        on_attempt: OnAttempt = None,
        budget: int | None = None,
    ) -> T:
        """``send``, and ``consume(endpoint, response)`` the reply under the same deadline.
        ``resend_cut`` (a request the server keeps no state of: sampling): a reply the
        connection cut after it opened (a worker that died under it) is sent once more, as
        one more attempt of the same loop; ``consume`` starts over on the new reply."""
        budget = budget if budget is not None else self.protocol.request_budget(body)
        tries = Tries(path, cuts=int(resend_cut))
        async with aclosing(self._tries(tries, key, only, on_attempt)) as endpoints:
            async for endpoint in endpoints:
                try:
                    async with self._on(endpoint, method, path, body, budget) as response:
                        try:
                            return await consume(endpoint, response)
                        except (httpx.TransportError, BackendError) as exc:
                            again = tries.cut(exc)
                            if again is not None:
                                raise again from exc
                            if isinstance(exc, BackendError):
                                raise
                            where = endpoint.url + path
                            raise BackendError(where, f"reply cut short: {exc!r}") from exc
                except TryAgain as again:
                    tries.failed(endpoint, again)
        raise AssertionError("unreachable: _tries raises when it gives up")

    def _tries(
        self, tries: Tries, key: str | None, only: str | None, on_attempt: OnAttempt
    ) -> AsyncIterator[Endpoint]:
        """The worker of each attempt (``Tries.workers``): routed, claimed, announced."""

        def pick() -> Endpoint | None:
            endpoint = self.routes.pick(key, only, tries.missed, tries.errors)
            if endpoint is not None and on_attempt is not None:
                on_attempt(endpoint.url)  # the caller must know where to abort, before any reply
            return endpoint

        async def pause(attempt: int) -> None:
            await self.sleep(backoff(self.config, self.rng, attempt))

        return tries.workers(self.config.max_retries, pause, self.urls, only, pick)

    @asynccontextmanager
    async def _on(
        self, endpoint: Endpoint, method: str, path: str, body: Any, budget: int | None
    ) -> AsyncIterator[httpx.Response]:
        """One attempt on ``endpoint`` under its deadline; ``TryAgain`` when another may
        follow (a retryable failure, or a deadline missed before the caller had the reply)."""
        loop, where = asyncio.get_running_loop(), endpoint.url + path
        async with endpoint.semaphore:
            started = loop.time()
            limit = self.deadline_s(endpoint, budget)
            timer = asyncio.timeout_at(started + limit)
            endpoint.begin(timer, started + limit, budget or 0, self.clock())
            self.queues.watch()
            self.prober.watch_stalls()
            opened = False
            try:
                try:
                    async with timer:
                        response = await self._open(endpoint, method, path, body)
                        opened = True
                        try:
                            yield response
                        finally:
                            await response.aclose()
                except TimeoutError:
                    if not timer.expired():
                        raise  # not our deadline: the caller's own TimeoutError
                    raise TryAgain(f"no answer within its {limit:.1f} s deadline", True) from None
                endpoint.progressed(self.clock())
                done = self.protocol.tokens_of(response) if budget else 0
                if done:
                    self.observe(endpoint.url, done, loop.time() - started)
            except TryAgain as again:
                if not again.missed:
                    self.prober.failed(endpoint)
                    raise
                endpoint.disarm(timer)
                released, reason = miss_reason(again.reason, timer, started + limit, endpoint)
                self.prober.failed(endpoint, missed=not released)
                if opened:  # the caller had the response: it cannot be sent again here
                    raise BackendTimeoutError(where, reason) from None
                raise TryAgain(reason, missed=True) from None
            except BaseException:
                if not opened:
                    endpoint.breaker.abandon_probe()  # a cancelled probe frees the slot
                raise
            finally:
                endpoint.end(timer)

    async def _open(self, endpoint: Endpoint, method: str, path: str, body: Any) -> httpx.Response:
        where = endpoint.url + path
        request = self.http.build_request(method, where, json=body, headers=self._headers)
        response = await open_once(self.http, request)
        if response.status_code >= 400:
            text = (await response.aread()).decode(errors="replace")[:500]
            await response.aclose()
            if response.status_code >= 500:
                self.prober.failed(endpoint)
            else:
                endpoint.breaker.success()  # a 4xx is our fault, the worker is alive
            raise BackendError(where, f"HTTP {response.status_code}: {text}")
        endpoint.breaker.success()
        endpoint.progressed(self.clock())
        return response

    async def json(
        self, method: str, path: str, body: Any = None, **route: str | None
    ) -> tuple[str, Any]:
        """Send and decode a JSON body; returns (worker URL, value). ``route``: ``send``'s
        ``key`` and ``only``."""
        return await self.call(method, path, body, decode_json, **route)
