"""``reported_load`` for SGLang: every worker's ``GET /v1/loads?include=core`` (SGLang 0.5.10
to 0.5.23: ``{"loads": [{"num_running_reqs", "num_waiting_reqs", ...}]}``, one row per DP
rank), read in the background."""

from __future__ import annotations

import asyncio

from spec_tot.adapters.http import EndpointPool
from spec_tot.errors import BackendError

__all__ = ["LoadPoller"]


class LoadPoller:
    """Polls every worker of ``pool`` each ``poll_s`` seconds (0: never), once started."""

    def __init__(self, pool: EndpointPool, poll_s: float) -> None:
        self.pool = pool
        self.poll_s = poll_s
        self._loads: dict[str, float] = {}  # worker URL -> running + waiting it last reported
        self._task: asyncio.Task[None] | None = None

    def reported_load(self) -> float | None:
        """Running + waiting requests the workers last reported on ``/v1/loads`` (every
        client's), summed; None until a worker has answered."""
        return sum(self._loads.values()) if self._loads else None

    def start(self) -> None:
        if self._task is None and self.poll_s > 0:
            self._task = asyncio.create_task(self._poll())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _poll(self) -> None:
        while True:
            for url in self.pool.urls:
                try:
                    _, value = await self.pool.json("GET", "/v1/loads?include=core", only=url)
                    loads = value.get("loads") if isinstance(value, dict) else None
                    self._loads[url] = float(
                        sum(
                            int(d.get("num_running_reqs", 0)) + int(d.get("num_waiting_reqs", 0))
                            for d in loads or ()
                        )
                    )
                except (BackendError, AttributeError, TypeError, ValueError):
                    self._loads.pop(url, None)  # unknown now: never a stale figure
            await asyncio.sleep(self.poll_s)
