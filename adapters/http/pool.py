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
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from spec_tot.errors import BackendError, BackendTimeoutError, ConfigError

from .breaker import CircuitBreaker
from .config import HttpConfig
from .endpoint import Endpoint
from .probing import HealthProber
from .protocol import WireProtocol
from .queues import QueueReports
from .routing import StickyRoutes

__all__ = ["RETRYABLE_STATUS", "EndpointPool"]

# 502/503/504: a proxy or an overloaded server that did not run the request.
RETRYABLE_STATUS = frozenset({502, 503, 504})
T = TypeVar("T")

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]


class _TryAgain(Exception):
    """An attempt ended before the caller had a reply: another worker (or this one, after
    a backoff) may be tried. ``missed``: the worker gave no (complete) answer in time and
    may still be working on it (never resent there)."""

    def __init__(self, reason: str, missed: bool) -> None:
        super().__init__(reason)
        self.reason, self.missed = reason, missed


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
            self.client = _default_client(self.config)
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
        """Running + waiting requests the workers last published (every client's), summed;
        None while none is known. ``follow_load`` keeps it fresh while idle too."""
        return self.queues.reported_load()

    def follow_load(self) -> None:
        """Read the workers' queues all along (a backend's ``reported_load``), not only while
        requests of ours wait there."""
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
        """Teach the pool a worker's speed from a finished generation (replies whose body
        the pool did not see, e.g. streamed ones, can be reported here by the caller)."""
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
        on_attempt: Callable[[str], None] | None = None,
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
        tries = _Tries(path)
        async with aclosing(self._tries(tries, key, only, on_attempt)) as endpoints:
            async for endpoint in endpoints:
                try:
                    async with self._on(endpoint, method, path, body, budget) as response:
                        yield endpoint, response
                    return
                except _TryAgain as again:
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
        on_attempt: Callable[[str], None] | None = None,
        budget: int | None = None,
    ) -> T:
        """``send``, and ``consume(endpoint, response)`` the reply under the same deadline.
        ``resend_cut`` (a request the server keeps no state of: sampling): a reply the
        connection cut after it opened (a worker that died under it, behind a router too)
        is sent once more, as one more attempt of the same loop, so a dead server then fails
        fast, naming itself; ``consume`` starts over (it is given the new reply)."""
        budget = budget if budget is not None else self.protocol.request_budget(body)
        tries = _Tries(path, cuts=int(resend_cut))
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
                except _TryAgain as again:
                    tries.failed(endpoint, again)
        raise AssertionError("unreachable: _tries raises when it gives up")

    async def _tries(
        self,
        tries: _Tries,
        key: str | None,
        only: str | None,
        on_attempt: Callable[[str], None] | None,
    ) -> AsyncIterator[Endpoint]:
        """The worker of each attempt, with a backoff between them, until the caller stops
        asking or the attempts run out (then the error naming every one of them)."""
        attempt = -1
        while (attempt := attempt + 1) < self.config.max_retries + 1 + tries.resent:
            if tries.missed and all(
                u in tries.missed for u in ([only.rstrip("/")] if only else self.urls)
            ):
                break  # no worker left that has not let this request's deadline pass
            if attempt:
                await self.sleep(_backoff(self.config, self.rng, attempt - 1))
            endpoint = self._attempt(key, only, tries.missed, tries.errors, on_attempt)
            if endpoint is not None:
                yield endpoint
        raise _gave_up(tries.errors, tries.missed, self.urls)

    @asynccontextmanager
    async def _on(
        self, endpoint: Endpoint, method: str, path: str, body: Any, budget: int | None
    ) -> AsyncIterator[httpx.Response]:
        """One attempt on ``endpoint`` under its deadline; ``_TryAgain`` when another may
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
                    raise _TryAgain(f"no answer within its {limit:.1f} s deadline", True) from None
                endpoint.progressed(self.clock())
                done = self.protocol.tokens_of(response) if budget else 0
                if done:
                    self.observe(endpoint.url, done, loop.time() - started)
            except _TryAgain as again:
                if not again.missed:
                    self.prober.failed(endpoint)
                    raise
                endpoint.disarm(timer)
                released, reason = _miss(again.reason, timer, started + limit, endpoint)
                self.prober.failed(endpoint, missed=not released)
                if opened:  # the caller had the response: it cannot be sent again here
                    raise BackendTimeoutError(where, reason) from None
                raise _TryAgain(reason, missed=True) from None
            except BaseException:
                if not opened:
                    endpoint.breaker.abandon_probe()  # a cancelled probe frees the slot
                raise
            finally:
                endpoint.end(timer)

    def _attempt(
        self,
        key: str | None,
        only: str | None,
        missed: set[str],
        errors: list[str],
        on_attempt: Callable[[str], None] | None,
    ) -> Endpoint | None:
        """The worker for the next attempt, its send right claimed, counted and announced;
        None (reason noted) when none may be tried now."""
        if only is not None:
            pinned = self.endpoints.get(only.rstrip("/"))
            if pinned is None:
                raise BackendError(only, "not a configured endpoint")
            pool = [pinned] if pinned.available() else []
        else:
            pool = self.routes.candidates(key)
        endpoint = next((e for e in pool if e.url not in missed and e.claim()), None)
        if endpoint is None:
            targets = [only.rstrip("/")] if only else self.urls
            seen = [r for u in targets if (r := self.endpoints[u].stopped_reason)]
            why = f" ({seen[0]})" if seen else ""
            errors.append(f"{only or ', '.join(self.urls)}: circuit open{why}")
            return None
        endpoint.count_attempt()
        self.routes.settle(key, endpoint.url)  # now, so a query's concurrent requests follow it
        if on_attempt is not None:
            on_attempt(endpoint.url)  # the caller must know where to abort, before any reply
        return endpoint

    async def _open(self, endpoint: Endpoint, method: str, path: str, body: Any) -> httpx.Response:
        where = endpoint.url + path
        request = self.http.build_request(method, where, json=body, headers=self._headers)
        try:
            response = await self.http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise _TryAgain(f"cannot connect ({type(exc).__name__})", False) from exc
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            # Lost before the status line: no byte of a response, safe to send again.
            why = f"connection lost before a response ({type(exc).__name__})"
            raise _TryAgain(why, False) from exc
        except httpx.TimeoutException as exc:
            # The server may still be working on it: resend only to another worker.
            why = f"no response within the read timeout ({type(exc).__name__})"
            raise _TryAgain(why, True) from exc
        if response.status_code in RETRYABLE_STATUS:
            text = (await response.aread()).decode(errors="replace")[:200]
            await response.aclose()
            raise _TryAgain(f"HTTP {response.status_code} {text}".strip(), False)
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

        async def decode(endpoint: Endpoint, response: httpx.Response) -> tuple[str, Any]:
            try:
                raw = await response.aread()
            except httpx.HTTPError as exc:
                raise BackendError(endpoint.url + path, f"response cut short: {exc!r}") from exc
            try:
                value = json.loads(raw) if raw else None
            except ValueError as exc:
                raise BackendError(endpoint.url + path, f"bad JSON: {raw[:200]!r}") from exc
            return endpoint.url, value

        return await self.call(method, path, body, decode, **route)


@dataclass
class _Tries:
    """One request's attempts: what each failed with, the workers that may still run it
    (``missed``: never sent it again), the cut replies it may still resend (``cuts``) and
    those it did (``resent``: attempts on top of the retries)."""

    path: str
    cuts: int = 0
    resent: int = 0
    errors: list[str] = field(default_factory=list)
    missed: set[str] = field(default_factory=set)

    def failed(self, endpoint: Endpoint, again: _TryAgain) -> None:
        if again.missed:
            self.missed.add(endpoint.url)
        self.errors.append(f"{endpoint.url + self.path}: {again.reason}")

    def cut(self, exc: BaseException) -> _TryAgain | None:
        """One more attempt for a failure while consuming an opened reply, when the
        connection cut it and a resend is left; else None (the failure stands)."""
        cause = exc if isinstance(exc, httpx.TransportError) else exc.__cause__
        if isinstance(cause, httpx.TransportError) and self.cuts > 0:
            self.cuts -= 1
            self.resent += 1
            return _TryAgain(f"reply cut by the connection ({type(cause).__name__})", False)
        return None


def _miss(
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


def _gave_up(errors: list[str], missed: set[str], urls: list[str]) -> BackendError:
    """The error of a request no attempt answered (a timeout if a worker may run it)."""
    target = errors[-1].split(": ", 1)[0] if errors else ", ".join(urls)
    kind = BackendTimeoutError if missed else BackendError
    return kind(target, f"failed after {len(errors)} attempt(s): {'; '.join(errors)}")


def _default_client(config: HttpConfig) -> httpx.AsyncClient:
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


def _backoff(config: HttpConfig, rng: random.Random, attempt: int) -> float:
    delay = min(config.backoff_max_s, config.backoff_base_s * 2.0**attempt)
    return delay * (0.5 + 0.5 * rng.random())  # jitter spreads retry storms
