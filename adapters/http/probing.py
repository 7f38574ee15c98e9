"""Timed health probes of open breakers, so a worker that comes back is taken back without
waiting for traffic to try it."""

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
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    def watch(self) -> None:
        """Start the timed probe of open breakers, unless it runs or is turned off."""
        if self.health_path is None or (self._task and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._probe_open())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

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

    async def _probe(self, endpoint: Endpoint) -> None:
        assert self.health_path is not None
        try:
            response = await self.client.get(
                endpoint.url + self.health_path, headers=self.headers, timeout=self.timeout_s
            )
        except httpx.HTTPError:
            endpoint.breaker.failure()
            return
        if response.status_code >= 500:
            endpoint.breaker.failure()
        else:  # any answer below 500, a 404 included, is a live server
            endpoint.breaker.success()
