"""How much speculation a backend admits, set by what it measurably delivers (issue 53).

The dispatcher's price ranks candidates; it cannot promise "never slower": its inputs (the
server's marginal cost, the share of a saving that is throughput, the executor's CPU) are
estimates. ``GainLoop`` closes the loop on measurement. It caps the speculative rows the
dispatcher may hold in flight (``limit``) and moves the cap by comparing the one figure
that speculation exists to raise:

    useful results per busy second = (committed requests ended + speculative ones adopted)
                                     / seconds during which a speculating client ran

An adopted speculative request is a committed one the search no longer sends, so the figure
counts the same work with and without speculation; idle time between runs is not counted.
Each load (speculating clients at once, ``GainLoops``) has its own loop, and what it learnt
is kept with the hit rates between runs (``ExecutorConfig.hit_rates``).

It runs in epochs of at least ``epoch_units`` results and ``epoch_latencies`` times a
result's mean latency (results come in bursts, a search round's children together: an
epoch spans several rounds), each starting at a result at least ``settle_latencies`` mean
latencies after the cap changed (work launched under the old cap ends in that time).

Most epochs run at the current cap (``level``); every ``gap``-th is a probe, half as long,
at a neighbour on the ladder 0, 1, 2, 4, ... capacity: none at all, half (of the most the
price has used at this cap, when less), or double. A fresh loop probes from its fifth epoch. Each
probe's log rate against the epoch just before it is one paired sample. A neighbour better
by more than ``margin`` (and one standard error) over ``samples`` samples, or by 5x
``margin`` in each of two, becomes the cap; one as clearly worse (or by 5x ``margin``
once), or no different after 3x ``samples``, is dropped and probes come a quarter as often
(down to one in ``max_gap`` epochs). Where speculation does not pay, the cap sits at zero
and probes of one row take about a ``1 / (2 max_gap + 1)`` share of the time.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spec_tot.errors import ConfigError

__all__ = ["GainLoop", "GainLoopConfig", "GainLoops"]

_STARTS = ("auto", "full", "none")


@dataclass(frozen=True, slots=True)
class GainLoopConfig:
    """The loop's settings (module docstring). ``enabled=False``: the price alone decides
    (the cap stays at the backend's capacity)."""

    enabled: bool = True
    # Where a fresh loop's cap starts: "full" (the backend's capacity: the price alone
    # decides until a probe finds less better), "none" (no speculation until a probe finds
    # one row better), or "auto": "none" where the backend cannot tell what a row costs its
    # server (``Capabilities.row_cost_known``: a remote server's cost is a guess), else
    # "full" (the embedded engine calibrates its step curve).
    start: str = "auto"
    epoch_units: int = 12
    epoch_latencies: float = 3.0
    settle_latencies: float = 1.0
    margin: float = 0.03
    samples: int = 3
    max_gap: int = 32

    def __post_init__(self) -> None:
        if self.start not in _STARTS:
            raise ConfigError("gain_loop.start", f"must be one of {_STARTS}, got {self.start!r}")
        for name in ("epoch_units", "samples", "max_gap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"gain_loop.{name}", f"must be an integer >= 1, got {value!r}")
        for name in ("epoch_latencies", "settle_latencies", "margin"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ConfigError(
                    f"gain_loop.{name}", f"must be a finite number >= 0, got {value!r}"
                )

    def starts_at_none(self, row_cost_known: bool) -> bool:
        """Whether a fresh loop's cap starts at zero on a backend that does (or does not)
        know what a speculative row costs its server."""
        return self.start == "none" or (self.start == "auto" and not row_cost_known)


class GainLoop:
    """The cap on one backend's speculative rows, moved by measured gain (module docstring).
    The dispatcher tells it of results (``result``), speculative rows in flight (``used``)
    and whether a speculating client runs (``running``); it reads ``limit``."""

    def __init__(
        self,
        capacity: int,
        config: GainLoopConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        from_none: bool = False,
    ) -> None:
        self.config = config or GainLoopConfig()
        self.ladder = _ladder(capacity)
        # index of the cap most epochs run at: the capacity, or none (``from_none``)
        self.level = 0 if from_none else len(self.ladder) - 1
        self.arm: int | None = None  # the ladder index this epoch probes (None: none)
        self.samples: dict[int, list[float]] = {}
        # Epochs at the cap between two probes: a fresh loop probes only from its fifth
        # epoch on, so a run shorter than that (a new app on a new backend) pays nothing to
        # explore, and after a move every third epoch is a probe.
        self.gap = 4
        self.epochs = 0
        self.moves: list[int] = []  # the caps it moved to, in order
        self._clock = clock
        self._active = False
        self._last = clock()
        self._busy = 0.0  # busy seconds since the epoch (or its settling) began
        self._units = 0
        self._settling = True
        self.latency_s = 0.0  # a committed result's mean latency
        self._peak = 0  # speculative rows in flight at most this epoch
        self._used_most = 0  # the most of any epoch at the cap since it last moved
        self._since_probe = 0
        self._turn = 0  # which neighbour the next probe tries
        self._dropped: set[int] = set()  # neighbours found no better since the last move
        self._base_rate: float | None = None  # the rate of the last epoch at the cap

    @property
    def limit(self) -> int:
        """The speculative rows the dispatcher may hold in flight now."""
        if not self.config.enabled:
            return self.ladder[-1]
        return self.ladder[self.level if self.arm is None else self.arm]

    def running(self, active: bool) -> None:
        """Whether a client that may speculate is running (only then is time counted)."""
        self._advance()
        self._active = active

    def used(self, rows: int) -> None:
        """``rows`` speculative rows are in flight now."""
        self._peak = max(self._peak, rows)

    def result(self, seconds: float | None = None) -> bool:
        """A committed request ended (after ``seconds``) or a speculative one was adopted;
        True when the cap changed (grown: the dispatcher should launch what now fits)."""
        self._advance()
        if seconds is not None and seconds > 0 and math.isfinite(seconds):
            mean = self.latency_s
            self.latency_s = seconds if not mean else 0.9 * mean + 0.1 * seconds
        config = self.config
        if not config.enabled or not self._active:  # a result of no speculating client's
            return False
        if self._settling:  # the epoch starts at the first result past the settling time
            if self._busy >= config.settle_latencies * self.latency_s:
                self._settling, self._busy, self._units = False, 0.0, 0
            return False
        self._units += 1
        share = 1.0 if self.arm is None else 0.5  # a probe may cost: it runs half as long
        long_enough = self._busy >= share * config.epoch_latencies * self.latency_s
        if self._units < share * config.epoch_units or not long_enough or self._busy <= 0:
            return False
        before = self.limit
        self._end_epoch(self._units / self._busy)
        return self.limit != before

    def set_cap(self, rows: int) -> None:
        """Run at ``rows`` speculative rows at most (the ladder's step at or above it)."""
        self.level = _index_at_least(self.ladder, rows)

    @property
    def measured(self) -> bool:
        """Whether it has anything to keep: an epoch ended, or one under way."""
        return bool(self.epochs or self._units or self.latency_s)

    def state(self) -> dict[str, Any]:
        """Its state, caps as rows (``resume`` reads it on a backend of any capacity)."""
        rows = self.ladder.__getitem__
        return {
            "cap": rows(self.level), "arm": None if self.arm is None else rows(self.arm),
            "gap": self.gap, "epochs": self.epochs, "units": self._units, "busy_s": self._busy,
            "settling": self._settling, "latency_s": self.latency_s, "base_rate": self._base_rate,
            "since_probe": self._since_probe, "turn": self._turn, "used_most": self._used_most,
            "samples": {str(rows(i)): list(ds) for i, ds in self.samples.items()},
            "dropped": sorted(rows(i) for i in self._dropped),
        }  # fmt: skip

    def resume(self, state: Mapping[str, Any]) -> None:
        """Go on from ``state`` (``state()``); one that does not parse is ignored whole."""
        at = functools.partial(_index_at_least, self.ladder)
        try:
            arm = state["arm"]
            new = (
                at(int(state["cap"])), None if arm is None else at(int(arm)),
                min(max(1, int(state["gap"])), self.config.max_gap), int(state["epochs"]),
                int(state["units"]), float(state["busy_s"]), bool(state["settling"]),
                float(state["latency_s"]),
                None if state["base_rate"] is None else float(state["base_rate"]),
                int(state["since_probe"]), int(state["turn"]), int(state["used_most"]),
                {at(int(k)): [float(d) for d in ds] for k, ds in state["samples"].items()},
                {at(int(r)) for r in state["dropped"]},
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError):
            return
        (self.level, self.arm, self.gap, self.epochs, self._units, self._busy, self._settling,
         self.latency_s, self._base_rate, self._since_probe, self._turn, self._used_most,
         self.samples, self._dropped) = new  # fmt: skip

    def _advance(self) -> None:
        now = self._clock()
        if self._active:
            self._busy += max(0.0, now - self._last)
        self._last = now

    def _end_epoch(self, rate: float) -> None:
        self.epochs += 1
        if self.arm is None:
            self._base_rate = rate
            self._used_most = max(self._used_most, self._peak)  # since the cap last moved
            self._since_probe += 1
            if self._since_probe >= self.gap:
                self.arm = self._next_arm()
        else:
            arm, self.arm = self.arm, None
            self._since_probe = 0
            if self._base_rate:
                self.samples.setdefault(arm, []).append(math.log(rate / self._base_rate))
                self._judge(arm)
        self._units, self._busy, self._peak = 0, 0.0, 0
        self._settling = True

    def _next_arm(self) -> int | None:
        """The next neighbour to probe (none at all, half, double: those that exist and
        are not dropped since the last move), the most promising first. Once all are
        dropped they return, and probes come a quarter as often."""
        # "Half" is half of what the price has used at this cap, when that is less.
        used = _index_at_least(self.ladder, 2 * self._used_most) if self._used_most else self.level
        half = min(self.level, used) - 1
        valid = [i for i in (0, half, self.level + 1) if 0 <= i < len(self.ladder)]
        valid = list(dict.fromkeys(i for i in valid if i != self.level))
        if not valid:
            return None
        arms = [i for i in valid if i not in self._dropped]
        if not arms:
            self._dropped.clear()
            self.gap = min(self.config.max_gap, 4 * self.gap)
            arms = valid
        self._turn += 1
        ahead = [i for i in arms if self.samples.get(i) and statistics.fmean(self.samples[i]) > 0]
        if ahead:
            return max(ahead, key=lambda i: statistics.fmean(self.samples[i]))
        return arms[self._turn % len(arms)]

    def _judge(self, arm: int) -> None:
        config, ds = self.config, self.samples[arm]
        n, mean = len(ds), statistics.fmean(ds)
        se = statistics.stdev(ds) / math.sqrt(n) if n > 1 else math.inf
        strong = n >= 2 and abs(mean) > 5 * config.margin
        if mean > config.margin and (
            (n >= config.samples and mean > se) or (strong and min(ds) > 0)
        ):
            self.level = arm
            self.samples.clear()
            self._dropped.clear()
            self._used_most = 0
            self.gap = 2
            self.moves.append(self.ladder[arm])
            return
        # Dropping a neighbour only spaces the probes out: one clear loss is enough.
        worse = mean < -config.margin and (
            (n >= config.samples and -mean > se) or mean < -5 * config.margin
        )
        if worse or n >= 3 * config.samples:
            del self.samples[arm]
            self._dropped.add(arm)


def _ladder(capacity: int) -> list[int]:
    """0, 1, 2, 4, ... up to ``capacity`` (which ends it)."""
    steps, size = [0], 1
    while size < capacity:
        steps.append(size)
        size *= 2
    if capacity > 0:
        steps.append(capacity)
    return steps


def _index_at_least(ladder: list[int], rows: int) -> int:
    return next((i for i, size in enumerate(ladder) if size >= rows), len(ladder) - 1)


class GainLoops:
    """A ``GainLoop`` per load: the speculating clients (searches, LangGraph runs) running
    at once, in power-of-two buckets (1, 2-3, 4-7, ...). Whether speculation pays depends on
    how many searches share the engine (one alone leaves it idle while it waits; eight fill
    its waits with their own work), so each load learns its own cap; the loop of the load
    now running is the one that counts time and results."""

    def __init__(
        self,
        capacity: int,
        config: GainLoopConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        row_cost_known: bool = True,
    ) -> None:
        self.capacity = capacity
        self.config = config or GainLoopConfig()
        self.from_none = self.config.starts_at_none(row_cost_known)
        self.loops: dict[int, GainLoop] = {}
        self.bucket = 0  # no speculating client
        self._clock = clock

    def loop(self, bucket: int) -> GainLoop:
        """The loop of ``bucket`` (made at its starting cap when first used)."""
        found = self.loops.get(bucket)
        if found is None:
            loop = GainLoop(self.capacity, self.config, self._clock, from_none=self.from_none)
            found = self.loops[bucket] = loop
        return found

    @property
    def limit(self) -> int:
        if self.bucket == 0:
            return self.capacity
        return self.loop(self.bucket).limit

    def clients(self, count: int) -> None:
        """``count`` speculating clients run now."""
        bucket = max(0, count).bit_length()
        if bucket != self.bucket:
            if self.bucket:
                self.loop(self.bucket).running(False)
            self.bucket = bucket
            if bucket:
                self.loop(bucket).running(True)

    def used(self, rows: int) -> None:
        if self.bucket:
            self.loop(self.bucket).used(rows)

    def result(self, seconds: float | None = None) -> bool:
        """A result (``GainLoop.result``); True when the cap in force changed."""
        return bool(self.bucket) and self.loop(self.bucket).result(seconds)

    def snapshot(self) -> dict[int, dict[str, Any]]:
        """What each load learnt, its epoch in progress included: bucket -> state, for the
        next run (a run of a few queries is shorter than an epoch)."""
        return {b: loop.state() for b, loop in sorted(self.loops.items()) if loop.measured}

    def restore(self, learnt: Mapping[int, Mapping[str, Any]]) -> None:
        """Go on from what an earlier run learnt (``snapshot``)."""
        for bucket, state in learnt.items():
            if bucket >= 1:
                self.loop(bucket).resume(state)
