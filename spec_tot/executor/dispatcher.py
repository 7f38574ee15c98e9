"""SPEX T2, the one speculation rule: a dispatcher per backend, shared by every ToT query,
batch, app and LangGraph run that uses the backend in this process
(``spec_tot.executor.hub_for(backend).dispatcher``).

Clients offer speculative candidates (``Offer``); every candidate of every client waits in
one priority queue keyed by its expected value::

    value = P(hit) x saved x gain  -  (1 - P(hit)) x wasted  -  launch CPU

- ``P(hit)``: learnt online per (kind, level, confidence): ``kind`` names what predicted it
  (a search policy, a LangGraph node), ``level`` how far below committed work it hangs,
  ``confidence`` the predictor's own estimate (a policy's utility in [0, 1], in quarters):
  the rate calibrates it. A Beta(1, 1) prior, so a new slot starts at 0.5.
- saved: its expected tokens x the step time at the current load: what the critical path
  would spend generating it after the commit (plus what the client adds).
- gain: the share of a critical-path second saved that is throughput (``gain_share``): all
  of it for a lone client, whose waits idle the engine; with ``n`` clients ``1/n`` plus the
  engine's unused capacity of the rest (the others' work fills one's waits; measured: REBASE
  at 4 in flight, every hit counted, adopted 71% of its launches and ran 0.92-0.96x ``dedup``).
- wasted: its tokens x the step-time increase one more row causes, felt by every row in
  flight (the rows now, or the rows committed requests usually start at if more: it lives
  on past a trough), plus its reward (PRM) seconds and what else its run costs the process (the
  executor's CPU per request run, measured: ``RunCpu``). A hit
  costs nothing extra: the committed search would have done the same work, later.
- launch CPU: the executor's own seconds per launch, measured.

The step time per load comes from a ``StepCurve`` learnt from the committed requests' own
latency (so a remote server's curve is its own traffic's) over the backend's calibrated
step-time curve (the embedded engine measures one at start-up), or, for a backend without
one, the roofline's shape: flat below the saturation batch, linear above.

The queue launches while the best value is positive and there is room: the saturation batch
less committed and speculative sequences in flight, and at most ``gain_loops.limit``
speculative ones, a cap set by what speculation measurably delivers (``gain_loop.py``).
Freed room anywhere wakes it (no polling); each event costs O(log Q) heap work. Committed
load is the in-process count or, when the backend reports its serving engine's load, that
figure less this process's speculation, whichever is larger: client processes on one
server share its room.

Every launch decision of every client is the dispatcher's: a client joins with its
``ClientRules`` (priced or not, its own caps, whether a busy process holds it back) and asks
the gates below (``asks``, ``reaches``, ``worth``, ``offer``, ``try_start``, ``grant``,
``steers``, ``quiet``); it never compares a room, a value or a cap itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from spec_tot.errors import ConfigError
from spec_tot.executor.cpu_meter import CpuMeter, LaunchCpu, RunCpu
from spec_tot.executor.gain_loop import GainLoopConfig, GainLoops
from spec_tot.executor.offer_queue import OfferQueue, Wakeups
from spec_tot.executor.offers import HitRates, Offer
from spec_tot.executor.step_curve import StepCurve

__all__ = ["ClientRules", "Dispatcher", "HitRates", "Offer", "StepCurve"]


@dataclass(frozen=True, slots=True)
class ClientRules:
    """How one client's speculation is admitted (``Dispatcher.join``).

    - ``priced``: SPEX T2, each launch only while worth its cost and while there is room;
      False (no budget: ``naive``, or a mode without T2) launches every offer at once, up to
      the caps;
    - ``max_sequences``: its speculative sequences in flight at once (0: it never speculates);
    - ``max_level``: how many levels below committed work it may run ahead;
    - ``max_ask``: predictions asked per pass (a prediction's CPU grows with the ask);
    - ``max_cpu_share``, ``max_lag_s``: no launch while the process's CPU time per wall
      second is above the one, or the client's event loop runs later than the other (a
      LangGraph run: its own Python, LangChain's, runs on the loop committed work uses;
      above about one core the process's Python is the bottleneck)."""

    priced: bool = True
    max_sequences: int | None = None
    max_level: int | None = None
    max_ask: int | None = None
    max_cpu_share: float | None = None
    max_lag_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_sequences", "max_level", "max_ask"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(name, f"must be an integer or None, got {value!r}")
            if value is not None and value < 0:
                raise ConfigError(name, f"must be >= 0, got {value}")
        for name in ("max_cpu_share", "max_lag_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value == value):
                raise ConfigError(name, f"must be a number or None, got {value!r}")

    @property
    def speculates(self) -> bool:
        """Whether the price and the gain loop decide its speculation."""
        return self.priced and self.max_sequences != 0


_ANY = ClientRules()
Caps = Iterable[tuple[int, int | None]]  # a client's own (held, limit) counts


class Dispatcher:
    """The speculation rule of one backend (see the module docstring)."""

    def __init__(
        self,
        capacity: int,
        load: Callable[[], float | None] = lambda: None,
        clock: Callable[[], float] = time.thread_time,
        step_curve: dict[int, float] | None = None,
        gain_loop: GainLoopConfig | None = None,
        row_cost_known: bool = True,
    ) -> None:
        self.capacity = capacity
        self.load, self.clock = load, clock  # clock: thread CPU, what a launch costs
        self.curve = StepCurve(capacity, prior=dict(step_curve or {}))
        self.rates = HitRates()
        self.gain_loops = GainLoops(capacity, gain_loop, row_cost_known=row_cost_known)
        self.cpu = CpuMeter()
        self.run_cpu = RunCpu(clock)
        self.launch_cpu = LaunchCpu()
        self.local_committed = 0
        self.speculative: dict[str, int] = {}
        self.speculating = 0  # sum(speculative.values()), kept: rows() runs per event
        self.peak_speculative = 0
        self.launches = 0
        self.mean_tokens = 0.0  # moving average of a committed request's tokens
        self.rows_seen = 0.0  # moving average of the rows a committed request starts at
        self._rules: dict[str, ClientRules] = {}
        self._queue = OfferQueue()
        self._wakeups = Wakeups()

    # -- load -----------------------------------------------------------------------------
    @property
    def committed(self) -> int:
        reported = self.load()  # the serving engine's count, this process's speculation in it
        others = 0 if reported is None else math.ceil(reported) - self.speculating
        return max(self.local_committed, others)

    def rows(self) -> int:
        return self.committed + self.speculating

    def room(self) -> int:
        """Speculative sequences that may start now: room, within the gain loop's cap."""
        return min(self.capacity - self.rows(), self.gain_loops.limit - self.speculating)

    def committed_started(self) -> int:
        """A committed request starts; returns the rows in flight, for its ``finished``."""
        rows = self.rows()
        self.local_committed += 1
        self.rows_seen = rows if not self.rows_seen else 0.9 * self.rows_seen + 0.1 * rows
        return rows

    def committed_finished(self, rows: int = 0, seconds: float = 0.0, tokens: int = 0) -> None:
        """A committed request ended after ``seconds`` with ``tokens`` generated, having
        started at ``rows`` in flight: a sample of the step curve."""
        self.local_committed = max(0, self.local_committed - 1)
        self.run_cpu.ended()
        self.curve.observe(rows + 1, seconds, tokens)
        if tokens > 0:
            mean = self.mean_tokens
            self.mean_tokens = tokens if not mean else 0.9 * mean + 0.1 * tokens
        self.gain_loops.result(seconds)
        self._freed()

    def started(self, client: str, count: int = 1) -> None:
        self.speculative[client] = self.speculative.get(client, 0) + count
        self.speculating += count
        self.peak_speculative = max(self.peak_speculative, self.speculating)
        self.gain_loops.used(self.speculating)

    def finished(self, client: str, count: int = 1) -> None:
        held = self.speculative.get(client, 0)
        self.speculative[client] = max(0, held - count)
        self.speculating -= min(held, count)
        self.run_cpu.ended(count)
        self._freed()

    # -- value ----------------------------------------------------------------------------
    def value(self, offer: Offer, p: float | None = None) -> float:
        """``offer``'s value now, at its slot's hit rate unless ``p`` is given."""
        if p is None:
            p = self.rates.rate(offer.slot)
        rows = self.rows()
        step_s, _, slack = self.curve.costs(rows)
        generation_s = offer.tokens * step_s * self.rates.realised(offer.slot)
        saved = (generation_s + offer.saved_s) * self.gain_share(slack)
        miss = _miss_s(self.curve, offer, max(rows, round(self.rows_seen)))
        if offer.tokens:  # a model call's run: the executor's CPU for it beyond its launch
            miss += self.run_cpu.per_run_s
        # Seconds once the curve is measured, or for an offer that generates nothing (a
        # LangGraph function node): before, a token's unit is one step, and a launch's CPU
        # seconds are not comparable with it.
        cpu = self.launch_cpu.per_launch_s if self.curve.measured or not offer.tokens else 0.0
        return p * saved - (1.0 - p) * miss - cpu

    def gain_share(self, slack: float) -> float:
        """The share of a critical-path second saved that is throughput: all of it for a
        lone client (its waits idle the engine); with ``n``, ``1/n`` plus the engine's
        unused capacity (``slack``) of the rest, whose work fills one's waits."""
        share = 1.0 / max(1, len(self._rules))
        return share + (1.0 - share) * slack

    def saving_s(self, offer: Offer) -> float:
        """The seconds a hit of ``offer`` launched now saves if it ends before it is needed."""
        return offer.tokens * self.curve.costs(self.rows())[0]

    def hit(self, offer: Offer, realised: float | None = None) -> None:
        """A launched ``offer`` was adopted; ``realised``: its head start / ``saving_s``.
        An adopted request is a committed one the search need not send: a result."""
        self.rates.hit(offer.slot, realised)
        if self.gain_loops.result():
            self._freed()

    def could_pay(self, kind: str, tokens: float, reward_s: float = 0.0) -> bool:
        """Whether an offer of ``kind`` could have value now at its best slot's odds."""
        best = self.rates.best(kind)
        return self.value(Offer(kind, 0, tokens, _never, reward_s=reward_s), best) > 0

    # -- the gates ------------------------------------------------------------------------
    def join(self, client: str, rules: ClientRules) -> None:
        """``client``'s launches follow ``rules`` from now on (until ``forget``)."""
        self._rules[client] = rules
        self.gain_loops.clients(sum(r.speculates for r in self._rules.values()))

    def rules(self, client: str) -> ClientRules:
        return self._rules.get(client, _ANY)  # a client that never joined: priced, no caps

    def _left(self, client: str) -> int:
        """The sequences ``client`` may still start under its own cap."""
        cap = self.rules(client).max_sequences
        return self.capacity if cap is None else cap - self.speculative.get(client, 0)

    def asks(self, client: str, kind: str, tokens: float, reward_s: float = 0.0) -> int:
        """Predictions ``client`` should make now: its cap's rest, at most ``max_ask``;
        priced, at most the room, none while no offer of ``kind`` could pay (predicting costs
        CPU the engine and reward model need); at 0 its queued offers are withdrawn."""
        rules = self.rules(client)
        ask = self._left(client)
        if rules.max_ask is not None:
            ask = min(ask, rules.max_ask)
        if rules.priced:
            ask = min(ask, self.room())
            if ask > 0 and not self.could_pay(kind, tokens, reward_s):
                ask = 0
            if ask <= 0:
                self._queue.withdraw(client)
        return max(ask, 0)

    def reaches(self, client: str, level: int) -> bool:
        """Whether ``client`` may run ``level`` levels below its committed work."""
        cap = self.rules(client).max_level
        return cap is None or level <= cap

    def worth(self, client: str, offer: Offer) -> bool:
        """Whether ``offer`` would launch now on its value (always, unpriced)."""
        return not self.rules(client).priced or self.value(offer) > 0

    def steers(self, client: str) -> bool:
        """Whether a launch of ``client``'s could be admitted now (room, or unpriced)."""
        return self._left(client) > 0 and (not self.rules(client).priced or self.room() > 0)

    def quiet(self, client: str, lag_s: float = 0.0) -> bool:
        """Whether the process's CPU is not busy and ``client``'s loop is at most late."""
        rules = self.rules(client)
        if rules.max_lag_s is not None and lag_s > rules.max_lag_s:
            return False
        return rules.max_cpu_share is None or self.cpu.share() <= rules.max_cpu_share

    def offer(self, client: str, offers: Sequence[Offer]) -> None:
        """Replace ``client``'s queued candidates with ``offers`` and launch what fits;
        unpriced, launch them all now (up to its cap)."""
        if not self.rules(client).priced:
            for offer in offers:
                if self._left(client) <= 0:
                    return
                offer.launch(offer)
            return
        self._queue.push(client, offers, self.value)
        self._drain()

    def try_start(self, client: str, offer: Offer, *, lag_s: float = 0.0, caps: Caps = ()) -> bool:
        """Admit ``offer`` now, outside the queue, if the process is ``quiet``, each (held,
        limit) of ``caps`` (the client's counts) and the backend have room, and no queued
        candidate is worth more than its positive value. The caller counts it (``started``)."""
        if not self.quiet(client, lag_s) or self._left(client) <= 0:
            return False
        if any(limit is not None and held >= limit for held, limit in caps):
            return False
        self._drain()
        value = self.value(offer)
        if self.room() <= 0 or value <= 0 or self._queue.best_value() > value:
            return False
        self._launched(offer)
        return True

    def grant(self, client: str, want: int) -> int:
        """Start up to ``want`` sequences of an admitted task of ``client``'s as room allows;
        returns how many (the caller ends them with ``finished``)."""
        granted = max(0, min(want, self.room(), self._left(client)))
        if granted:
            self.started(client, granted)
        return granted

    def forget(self, client: str) -> None:
        """``client`` ended: its candidates and rules go, its sequences are not counted."""
        self._queue.forget(client)
        self._rules.pop(client, None)
        self.gain_loops.clients(sum(r.speculates for r in self._rules.values()))
        held = self.speculative.pop(client, 0)
        self.speculating -= held
        if held:
            self._freed()

    def queued(self) -> int:
        return self._queue.queued()

    async def wait_room(self) -> None:
        """Until room frees anywhere on this backend (returns at once if there is some)."""
        if self.room() <= 0:
            await self._wakeups.wait()

    def _freed(self) -> None:
        if self.room() > 0:
            self._drain()
            self._wakeups.wake_all()

    def _drain(self) -> None:
        self._queue.drain(self._drain_once)

    def _drain_once(self) -> None:
        while self.room() > 0:
            popped = self._queue.pop()
            if popped is None:
                return
            client, offer, seq, generation = popped
            if self._left(client) <= 0:
                continue  # its cap is reached: this offer is dropped
            value = self.value(offer)
            if value <= 0:  # the best is worth nothing now: wait for the load to change
                self._queue.put_back(client, offer, seq, generation, value)
                return
            before = self.clock()
            launched = offer.launch(offer)
            self.launch_cpu.spent(self.clock() - before)
            if launched:
                self._launched(offer)

    def _launched(self, offer: Offer) -> None:
        self.launches += 1
        self.rates.launched(offer.slot)


def _miss_s(curve: StepCurve, offer: Offer, rows: int) -> float:
    """What a miss costs: it slows every row in flight for nothing, at the load it lives
    through (``rows``: a launch in a trough between rounds runs on into the next round's
    peak; priced at the trough alone, REST-MCTS* at 4 in flight wasted 14% of its tokens
    and ran 0.87-0.91x ``dedup``), plus its reward seconds and its own run's CPU. A hit
    costs nothing extra: the committed search would have done the same work, later.
    (Charging hits that delay too, as if the engine were saturated, stopped rStar's and
    beam's sure hits at 16 and 32 in flight, where they gain 3-4%.)"""
    marginal_s = curve.costs(rows)[1]
    return offer.tokens * marginal_s * max(rows, 1) + offer.reward_s + offer.waste_s


def _never(_offer: Offer) -> bool:
    return False
