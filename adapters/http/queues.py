"""The queue a server publishes: running plus waiting requests (every client's), read once
per worker by one reader for everything that needs it: deadlines count the work ahead of a
request that other clients put there too (``Endpoint.reported_queue``), and the
dispatcher takes the workers' sum as the engine's committed load
(``EndpointPool.reported_load``, a backend's ``reported_load``).

Where it is read, found per worker on its first read and then kept: its Prometheus page
(``HttpConfig.metrics_path``: vLLM's ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``; SGLang's ``sglang:num_running_reqs`` and
``sglang:num_queue_reqs`` when served with ``--enable-metrics``; summed over their label
sets), else SGLang's ``GET /v1/loads?include=core`` (``HttpConfig.loads_path``:
``{"loads": [{"num_running_reqs", "num_waiting_reqs"}]}``, one row per DP rank; served by
default, and by ``spec-tot serve``). A worker that publishes neither is not read again.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from .endpoint import Endpoint

__all__ = ["QUEUE_METRICS", "QueueReports", "parse_loads", "parse_queue"]

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


def parse_loads(text: str) -> float | None:
    """Running + waiting requests of an SGLang ``/v1/loads`` reply; None when it is not one."""
    try:
        rows = json.loads(text).get("loads")
        return float(
            sum(int(r.get("num_running_reqs", 0)) + int(r.get("num_waiting_reqs", 0)) for r in rows)
        )
    except (AttributeError, TypeError, ValueError):
        return None


@dataclass(eq=False)
class QueueReports:
    """Reads each worker's queue every ``poll_s`` seconds on one background task: while
    requests of ours are in flight there (``watch``), or all along once a backend wants the
    load for its dispatcher (``follow``, until ``aclose``). ``paths``: where to look, in
    order (the module docstring)."""

    endpoints: dict[str, Endpoint]
    client: httpx.AsyncClient | None
    paths: tuple[str | None, ...]
    poll_s: float
    timeout_s: float = 5.0
    headers: dict[str, str] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _following: bool = field(default=False, init=False)
    # per worker: where its queue is read (found on the first read), or None: nowhere
    _sources: dict[str, tuple[str, Callable[[str], float | None]] | None] = field(
        default_factory=dict, init=False
    )

    def watch(self) -> None:
        """Start reading (a request is in flight), unless it runs or is turned off."""
        if not any(self.paths) or self.poll_s <= 0 or self.client is None:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll())

    def follow(self) -> None:
        """Read all along from now on, idle or not (the dispatcher's load)."""
        self._following = True
        self.watch()

    def reported_load(self) -> float | None:
        """The workers' queues summed (every client's requests), None while none is known."""
        known = [e.reported_queue for e in self.endpoints.values() if e.reported_queue is not None]
        return sum(known) if known else None

    async def aclose(self) -> None:
        self._following = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _poll(self) -> None:
        # The first read waits a period: a burst that ends sooner needs no figure (and a
        # test's scripted server sees no extra request).
        while True:
            await asyncio.sleep(self.poll_s)
            readable = [
                e
                for e in self.endpoints.values()
                if e.url not in self._sources or self._sources[e.url] is not None
            ]
            busy = readable if self._following else [e for e in readable if e.inflight]
            if not busy:
                for endpoint in self.endpoints.values():
                    endpoint.report_queue(None)  # idle: a stale figure would mislead
                return
            await asyncio.gather(*(self._read(e) for e in busy))

    async def _read(self, endpoint: Endpoint) -> None:
        assert self.client is not None
        known = self._sources.get(endpoint.url)  # None: not found yet (silent ones are not read)
        candidates = [known] if known else self._candidates()
        for path, parse in candidates:
            try:
                response = await self.client.get(
                    endpoint.url + path, headers=self.headers, timeout=self.timeout_s
                )
            except httpx.HTTPError:
                endpoint.report_queue(None)  # unknown now: never a stale figure
                return
            queue = parse(response.text) if response.status_code == 200 else None
            if queue is not None:
                self._sources[endpoint.url] = (path, parse)
                endpoint.report_queue(queue)
                return
            if response.status_code >= 500:
                endpoint.report_queue(None)
                return  # a failing server: look again next time
        if not known:
            self._sources[endpoint.url] = None  # it publishes no queue: do not ask again
        endpoint.report_queue(None)

    def _candidates(self) -> list[tuple[str, Callable[[str], float | None]]]:
        parsers = (parse_queue, parse_loads)
        return [(path, parse) for path, parse in zip(self.paths, parsers, strict=True) if path]
