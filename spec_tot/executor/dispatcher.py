"""SPEX T2, the one speculation rule: a dispatcher per backend, shared by every ToT query,
batch, app and LangGraph run that uses the backend in this process
(``spec_tot.executor.hub_for(backend).dispatcher``).

Clients offer speculative candidates (``Offer``); every candidate of every client waits in
one priority queue keyed by its expected value::

    value = P(hit) x saved  -  (1 - P(hit)) x wasted  -  launch CPU

- ``P(hit)``: learnt online per (kind, level, confidence): ``kind`` names what predicted it
  (a search policy, a LangGraph node), ``level`` how far below committed work it hangs,
  ``confidence`` the predictor's own estimate (a policy's utility in [0, 1], in quarters):
  the rate calibrates it. A Beta(1, 1) prior, so a new slot starts at 0.5.
- saved: its expected tokens x the step time at the current load: what the critical path
  would spend generating it after the commit (plus what the client adds).
- wasted: its tokens x the step-time increase one more row causes, felt by every row in
  flight, plus its reward (PRM) seconds and what else its run costs the process. A hit
  costs nothing extra: the committed search would have done the same work, later.
- launch CPU: the executor's own seconds per launch, measured.

The step time per load comes from a ``StepCurve`` learnt from the committed requests' own
latency (so a remote server's curve is its own traffic's) over the backend's calibrated
step-time curve (the embedded engine measures one at start-up), or, for a backend without
one, the roofline's shape: flat below the saturation batch, linear above.

The queue launches while the best value is positive and there is room (the saturation batch
less committed and speculative sequences in flight); freed room anywhere wakes it (no
polling), and each event costs O(log Q) heap work. Committed load is the in-process count
or, when the backend reports its serving engine's load, that figure less this process's
speculation, whichever is larger: client processes on one server share its room.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spec_tot.executor.step_curve import StepCurve

__all__ = ["Dispatcher", "HitRates", "Offer", "StepCurve"]

_MAX_LEVEL = 8  # levels past this share one hit rate
_BANDS = 4  # confidence bands of the predictor's own estimate
_RATE_WINDOW = 512  # hit-rate counts halve past this many launches: recent behaviour wins


@dataclass(frozen=True, slots=True)
class Offer:
    """One speculative sequence a client could start. ``launch(offer)`` starts it now and
    says whether it did (False: no longer wanted, e.g. its parent went away)."""

    kind: str
    level: int
    tokens: float
    launch: Callable[[Offer], bool]
    saved_s: float = 0.0  # critical-path seconds a hit saves besides its generation
    reward_s: float = 0.0  # reward seconds scoring it costs (wasted on a miss)
    waste_s: float = 0.0  # the process's CPU seconds its own run costs (wasted on a miss)
    confidence: float = 1.0  # the predictor's own estimate that it is needed, in [0, 1]

    @property
    def slot(self) -> tuple[str, int, int]:
        """Where its hit rate is learnt: kind, level, confidence band."""
        band = min(_BANDS - 1, max(0, int(self.confidence * _BANDS)))
        return self.kind, min(max(self.level, 0), _MAX_LEVEL), band


@dataclass
class HitRates:
    """Adopted / launched per slot (``Offer.slot``), halved past ``_RATE_WINDOW`` launches."""

    counts: dict[tuple[str, int, int], list[float]] = field(default_factory=dict)

    def _counts(self, slot: tuple[str, int, int]) -> list[float]:
        counts = self.counts.get(slot)
        if counts is None:
            counts = self.counts[slot] = [0.0, 0.0]
        return counts

    def rate(self, slot: tuple[str, int, int]) -> float:
        launched, hits = self._counts(slot)
        return (hits + 1.0) / (launched + 2.0)

    def launched(self, slot: tuple[str, int, int]) -> None:
        counts = self._counts(slot)
        counts[0] += 1
        if counts[0] > _RATE_WINDOW:
            counts[0] /= 2
            counts[1] /= 2

    def hit(self, slot: tuple[str, int, int]) -> None:
        counts = self._counts(slot)
        counts[1] = min(counts[0], counts[1] + 1)

    def best(self, kind: str) -> float:
        """The best rate among ``kind``'s slots, at least the prior's even odds (most of its
        slots are never tried)."""
        return max([0.5, *(self.rate(slot) for slot in self.counts if slot[0] == kind)])


class Dispatcher:
    """The speculation rule of one backend (see the module docstring)."""

    def __init__(
        self,
        capacity: int,
        load: Callable[[], float | None] = lambda: None,
        clock: Callable[[], float] = time.thread_time,
        step_curve: dict[int, float] | None = None,
    ) -> None:
        self.capacity = capacity
        self.load = load
        self.clock = clock  # thread CPU: what a launch costs the executor
        self.curve = StepCurve(capacity, prior=dict(step_curve or {}))
        self.rates = HitRates()
        self.local_committed = 0
        self.speculative: dict[str, int] = {}
        self.speculating = 0  # sum(speculative.values()), kept: rows() runs per event
        self.peak_speculative = 0
        self.launches = 0
        self.cpu_s = 0.0  # moving average of one launch's executor CPU
        self.mean_tokens = 0.0  # moving average of a committed request's tokens
        self._heap: list[tuple[float, int, str, int, Offer]] = []
        self._generation: dict[str, int] = {}  # client -> generation of its live offers
        self._live: dict[str, int] = {}  # client -> offers of that generation in the heap
        self._seq = itertools.count()
        self._draining = False
        self._again = False
        self._waiters: list[asyncio.Future[None]] = []

    # -- load -----------------------------------------------------------------------------
    @property
    def committed(self) -> int:
        reported = self.load()
        if reported is None:
            return self.local_committed
        others = math.ceil(reported) - self.speculating
        return max(self.local_committed, others)

    def rows(self) -> int:
        return self.committed + self.speculating

    def room(self) -> int:
        return self.capacity - self.rows()

    def committed_started(self) -> int:
        """A committed request starts; returns the rows in flight, for its ``finished``."""
        rows = self.rows()
        self.local_committed += 1
        return rows

    def committed_finished(self, rows: int = 0, seconds: float = 0.0, tokens: int = 0) -> None:
        """A committed request ended after ``seconds`` with ``tokens`` generated, having
        started at ``rows`` in flight: a sample of the step curve."""
        self.local_committed = max(0, self.local_committed - 1)
        self.curve.observe(rows + 1, seconds, tokens)
        if tokens > 0:
            mean = self.mean_tokens
            self.mean_tokens = tokens if not mean else 0.9 * mean + 0.1 * tokens
        self._freed()

    def started(self, client: str, count: int = 1) -> None:
        self.speculative[client] = self.speculative.get(client, 0) + count
        self.speculating += count
        self.peak_speculative = max(self.peak_speculative, self.speculating)

    def finished(self, client: str, count: int = 1) -> None:
        held = self.speculative.get(client, 0)
        self.speculative[client] = max(0, held - count)
        self.speculating -= min(held, count)
        self._freed()

    # -- value ----------------------------------------------------------------------------
    def value(self, offer: Offer, p: float | None = None) -> float:
        """``offer``'s value now, at its slot's hit rate unless ``p`` is given."""
        if p is None:
            p = self.rates.rate(offer.slot)
        rows = self.rows()
        step_s, marginal_s = self.curve.costs(rows)
        saved = offer.tokens * step_s + offer.saved_s
        # A miss slows every row in flight for nothing. A hit costs nothing extra: the
        # committed search would have done the same work, later. (Charging hits that delay
        # too, as if the engine were saturated, stopped rStar's and beam's sure hits at 16
        # and 32 in flight, where they gain 3-4%.)
        miss = offer.tokens * marginal_s * max(rows, 1) + offer.reward_s + offer.waste_s
        # Seconds once the curve is measured, or for an offer that generates nothing (a
        # LangGraph function node): before, a token's unit is one step, and a launch's CPU
        # seconds are not comparable with it.
        cpu = self.cpu_s if self.curve.measured or not offer.tokens else 0.0
        return p * saved - (1.0 - p) * miss - cpu

    def hit(self, offer: Offer) -> None:
        """A launched ``offer`` was adopted."""
        self.rates.hit(offer.slot)

    def could_pay(self, kind: str, tokens: float, reward_s: float = 0.0) -> bool:
        """Whether an offer of ``kind`` could have value now at the best odds it may have
        (its best slot, or even odds for a slot not tried yet): a client asks before it
        spends CPU predicting (an MCTS prediction simulates selections from the root)."""
        best = self.rates.best(kind)
        return self.value(Offer(kind, 0, tokens, _never, reward_s=reward_s), best) > 0

    # -- the queue ------------------------------------------------------------------------
    def offer(self, client: str, offers: list[Offer]) -> None:
        """Replace ``client``'s queued candidates with ``offers`` and launch what fits."""
        generation = self._generation.get(client, 0) + 1
        self._generation[client] = generation
        self._live[client] = len(offers)
        for offer in offers:
            entry = (-self.value(offer), next(self._seq), client, generation, offer)
            heapq.heappush(self._heap, entry)
        self._compact()
        self._drain()

    def try_start(self, client: str, offer: Offer) -> bool:
        """Admit ``offer`` now, outside the queue, if it has positive value, there is room,
        and no queued candidate is worth more (they go first). The caller starts it and
        counts its sequences with ``started``."""
        self._drain()
        value = self.value(offer)
        if self.room() <= 0 or value <= 0 or -self._best_queued() > value:
            return False
        self._launched(offer)
        return True

    def withdraw(self, client: str) -> None:
        self._generation[client] = self._generation.get(client, 0) + 1
        self._live.pop(client, None)

    def forget(self, client: str) -> None:
        """``client`` ended: its candidates go, its sequences are no longer counted."""
        self.withdraw(client)
        self._generation.pop(client, None)
        held = self.speculative.pop(client, 0)
        self.speculating -= held
        if held:
            self._freed()

    def queued(self) -> int:
        return sum(self._live.values())

    async def wait_room(self) -> None:
        """Until room frees anywhere on this backend (returns at once if there is some)."""
        if self.room() > 0:
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        finally:
            if future in self._waiters:
                self._waiters.remove(future)

    def _freed(self) -> None:
        if self.room() <= 0:
            return
        self._drain()
        waiters, self._waiters = self._waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)

    def _valid(self, client: str, generation: int) -> bool:
        return self._generation.get(client) == generation

    def _best_queued(self) -> float:
        while self._heap and not self._valid(self._heap[0][2], self._heap[0][3]):
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else math.inf

    def _drain(self) -> None:
        # A launch can free or take room (and so call back here): one drain at a time,
        # again if something changed during it.
        if self._draining:
            self._again = True
            return
        self._draining = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._drain_once()
        finally:
            self._draining = False

    def _drain_once(self) -> None:
        while self.room() > 0 and self._heap:
            _, seq, client, generation, offer = heapq.heappop(self._heap)
            if not self._valid(client, generation):
                continue
            self._live[client] -= 1
            value = self.value(offer)
            if value <= 0:  # the best is worth nothing now: wait for the load to change
                self._live[client] += 1
                heapq.heappush(self._heap, (-value, seq, client, generation, offer))
                return
            before = self.clock()
            launched = offer.launch(offer)
            self.launch_cost(self.clock() - before)
            if launched:
                self._launched(offer)

    def launch_cost(self, seconds: float) -> None:
        """One launch took ``seconds`` of the executor's CPU (measured by whoever launched
        it, for a launch admitted by ``try_start``)."""
        spent = max(0.0, seconds)
        self.cpu_s = spent if not self.launches else 0.9 * self.cpu_s + 0.1 * spent

    def _launched(self, offer: Offer) -> None:
        self.launches += 1
        self.rates.launched(offer.slot)

    def _compact(self) -> None:
        """Drop superseded entries once they outnumber the live ones 4 to 1 (each offer
        supersedes its client's earlier ones), so the heap stays O(live)."""
        if len(self._heap) > 64 + 4 * self.queued():
            self._heap = [e for e in self._heap if self._valid(e[2], e[3])]
            heapq.heapify(self._heap)


def _never(_offer: Offer) -> bool:
    return False
