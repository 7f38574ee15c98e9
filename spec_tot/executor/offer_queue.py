"""The dispatcher's priority queue of speculative offers, best value first.

Each client's ``push`` supersedes its earlier offers (a generation number per client marks
the live ones); superseded entries are dropped lazily as they surface, and compacted away
once they outnumber the live ones, so the heap stays O(live) and each event costs O(log Q).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["OfferQueue", "Wakeups"]

_Entry = tuple[float, int, str, int, Any]


class OfferQueue:
    """Offers keyed by ``-value``; ``Any`` is the dispatcher's ``Offer`` (no import cycle)."""

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._generation: dict[str, int] = {}  # client -> generation of its live offers
        self._live: dict[str, int] = {}  # client -> offers of that generation in the heap
        self._seq = itertools.count()
        self._draining = False
        self._again = False

    def push(self, client: str, offers: Iterable[Any], value: Callable[[Any], float]) -> None:
        """Replace ``client``'s queued offers with ``offers``."""
        generation = self._generation.get(client, 0) + 1
        self._generation[client] = generation
        self._live[client] = 0
        for offer in offers:
            heapq.heappush(self._heap, (-value(offer), next(self._seq), client, generation, offer))
            self._live[client] += 1
        if len(self._heap) > 64 + 4 * self.queued():
            self._heap = [e for e in self._heap if self._valid(e)]
            heapq.heapify(self._heap)

    def withdraw(self, client: str) -> None:
        self._generation[client] = self._generation.get(client, 0) + 1
        self._live.pop(client, None)

    def forget(self, client: str) -> None:
        self.withdraw(client)
        self._generation.pop(client, None)

    def queued(self) -> int:
        return sum(self._live.values())

    def best_value(self) -> float:
        """The best live offer's value as queued (``-inf`` when none)."""
        while self._heap and not self._valid(self._heap[0]):
            heapq.heappop(self._heap)
        return -self._heap[0][0] if self._heap else -math.inf

    def pop(self) -> tuple[str, Any, int, int] | None:
        """The best live offer: (client, offer, seq, generation), or None."""
        while self._heap:
            _, seq, client, generation, offer = heapq.heappop(self._heap)
            if self._generation.get(client) == generation:
                self._live[client] -= 1
                return client, offer, seq, generation
        return None

    def put_back(self, client: str, offer: Any, seq: int, generation: int, value: float) -> None:
        """Return a popped offer (its value now) in its place."""
        if self._generation.get(client) == generation:
            self._live[client] += 1
            heapq.heappush(self._heap, (-value, seq, client, generation, offer))

    def drain(self, once: Callable[[], None]) -> None:
        """Run ``once`` (launch what fits) until nothing changed during a run. A launch
        can free or take room, and so call back here: one drain at a time, again if
        something changed during it."""
        if self._draining:
            self._again = True
            return
        self._draining = True
        try:
            self._again = True
            while self._again:
                self._again = False
                once()
        finally:
            self._draining = False

    def _valid(self, entry: _Entry) -> bool:
        return self._generation.get(entry[2]) == entry[3]


class Wakeups:
    """Tasks waiting for room on the dispatcher: woken all at once when it frees (no
    polling)."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    async def wait(self) -> None:
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        finally:
            if future in self._waiters:
                self._waiters.remove(future)

    def wake_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)
