"""Where a speculative task's slot comes from.

When the graph's LLM calls go to spec-tot backends (``ChatSpecTot`` over a backend, or a
backend given to ``from_langgraph``), a speculative task takes one sequence of each such
backend's speculation budget (``spec_tot.executor.hub_for(backend).budget``), the same budget
every ToT app, batch and LangGraph app on that backend draws from: together they never run
more speculative sequences than the backend's saturation batch, and committed work anywhere
on it shrinks the room. A run is one caller of the budget (its key, reserved on the hub like
a query id); its demand is the prediction's utility (1 for a prediction from the real
partial pool, less for one built on speculative steps) times its observed hit rate.

The backends are given up front or learnt as the graph runs: ``ChatSpecTot`` reports its
backend around each request (``BranchContext.admit``). A speculative thought task reserves
one sequence of every known budget when it launches; each request it makes holds one
sequence per sample while it runs (the reservation first), waiting for room if need be,
or until the task is adopted (its requests are committed work then).
A graph whose models are arbitrary LangChain models has no budget to share: its runs use the
app's own pool of ``max_speculative`` slots (16 by default).

Either way no speculative task starts while the event loop lags: speculation only fills
idle capacity, and a CPU-bound process (LangChain's per-call work, many runs at once) has
none to give.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from spec_tot.backends import GenerationBackend
from spec_tot.errors import ConfigError
from spec_tot.executor import BackendHub, hub_for

__all__ = ["DEFAULT_OWN_SLOTS", "Lease", "RunSlots", "SpeculationSlots"]

DEFAULT_OWN_SLOTS = 16  # the own pool's size when no spec-tot backend is known
EXACT_UTILITY = 1.0  # demand of a prediction from the real partial pool
DEEP_UTILITY = 0.5  # demand of one built on speculative (partial) steps
_ADMIT_POLL_S = 0.005  # how often a task waiting for budget room looks again


@dataclass
class SpeculationSlots:
    """The slots of one app, shared by all its runs: its own count of speculative tasks
    (capped by ``limit``; by default 16 while no backend is known, no cap of its own once
    the backends' budgets decide) and the hubs of the spec-tot backends its graph uses."""

    limit: int | None = None
    used: int = 0  # speculative tasks holding an own-pool slot (not yet adopted)
    hubs: list[BackendHub] = field(default_factory=list)
    lag_s: float = 0.0  # moving average of how late a scheduled prediction pass starts
    max_lag_s: float = 0.005

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError("max_speculative", f"must be >= 1, got {self.limit}")

    @property
    def cap(self) -> int | None:
        """Speculative tasks one app may run at once on its own count (None: no cap)."""
        if self.limit is not None:
            return self.limit
        return None if self.hubs else DEFAULT_OWN_SLOTS

    # Busy Python: above this share of one core, the process's Python runs at the GIL's
    # pace, and a speculative task's Python (LangChain's own, per model call) only slows
    # the committed path down.
    max_cpu_share: float = 0.85
    _cpu: _CpuMeter = field(default_factory=lambda: _CpuMeter())

    def idle(self, shares_loop: bool = True) -> bool:
        """Whether speculation may start a task now: the process's Python has room, and
        (``shares_loop``: the run's real tasks share the speculator's event loop, as an
        async run's do) that loop keeps time (its scheduled prediction passes start on
        time). A sync run speculates on a loop of its own, whose lag slows no real task."""
        if self._cpu.share() > self.max_cpu_share:
            return False
        return not shares_loop or self.lag_s <= self.max_lag_s

    def observe_lag(self, seconds: float) -> None:
        self.lag_s = 0.8 * self.lag_s + 0.2 * max(0.0, seconds)

    def threads(self) -> int:
        """Worker threads for a sync run's speculative tasks: as many as may run at once."""
        cap = self.cap
        if cap is not None:
            return cap
        return max(DEFAULT_OWN_SLOTS, *(h.budget.capacity for h in self.hubs))

    def learn(self, backend: Any) -> BackendHub:
        """The hub of ``backend``, which the app's speculative tasks take slots from now on."""
        if not isinstance(backend, GenerationBackend):
            raise ConfigError(
                "backend",
                "a speculation budget needs a spec-tot GenerationBackend (or a ChatSpecTot), "
                f"got {type(backend).__name__}",
            )
        hub = hub_for(backend)
        if all(h is not hub for h in self.hubs):
            self.hubs.append(hub)
        return hub

    def for_run(self, key: str, shares_loop: bool = True) -> RunSlots:
        return RunSlots(self, key, shares_loop)


class _CpuMeter:
    """The process's CPU time per wall second (all threads), over the last ~0.2 s,
    sampled at most every 20 ms."""

    def __init__(self, window_s: float = 0.2) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        now = time.perf_counter(), time.process_time()
        self._samples: collections.deque[tuple[float, float]] = collections.deque([now])
        self._share = 0.0

    def share(self) -> float:
        with self._lock:
            wall, cpu = time.perf_counter(), time.process_time()
            if wall - self._samples[-1][0] >= 0.02:
                self._samples.append((wall, cpu))
                while len(self._samples) > 2 and wall - self._samples[1][0] >= self.window_s:
                    self._samples.popleft()
                w0, c0 = self._samples[0]
                if wall > w0:
                    self._share = (cpu - c0) / (wall - w0)
            return self._share


@dataclass(eq=False)
class Lease:
    """What one speculative task holds: an own-pool slot (until adopted or ended), one
    sequence reserved at launch on each budget in ``reserved`` (a thought task's first model
    call uses it), and, while its calls run, one sequence per sample of each call."""

    run: RunSlots
    pooled: bool
    utility: float
    reserved: list[BackendHub] = field(default_factory=list)
    used: dict[BackendHub, int] = field(default_factory=dict)  # sequences its calls took

    def adopted(self) -> None:
        """The task is real work now: its own-pool slot and unused reservations free; the
        sequences of calls in flight stay held until they end, and count as hits."""
        self.release()
        for hub, count in self.used.items():
            for _ in range(count):
                hub.budget.hit(self.run.key)

    def release(self) -> None:
        self.unpool()
        for hub in self.reserved:
            hub.budget.finished(self.run.key)
        self.reserved = []

    def unpool(self) -> None:
        if self.pooled:
            self.pooled = False
            self.run.app.used -= 1


@dataclass
class RunSlots:
    """One run's side of the app's slots: ``key`` is the run's caller key on every budget."""

    app: SpeculationSlots
    key: str
    shares_loop: bool = True  # the run's real tasks run on the speculator's loop
    joined: list[BackendHub] = field(default_factory=list)
    closed: bool = False

    @property
    def idle(self) -> bool:
        return self.app.idle(self.shares_loop)

    def observe_lag(self, seconds: float) -> None:
        if self.shares_loop:  # only a loop real tasks share says anything of their delay
            self.app.observe_lag(seconds)

    def acquire(self, utility: float, reserve: bool) -> Lease | None:
        """A slot for one new speculative task, or None (no room, or the loop lags).
        ``reserve``: the task is a model call; it reserves one sequence of every known
        budget now, so that the launches of one pass see each other."""
        app = self.app
        cap = app.cap
        if self.closed or not self.idle or (cap is not None and app.used >= cap):
            return None
        hubs = list(app.hubs) if reserve else []
        for hub in hubs:
            self._join(hub)
            if hub.budget.grant(self.key, 1, utility) < 1:
                return None
        for hub in hubs:
            hub.budget.started(self.key)
        app.used += 1
        return Lease(self, pooled=True, utility=utility, reserved=hubs)

    @contextlib.asynccontextmanager
    async def admit(
        self, lease: Lease | None, speculative: Callable[[], bool], backend: Any, n: int = 1
    ) -> AsyncIterator[None]:
        """Around one request of ``n`` samples of a task's branch on ``backend``: learn its
        hub; a speculative task holds one sequence of its budget per sample while the
        request runs (its reservation first), waiting for room if need be, or until
        ``speculative()`` turns False (adopted: the request is committed work)."""
        hub = self.app.learn(backend)
        held = 0
        try:
            if lease is not None and speculative():
                if hub in lease.reserved:
                    lease.reserved.remove(hub)
                    held = 1
                while held < n and speculative() and not self.closed:
                    self._join(hub)
                    granted = hub.budget.grant(self.key, n - held, lease.utility)
                    if granted > 0:
                        hub.budget.started(self.key, granted)
                        held += granted
                    else:
                        await asyncio.sleep(_ADMIT_POLL_S)
                lease.used[hub] = lease.used.get(hub, 0) + held
            yield
        finally:
            for _ in range(held):
                hub.budget.finished(self.key)

    def _join(self, hub: BackendHub) -> None:
        if all(h is not hub for h in self.joined):
            hub.reserve([{"query_id": self.key}])  # no ToT query may take the same key
            self.joined.append(hub)

    def close(self) -> None:
        """The run ended (every lease released): it leaves every budget it asked."""
        self.closed = True
        for hub in self.joined:
            hub.budget.forget(self.key)
            hub.release([self.key])
        self.joined = []
