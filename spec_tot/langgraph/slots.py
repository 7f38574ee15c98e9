"""Where a speculative task's room comes from: the speculation dispatcher
(``spec_tot.executor.dispatcher``) of each spec-tot backend the graph uses, the one every ToT
app, batch and LangGraph app on that backend goes through.

When the graph's LLM calls go to spec-tot backends (``ChatSpecTot`` over a backend, or a
backend given to ``from_langgraph``), a speculative task launches only if each such
backend's dispatcher admits it: it is worth its cost there (its node's hit rate, learnt per
node and prediction level, against the backend's step-time cost) and no queued candidate
of any query or run is worth more; committed work anywhere on the backend shrinks the room.
A run is one client of the dispatchers (its key, reserved on the hub like a query id).

The backends are given up front or learnt as the graph runs: ``ChatSpecTot`` reports its
backend around each request (``BranchContext.admit``). A speculative thought task reserves
one sequence on every known dispatcher when it launches; each request it makes holds one
sequence per sample while it runs (the reservation first), waiting until room frees on that
backend if need be (woken by the dispatcher, never polling), or until the task is adopted
(its requests are committed work then). A graph whose models are arbitrary LangChain models
has no backend to share: its runs go through the app's own dispatcher of 16 sequences.

Either way no speculative task starts while the event loop lags: speculation only fills
idle capacity, and a CPU-bound process (LangChain's per-call work, many runs at once) has
none to give. Every one of these decisions is the dispatchers' (their gates: ``quiet``,
``try_start``, ``grant``); this module gathers the counts they decide on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from spec_tot.backends import GenerationBackend
from spec_tot.errors import ConfigError
from spec_tot.executor import (
    BackendHub,
    ClientRules,
    Dispatcher,
    GainLoopConfig,
    Offer,
    hub_for,
)

__all__ = ["DEFAULT_OWN_SLOTS", "Lease", "RunSlots", "SpeculationSlots"]

DEFAULT_OWN_SLOTS = 16  # the own dispatcher's room when no spec-tot backend is known


@dataclass
class SpeculationSlots:
    """The slots of one app, shared by all its runs: its count of speculative tasks
    (capped by ``limit`` if given), the hubs of the spec-tot backends its graph uses, and
    its own dispatcher for when it knows none."""

    limit: int | None = None
    # How many partly-ready supersteps a prediction may build on (``from_langgraph``'s
    # ``max_depth``): each run's ``max_level`` on every dispatcher, asked through ``reaches``.
    max_level: int | None = None
    used: int = 0  # speculative tasks not yet adopted or ended
    hubs: list[BackendHub] = field(default_factory=list)
    # No gain loop here: the runs of a graph's own nodes are not reported to it as results,
    # only its hits, so it has no rate to compare (its CPU gates hold it back instead).
    own: Dispatcher = field(
        default_factory=lambda: Dispatcher(
            DEFAULT_OWN_SLOTS, gain_loop=GainLoopConfig(enabled=False)
        )
    )
    lag_s: float = 0.0  # moving average of how late a scheduled prediction pass starts
    max_lag_s: float = 0.005  # a loop this late has no idle time to give
    # Busy Python: above this share of one core, the process's Python runs at the GIL's
    # pace, and a speculative task's Python (LangChain's own, per model call) only slows
    # the committed path down.
    max_cpu_share: float = 0.85
    # node -> (wall, waste) seconds of its committed runs, moving averages: what a hit
    # saves and what a miss wastes (CPU + time waiting outside the process), for a node
    # that is not a model call.
    node_costs: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError("max_speculative", f"must be >= 1, got {self.limit}")

    def dispatchers(self) -> list[Dispatcher]:
        """Where a model call's sequences are admitted: the known backends', else the own."""
        return [h.dispatcher for h in self.hubs] or [self.own]

    def observe_lag(self, seconds: float) -> None:
        self.lag_s = 0.8 * self.lag_s + 0.2 * max(0.0, seconds)

    def threads(self) -> int:
        """Worker threads for a sync run's speculative tasks: as many as may run at once."""
        if self.limit is not None:
            return self.limit
        return max([DEFAULT_OWN_SLOTS, *(h.dispatcher.capacity for h in self.hubs)])

    def learn(self, backend: Any) -> BackendHub:
        """The hub of ``backend``, which the app's speculative tasks take slots from now on."""
        if not isinstance(backend, GenerationBackend):
            raise ConfigError(
                "backend",
                "a speculation dispatcher needs a spec-tot GenerationBackend (or a ChatSpecTot), "
                f"got {type(backend).__name__}",
            )
        hub = hub_for(backend)
        if all(h is not hub for h in self.hubs):
            self.hubs.append(hub)
        return hub

    def observe_node(self, node: str, wall_s: float, cpu_s: float, away_s: float = 0.0) -> None:
        """A committed run of ``node`` took ``wall_s`` seconds, ``cpu_s`` of them this
        thread's CPU, ``away_s`` of them with the whole process idle (waiting outside it).
        Kept per node: (wall, what a miss wastes = CPU + time away), moving averages."""
        old = self.node_costs.get(node)
        wall = max(0.0, wall_s)
        sample = (wall, min(wall, max(0.0, cpu_s) + max(0.0, away_s)))
        self.node_costs[node] = (
            sample
            if old is None
            else (0.8 * old[0] + 0.2 * sample[0], 0.8 * old[1] + 0.2 * sample[1])
        )

    def for_run(self, key: str, shares_loop: bool = True) -> RunSlots:
        return RunSlots(self, key, shares_loop)


@dataclass(eq=False)
class Lease:
    """What one speculative task holds: its place in the app's count (until adopted or
    ended), one sequence reserved at launch on each dispatcher in ``reserved`` (a thought
    task's first model call uses it), and, while its calls run, one sequence per sample of
    each call. ``offer`` is what it launched as (its hit is learnt under it)."""

    run: RunSlots
    offer: Offer
    launched_on: list[Dispatcher]
    reserved: list[Dispatcher] = field(default_factory=list)
    counted: bool = True
    adoption: asyncio.Event = field(default_factory=asyncio.Event)

    def adopted(self) -> None:
        """The task is real work now: its count and unused reservations free; the
        sequences of calls in flight stay held until they end. A hit where it launched."""
        self.adoption.set()
        self.release()
        for dispatcher in self.launched_on:
            dispatcher.hit(self.offer)

    def release(self) -> None:
        self.uncount()
        for dispatcher in self.reserved:
            dispatcher.finished(self.run.key)
        self.reserved = []

    def uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.run.app.used -= 1


@dataclass
class RunSlots:
    """One run's side of the app's slots: ``key`` is the run's client key on every dispatcher."""

    app: SpeculationSlots
    key: str
    shares_loop: bool = True  # the run's real tasks run on the speculator's loop
    joined: list[BackendHub] = field(default_factory=list)
    closed: bool = False

    def quiet(self) -> bool:
        """Whether the process has idle time for speculation now (the dispatchers' gate):
        its Python is not busy and, when the run's real tasks share the speculator's event
        loop (an async run), that loop keeps time (its prediction passes start on time). A
        sync run speculates on a loop of its own, whose lag slows no real task."""
        lag = self.app.lag_s if self.shares_loop else 0.0
        return all(self._joined(d).quiet(self.key, lag) for d in self.app.dispatchers())

    def reaches(self, level: int) -> bool:
        """Whether a prediction may build on ``level`` partly-ready supersteps (every
        dispatcher's ``reaches`` gate, under this run's rules)."""
        return all(self._joined(d).reaches(self.key, level) for d in self.app.dispatchers())

    def observe_lag(self, seconds: float) -> None:
        if self.shares_loop:  # only a loop real tasks share says anything of their delay
            self.app.observe_lag(seconds)

    def acquire(
        self,
        kind: str,
        level: int,
        reserve: bool,
        node: str = "",
        unblocks_s: float = 0.0,
        caps: Iterable[tuple[int, int | None]] = (),
    ) -> Lease | None:
        """Room for one new speculative task of node ``kind`` predicted ``level`` steps
        ahead, or None (not admitted, the app's limit, or the loop lags). ``reserve``: the
        task is a model call; it reserves one sequence on every known dispatcher now (each
        must admit it), so that the launches of one pass see each other. Any other task is
        admitted by the app's own dispatcher on its committed runs' cost (``node``'s): a hit
        saves their wall seconds plus ``unblocks_s`` (the model calls it lets run ahead), a
        miss wastes their CPU and their time waiting outside the process; a node never run
        is not worth running ahead. ``caps``: the run's own (held, limit) counts (its
        ``max_concurrency``), decided on with the app's by each dispatcher."""
        app = self.app
        if self.closed:
            return None
        caps = [(app.used, app.limit), *caps]
        lag = app.lag_s if self.shares_loop else 0.0
        if reserve:
            dispatchers = app.dispatchers()
            tokens = max((d.mean_tokens for d in dispatchers), default=0.0) or 1.0
            offer = Offer(kind, level, tokens, _started)
            for hub in app.hubs:
                self._join(hub)
        else:
            cost = app.node_costs.get(node)
            if cost is None:
                return None
            dispatchers = [app.own]
            saved = cost[0] + unblocks_s
            # A miss wastes the node's CPU and holds what it waits on outside the process
            # (a server, an API, a sleep) as long as a hit saves; such a node alone runs
            # ahead only once its hit rate beats a coin's, or when it lets model calls run
            # ahead. A CPU-bound node's miss costs its CPU only.
            offer = Offer(kind, level, 0.0, _started, saved_s=saved, waste_s=cost[1])
        admitted: list[Dispatcher] = []
        for dispatcher in dispatchers:
            if not self._joined(dispatcher).try_start(self.key, offer, lag_s=lag, caps=caps):
                break
            admitted.append(dispatcher)
        if len(admitted) < len(dispatchers):
            return None
        for dispatcher in admitted:
            dispatcher.started(self.key)
        app.used += 1
        return Lease(self, offer, launched_on=admitted, reserved=list(admitted))

    @contextlib.asynccontextmanager
    async def admit(
        self, lease: Lease | None, speculative: Callable[[], bool], backend: Any, n: int = 1
    ) -> AsyncIterator[None]:
        """Around one request of ``n`` samples of a task's branch on ``backend``: learn its
        hub; a speculative task holds one sequence of its dispatcher per sample while the
        request runs (its reservation first), waiting for room if need be, or until
        ``speculative()`` turns False (adopted: the request is committed work)."""
        dispatcher = self.app.learn(backend).dispatcher
        held = 0
        try:
            if lease is not None and speculative():
                if dispatcher in lease.reserved:
                    lease.reserved.remove(dispatcher)
                    held = 1
                while held < n and speculative() and not self.closed:
                    self._join(self.app.learn(backend))
                    granted = dispatcher.grant(self.key, n - held)
                    if granted > 0:
                        held += granted
                    else:
                        await _room_or_adoption(dispatcher, lease)
            yield
        finally:
            if held:
                dispatcher.finished(self.key, held)

    def _join(self, hub: BackendHub) -> None:
        if all(h is not hub for h in self.joined):
            hub.reserve([{"query_id": self.key}])  # no ToT query may take the same key
            self.joined.append(hub)
            self._joined(hub.dispatcher)

    def _joined(self, dispatcher: Dispatcher) -> Dispatcher:
        """``dispatcher``, with this run's rules: priced, held back while the process is busy."""
        rules = ClientRules(
            max_level=self.app.max_level,
            max_cpu_share=self.app.max_cpu_share,
            max_lag_s=self.app.max_lag_s,
        )
        if dispatcher.rules(self.key) != rules:
            dispatcher.join(self.key, rules)
        return dispatcher

    def close(self) -> None:
        """The run ended (every lease released): it leaves every dispatcher it asked."""
        self.closed = True
        for hub in self.joined:
            hub.dispatcher.forget(self.key)
            hub.release([self.key])
        self.joined = []
        self.app.own.forget(self.key)


def _started(_offer: Offer) -> bool:
    return True  # a run's task starts in the caller, once admitted


async def _room_or_adoption(dispatcher: Dispatcher, lease: Lease) -> None:
    """Until room frees on ``dispatcher`` or the task is adopted (woken, not polled)."""
    waits = {
        asyncio.ensure_future(dispatcher.wait_room()),
        asyncio.ensure_future(lease.adoption.wait()),
    }
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
