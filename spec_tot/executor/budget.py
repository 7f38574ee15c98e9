"""SPEX T2: the speculative budget of one backend, shared by every query, batch, app and
runtime that uses the backend in this process (``spec_tot.executor.hub_for(backend)``).

Usable by any runtime (the LangGraph integration uses it too): before starting speculative
sequences ask ``grant(key, wanted, utility)``; call ``started(key, n)`` for what you start
and ``finished(key)`` as each stops using the engine; ``committed_started()`` /
``committed_finished()`` around committed requests; ``hit(key)`` when a speculative sequence
turns out needed; ``forget(key)`` when the caller (a query) ends. ``key`` is any string
unique among the budget's users at a time (a query id reserved on the backend).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["SpeculationBudget"]


@dataclass
class SpeculationBudget:
    """A backend's budget of speculative sequences.

    ``capacity`` is the backend's saturation batch: below it a decode step costs about the
    same whatever the batch, so speculation there is nearly free. The speculative room is
    ``capacity - committed - speculative in flight``: committed load always wins, so
    speculation backs off as the engine saturates. ``committed`` is the in-process count of
    committed requests in flight or, when the backend reports the serving engine's own load
    (``load()``: running + waiting sequences of every client), that figure less this
    process's speculation, whichever is larger: several client processes share one budget.

    The room is shared by softmax(demand / tau) over the callers asking for it, where a
    caller's demand is its best candidate's utility times its observed hit rate. A demand
    expires when its caller has not asked for ``demand_ttl_s`` (it went quiet) or ends.
    """

    capacity: int
    load: Callable[[], float | None] = field(default=lambda: None)
    demand_ttl_s: float = 1.0
    clock: Callable[[], float] = field(default=time.monotonic)
    local_committed: int = 0
    speculative: dict[str, int] = field(default_factory=dict)
    demand: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (d, when)
    launched: dict[str, int] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    peak_speculative: int = 0

    @property
    def committed(self) -> int:
        reported = self.load()
        if reported is None:
            return self.local_committed
        others = math.ceil(reported) - sum(self.speculative.values())
        return max(self.local_committed, others)

    def committed_started(self) -> None:
        self.local_committed += 1

    def committed_finished(self) -> None:
        self.local_committed = max(0, self.local_committed - 1)

    def hit_rate(self, key: str) -> float:
        # Beta(1, 1) prior: a new caller starts at 0.5 and learns from its own adoptions.
        return (self.hits.get(key, 0) + 1) / (self.launched.get(key, 0) + 2)

    def room(self) -> int:
        return self.capacity - self.committed - sum(self.speculative.values())

    def grant(self, key: str, wanted: int, utility: float, tau: float = 1.0) -> int:
        """How many speculative sequences ``key`` may start now (0..wanted)."""
        self.demand[key] = (max(utility, 1e-6) * self.hit_rate(key), self.clock())
        return self._share(key, wanted, tau)

    def allowance(self, key: str, tau: float = 1.0) -> int:
        """What a grant could give ``key`` now at its last stated demand (a new caller's
        is its hit rate), without changing anything: a caller skips its prediction when
        this is 0 (many callers, little room)."""
        if key not in self.demand:
            return self._share(key, self.capacity, tau, assumed=self.hit_rate(key))
        return self._share(key, self.capacity, tau)

    def _share(self, key: str, wanted: int, tau: float, assumed: float | None = None) -> int:
        now = self.clock()
        for other, (_, when) in list(self.demand.items()):
            if now - when > self.demand_ttl_s and other != key:
                del self.demand[other]  # gone quiet: no claim on the room
        demand = dict(self.demand)
        if assumed is not None:
            demand[key] = (assumed, now)
        committed = self.committed
        free = self.capacity - committed - sum(self.speculative.values())
        if wanted <= 0 or free <= 0:
            return 0
        top = max(d for d, _ in demand.values())
        weights = {k: math.exp((d - top) / tau) for k, (d, _) in demand.items()}
        share = weights[key] / sum(weights.values())
        # Hit rates steer the split between callers (through the demand), not the total:
        # room below saturation left unused is capacity thrown away.
        allowed = math.floor(share * (self.capacity - committed) + 1e-9)
        allowed -= self.speculative.get(key, 0)
        if allowed <= 0 and not self.speculative.get(key):
            # A caller holding no slot gets one while there is room (a share that floors to
            # 0 must not shut it out: it could never show a hit rate), but no more than
            # one: the room past the shares goes to nobody in particular.
            allowed = 1
        return max(0, min(wanted, allowed, free))

    def started(self, key: str, count: int = 1) -> None:
        self.speculative[key] = self.speculative.get(key, 0) + count
        self.launched[key] = self.launched.get(key, 0) + count
        self.peak_speculative = max(self.peak_speculative, sum(self.speculative.values()))

    def finished(self, key: str) -> None:
        self.speculative[key] = max(0, self.speculative.get(key, 0) - 1)

    def hit(self, key: str) -> None:
        self.hits[key] = self.hits.get(key, 0) + 1

    def forget(self, key: str) -> None:
        for table in (self.speculative, self.demand, self.launched, self.hits):
            table.pop(key, None)
