"""What every app, batch and concurrent call on one backend share in this process: the
query ids in use on it, its speculation dispatcher (SPEX T2) and, per event loop, its reward
router. ``hub_for(backend)`` gives the one hub of a backend, from a weak map: nothing is
written on the user's object, and a backend that goes away takes its hub with it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping

from spec_tot.backends import GenerationBackend
from spec_tot.errors import ConfigError
from spec_tot.executor.dispatcher import Dispatcher
from spec_tot.executor.hit_rate_store import load_gain_loops, load_hit_rates, save_hit_rates
from spec_tot.executor.reward_router import RewardRouter
from spec_tot.graph_nodes import State
from spec_tot.seeds import seed_key

__all__ = ["BackendHub", "QueryInput", "hub_for"]

# The one process-wide table of hubs, by the backend's identity (backends need not be
# hashable) and weak on it: two apps built on one backend
# object must share its dispatcher, and the backend is the only handle both hold.
_HUBS: dict[int, tuple[weakref.ref[GenerationBackend], BackendHub]] = {}


class QueryInput:
    """One query's input state (with its reserved ``query_id``) and seed key."""

    __slots__ = ("query_id", "seed_key", "state")

    def __init__(self, state: State, key: str) -> None:
        self.state = state
        self.seed_key = key
        self.query_id = str(state["query_id"])


class BackendHub:
    def __init__(self, backend: GenerationBackend) -> None:
        # Weak: the hub lives in a map keyed weakly by the backend, so it must not keep it alive.
        self._backend = weakref.ref(backend)
        self._dispatcher: Dispatcher | None = None
        self._lock = threading.Lock()
        self._routers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RewardRouter] = (
            weakref.WeakKeyDictionary()
        )
        self.active: set[str] = set()  # query ids running (or queued) on the backend
        self._ids = itertools.count()
        self._recalled: set[str] = set()  # hit-rate files already added to the dispatcher

    def recall_hit_rates(self, path: str | None) -> None:
        """Add what earlier runs learnt (the file at ``path``) to the dispatcher's hit
        rates and gain loops, once per file for this backend: a later batch finds them
        learnt already."""
        if path is None or path in self._recalled:
            return
        self.dispatcher.rates.merge(load_hit_rates(path))
        self.dispatcher.gain_loops.restore(load_gain_loops(path))
        self._recalled.add(path)

    def keep_hit_rates(self, path: str | None) -> None:
        """Write the dispatcher's hit rates and gain loops' caps to ``path`` for the next run."""
        dispatcher = self._dispatcher
        if path is not None and dispatcher is not None:
            save_hit_rates(path, dispatcher.rates.snapshot(), dispatcher.gain_loops.snapshot())

    @property
    def dispatcher(self) -> Dispatcher:
        """The backend's speculation dispatcher, sized from its capabilities when first
        used (a hub made for a backend not started yet starts nothing)."""
        if self._dispatcher is None:
            with self._lock:
                backend = self._backend()
                if self._dispatcher is None and backend is not None:
                    caps = backend.capabilities
                    self._dispatcher = Dispatcher(
                        caps.saturation_batch,
                        load=_weak_call(backend.reported_load),
                        step_curve=step_curve_of(caps.extra),
                        row_cost_known=caps.row_cost_known,
                    )
        assert self._dispatcher is not None  # internal: a hub dies with its backend
        return self._dispatcher

    def router(self) -> RewardRouter:
        """The reward router of the running event loop (one per loop: it holds futures)."""
        loop = asyncio.get_running_loop()
        router = self._routers.get(loop)
        if router is None:
            router = self._routers[loop] = RewardRouter()
        return router

    def reserve(self, states: list[State]) -> list[QueryInput]:
        """Check explicit query ids (unique, no '/', not running on this backend) and give
        the others ``q<n>`` ids that collide with none; reserve them all, before any query
        starts. Seeds derive from the explicit id, else from the input (never ``q<n>``)."""
        explicit = [s["query_id"] for s in states if s.get("query_id") is not None]
        for qid in explicit:
            if not isinstance(qid, str) or not qid or "/" in qid:
                raise ConfigError("query_id", f"must be a non-empty string without '/': {qid!r}")
            if qid in self.active:
                raise ConfigError("query_id", f"{qid!r} is already running on this backend")
        if len(set(explicit)) != len(explicit):
            raise ConfigError("query_id", "query ids in one batch must be unique")
        taken = set(explicit) | self.active
        out = []
        for state in states:
            qid = state.get("query_id")
            key = seed_key(state, qid)
            if qid is None:
                qid = f"q{next(self._ids)}"
                while qid in taken:
                    qid = f"q{next(self._ids)}"
                taken.add(qid)
                state = {**state, "query_id": qid}
            out.append(QueryInput(state, key))
        self.active.update(q.query_id for q in out)
        return out

    def release(self, query_ids: Iterable[str]) -> None:
        self.active.difference_update(query_ids)


def step_curve_of(extra: Mapping[str, float]) -> dict[int, float]:
    """The calibrated step-time curve a backend reports (``step_s_b{n}``: seconds a decode
    step takes at batch ``n``), empty when it reports none."""
    out: dict[int, float] = {}
    for key, seconds in extra.items():
        size = key.removeprefix("step_s_b")
        if key.startswith("step_s_b") and size.isdigit() and seconds > 0:
            out[int(size)] = float(seconds)
    return out


def hub_for(backend: GenerationBackend) -> BackendHub:
    """The hub of ``backend``, created on first use."""
    key = id(backend)
    entry = _HUBS.get(key)
    if entry is not None and entry[0]() is backend:
        return entry[1]
    try:
        ref = weakref.ref(backend, lambda gone: _forget(key, gone))
    except TypeError as exc:  # a class with __slots__ and no __weakref__
        raise ConfigError(
            "backend",
            f"{type(backend).__name__} cannot be shared through a weak reference: "
            "add '__weakref__' to its __slots__",
        ) from exc
    hub = BackendHub(backend)
    _HUBS[key] = (ref, hub)
    return hub


def _forget(key: int, gone: weakref.ref[GenerationBackend]) -> None:
    entry = _HUBS.get(key)
    if entry is not None and entry[0] is gone:  # not a newer backend that reuses the id
        del _HUBS[key]


def _weak_call(load: Callable[[], float | None]) -> Callable[[], float | None]:
    """``load`` without a strong reference to the object it is bound to (None once gone)."""
    try:
        ref = weakref.WeakMethod(load)
    except TypeError:  # not a bound method: nothing to keep alive
        return load

    def call() -> float | None:
        method = ref()
        return None if method is None else method()

    return call
