"""The queue a server publishes: running plus waiting requests (every client's) read from its
Prometheus page while requests of ours wait there, so deadlines count the work ahead of a
request that other clients put there too (``Endpoint.reported_queue``).

Names read (summed over their label sets: models, data-parallel ranks): vLLM's
``vllm:num_requests_running`` and ``vllm:num_requests_waiting``; SGLang's
``sglang:num_running_reqs`` and ``sglang:num_queue_reqs`` (served with
``--enable-metrics``). A worker whose page is missing or names none of them is not read
again (its figure stays unknown).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import httpx

from .endpoint import Endpoint

__all__ = ["QUEUE_METRICS", "QueueReports", "parse_queue"]

QUEUE_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
)
_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+([-+0-9.eE]+|NaN)\s*(?:\d+)?$")


def parse_queue(text: str) -> float | None:
    """Running + waiting requests on a Prometheus page; None when it names neither."""
    total, seen = 0.0, False
    for line in text.splitlines():
        found = _LINE.match(line.strip())
        if found is None or found.group(1) not in QUEUE_METRICS:
            continue
        try:
            value = float(found.group(2))
        except ValueError:
            continue
        if value == value:  # NaN: no figure
            total, seen = total + value, True
    return total if seen else None


@dataclass(eq=False)
class QueueReports:
    """Reads each worker's page every ``poll_s`` seconds while requests of ours are in
    flight there (none while all are idle), on one background task (``watch`` starts it)."""

    endpoints: dict[str, Endpoint]
    client: httpx.AsyncClient | None
    path: str | None
    poll_s: float
    timeout_s: float = 5.0
    headers: dict[str, str] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _silent: set[str] = field(default_factory=set, init=False)  # workers that publish none

    def watch(self) -> None:
        """Start reading (a request is in flight), unless it runs or is turned off."""
        if self.path is None or self.poll_s <= 0 or self.client is None:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _poll(self) -> None:
        # The first read waits a period: a burst that ends sooner needs no figure (and a
        # test's scripted server sees no extra request).
        while True:
            await asyncio.sleep(self.poll_s)
            busy = [e for e in self.endpoints.values() if e.inflight and e.url not in self._silent]
            if not busy:
                for endpoint in self.endpoints.values():
                    endpoint.report_queue(None)  # idle: a stale figure would mislead
                return
            await asyncio.gather(*(self._read(e) for e in busy))

    async def _read(self, endpoint: Endpoint) -> None:
        assert self.client is not None and self.path is not None
        try:
            response = await self.client.get(
                endpoint.url + self.path, headers=self.headers, timeout=self.timeout_s
            )
        except httpx.HTTPError:
            endpoint.report_queue(None)  # unknown now: never a stale figure
            return
        queue = parse_queue(response.text) if response.status_code == 200 else None
        if queue is None and response.status_code < 500:
            self._silent.add(endpoint.url)  # it publishes no queue: do not ask again
        endpoint.report_queue(queue)
