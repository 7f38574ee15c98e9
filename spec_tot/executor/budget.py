"""SPEX T2: the speculative budget shared by the queries on one backend."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["SpeculationBudget"]


@dataclass
class SpeculationBudget:
    """A global budget of speculative sequences shared by every query of a run.

    ``capacity`` is the backend's saturation batch: below it a decode step costs about the
    same whatever the batch, so speculation there is nearly free. The speculative room is
    ``capacity - committed`` (committed load always wins, so speculation backs off as the
    engine saturates), shared by softmax(utility / tau) over the queries asking for it, where
    a query's utility is its best candidate's utility times its observed hit rate.
    """

    capacity: int
    tau: float = 1.0
    committed: int = 0
    speculative: dict[str, int] = field(default_factory=dict)
    demand: dict[str, float] = field(default_factory=dict)
    launched: dict[str, int] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)

    def hit_rate(self, query_id: str) -> float:
        # Beta(1, 1) prior: a new query starts at 0.5 and learns from its own adoptions.
        return (self.hits.get(query_id, 0) + 1) / (self.launched.get(query_id, 0) + 2)

    def room(self) -> int:
        return self.capacity - self.committed - sum(self.speculative.values())

    def grant(self, query_id: str, wanted: int, utility: float) -> int:
        """How many speculative sequences ``query_id`` may start now (0..wanted)."""
        self.demand[query_id] = max(utility, 1e-6) * self.hit_rate(query_id)
        free = self.room()
        if wanted <= 0 or free <= 0:
            return 0
        top = max(self.demand.values())
        weights = {q: math.exp((d - top) / self.tau) for q, d in self.demand.items()}
        share = weights[query_id] / sum(weights.values())
        total = self.capacity - self.committed
        # Hit rates steer the split between queries (through ``demand``), not the total:
        # room below saturation left unused is capacity thrown away.
        allowed = math.floor(share * total + 1e-9) - self.speculative.get(query_id, 0)
        if allowed <= 0 and self.demand[query_id] >= top:
            allowed = 1  # the most useful query always gets a slot while the engine has room
        return max(0, min(wanted, allowed, free))

    def started(self, query_id: str, count: int = 1) -> None:
        self.speculative[query_id] = self.speculative.get(query_id, 0) + count
        self.launched[query_id] = self.launched.get(query_id, 0) + count

    def finished(self, query_id: str) -> None:
        self.speculative[query_id] = max(0, self.speculative.get(query_id, 0) - 1)

    def hit(self, query_id: str) -> None:
        self.hits[query_id] = self.hits.get(query_id, 0) + 1

    def forget(self, query_id: str) -> None:
        for table in (self.speculative, self.demand, self.launched, self.hits):
            table.pop(query_id, None)
