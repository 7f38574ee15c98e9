"""A worker's health: failures counted against its breaker (a missed deadline only once a
health check confirms it), timed probes of open breakers, so a worker that comes back is
taken back without waiting for traffic to try it, and a watch on workers that hold requests
in silence (``HttpConfig.stall_s``): one whose health check then does not answer is declared
stopped and releases its requests at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from .breaker import Clock
from .endpoint import Endpoint

__all__ = ["HealthProber"]


@dataclass(eq=False)
class HealthProber:
    """Probes ``GET health_path`` of every worker whose breaker is open, at each cooldown's
    end, on one background task that ends when no breaker is open (None: never probes)."""

    endpoints: dict[str, Endpoint]
    client: httpx.AsyncClient
    health_path: str | None
    cooldown_s: float
    timeout_s: float
    headers: dict[str, str]
    sleep: Callable[[float], Awaitable[None]]
    clock: Clock
    stall_s: float | None = None
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _stalls: asyncio.Task[None] | None = field(default=None, init=False)
    _checks: dict[str, asyncio.Future[bool]] = field(default_factory=dict, init=False)
    _judges: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    def watch(self) -> None:
        """Start the timed probe of open breakers, unless it runs or is turned off."""
        if self.health_path is None or (self._task and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._probe_open())

    def watch_stalls(self) -> None:
        """Start the watch on silent workers while requests are in flight, unless it runs
        or is turned off (no ``stall_s`` or no health path)."""
        if self.stall_s is None or self.health_path is None:
            return
        if self._stalls is None or self._stalls.done():
            self._stalls = asyncio.get_running_loop().create_task(self._watch_stalls())

    async def aclose(self) -> None:
        for judge in list(self._judges):
            judge.cancel()
        await asyncio.gather(*self._judges, return_exceptions=True)
        for name in ("_task", "_stalls"):
            task = getattr(self, name)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                setattr(self, name, None)

    async def _watch_stalls(self) -> None:
        """Every ninth of ``stall_s`` while some worker holds requests: each one silent for
        ``stall_s`` whose breaker is closed gets a health check; an answer counts as a word
        (a busy server is not a stopped one), silence declares it stopped."""
        assert self.stall_s is not None
        while any(e.inflight for e in self.endpoints.values()):
            await self.sleep(self.stall_s / 9)
            now = self.clock()
            silent = [
                e
                for e in self.endpoints.values()
                if e.silent_s(now) >= self.stall_s and e.breaker.opened_at is None
            ]
            answers = await asyncio.gather(*(self.answers(e) for e in silent))
            for endpoint, answered in zip(silent, answers, strict=True):
                if answered:
                    endpoint.progressed(self.clock())
                    continue
                reason = (
                    f"the worker stopped answering: no reply for {endpoint.silent_s(now):.0f} s"
                    f" with {endpoint.inflight} request(s) in flight, and {self.health_path} "
                    f"gave no answer within {self.timeout_s:g} s"
                )
                endpoint.declare_stopped(reason, asyncio.get_running_loop().time())
                self.watch()  # probe it back at the cooldown's end

    async def _probe_open(self) -> None:
        """While some breaker is open: at each cooldown's end, probe the worker's health
        endpoint (claiming the one half-open probe); an answer closes the breaker, silence
        or a 5xx reopens it for another cooldown."""
        while True:
            opened = [e for e in self.endpoints.values() if e.breaker.opened_at is not None]
            if not opened:
                return
            due = min(e.breaker.opened_at or 0.0 for e in opened) + self.cooldown_s
            # Never spin: a probe claimed by traffic is waited for at a tenth of a cooldown.
            await self.sleep(max(due - self.clock(), self.cooldown_s / 10))
            ready = [e for e in opened if e.breaker.acquire()]
            await asyncio.gather(*(self._probe(e) for e in ready))

    def failed(self, endpoint: Endpoint, *, missed: bool = False) -> None:
        """Count a failure against the worker. A missed deadline alone is not one while the
        worker's health check answers (a busy server is not a dead one): it is judged by
        that check first. A breaker opened by missed deadlines means a worker that holds
        requests without answering: every request waiting on it is released now (they move
        to other workers) instead of each waiting out its own."""
        if missed:
            endpoint.count_miss()
            if self.health_path is not None:
                judge = asyncio.get_running_loop().create_task(self._judge_miss(endpoint))
                self._judges.add(judge)
                judge.add_done_callback(self._judges.discard)
                return
        self._count_failure(endpoint, missed)

    async def _judge_miss(self, endpoint: Endpoint) -> None:
        if await self.answers(endpoint):
            endpoint.count_miss(busy=True)
            return
        self._count_failure(endpoint, missed=True)

    def _count_failure(self, endpoint: Endpoint, missed: bool) -> None:
        opened = endpoint.breaker.failure()
        if opened and missed:
            endpoint.release(asyncio.get_running_loop().time())
        if endpoint.breaker.opened_at is not None:
            self.watch()

    async def answers(self, endpoint: Endpoint) -> bool:
        """Whether ``endpoint``'s health path answers (below 500) within the probe timeout;
        concurrent callers share one check. Without a health path: False."""
        if self.health_path is None:
            return False
        check = self._checks.get(endpoint.url)
        if check is None:
            check = asyncio.ensure_future(self._answers(endpoint))
            self._checks[endpoint.url] = check
            check.add_done_callback(lambda _: self._checks.pop(endpoint.url, None))
        return await asyncio.shield(check)

    async def _answers(self, endpoint: Endpoint) -> bool:
        assert self.health_path is not None
        try:
            response = await self.client.get(
                endpoint.url + self.health_path, headers=self.headers, timeout=self.timeout_s
            )
        except httpx.HTTPError:
            return False
        return response.status_code < 500

    async def _probe(self, endpoint: Endpoint) -> None:
        # any answer below 500, a 404 included, is a live server
        if await self._answers(endpoint):
            endpoint.breaker.success()
            endpoint.progressed(self.clock())
        else:
            endpoint.breaker.failure()
