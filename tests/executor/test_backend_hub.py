"""One speculation dispatcher, one reward router and one set of query ids per backend, shared by
every app, batch and concurrent call in the process (``spec_tot.executor.hub_for``)."""

from __future__ import annotations

import asyncio

import pytest
from spec_helpers import Saturating, make_app, tick_fn

from spec_tot.adapters.scripted import ScriptedConfig
from spec_tot.errors import ConfigError
from spec_tot.executor import Dispatcher, hub_for


@pytest.mark.parametrize("mode", ["spex", "full"])
async def test_eight_concurrent_ainvokes_never_exceed_the_backends_capacity(mode: str) -> None:
    """Eight ``ainvoke`` calls at once (two apps) share the backend's one dispatcher: the
    speculative sequences in flight never pass its saturation batch (8 per-call limits
    would each have allowed it)."""
    for seed in range(2):
        backend = Saturating(
            6,
            ScriptedConfig(seed=seed, depth=4, straggler_rate=0.3),
            tick_fn(seed, 20),
            tick_fn(seed + 1, 2),
        )
        apps = [make_app(backend, "rebase", mode, params={"width": 6}) for _ in range(2)]
        calls = [apps[i % 2].ainvoke({"question": f"puzzle {i}"}) for i in range(8)]
        results = await asyncio.gather(*calls)
        assert all(r.status == "ok" for r in results)
        assert backend.speculative_requests > 0  # it did speculate
        assert backend.peak_speculative <= 6
        assert hub_for(backend).dispatcher.peak_speculative <= 6
        assert backend.num_inflight == 0
        assert hub_for(backend).active == set()  # every query id released


async def test_a_server_reported_load_is_the_committed_load() -> None:
    """Another client's load, as the server reports it, leaves this process no room."""
    backend = Saturating(4, ScriptedConfig(seed=0, depth=4), tick_fn(0, 10), None, load=4.0)
    app = make_app(backend, "rebase", "full", params={"width": 6})
    result = await app.ainvoke({"question": "puzzle"})
    assert result.status == "ok"
    assert backend.speculative_requests == 0
    dispatcher = Dispatcher(capacity=8, load=lambda: 5.0)
    dispatcher.started("a", 2)  # this process's speculation is part of the reported load
    assert dispatcher.committed == 3 and dispatcher.room() == 3
    for _ in range(4):
        dispatcher.committed_started()
    assert dispatcher.committed == 4  # the local count when it is the larger


async def test_query_ids_are_reserved_per_backend_across_apps() -> None:
    backend = Saturating(4, ScriptedConfig(), tick_fn(0, 5))
    first, second = (make_app(backend, "beam", "baseline") for _ in range(2))
    hub = hub_for(backend)
    assert hub_for(backend) is hub  # one hub per backend
    running = asyncio.create_task(first.ainvoke({"question": "a", "query_id": "x"}))
    await asyncio.sleep(0)
    assert "x" in hub.active
    with pytest.raises(ConfigError, match="already running"):
        await second.ainvoke({"question": "b", "query_id": "x"})
    both = await asyncio.gather(first.ainvoke("c"), second.ainvoke("d"))
    assert len({r.query_id for r in both}) == 2  # auto ids never collide across apps
    await running
    assert hub.active == set()


async def test_one_reward_router_per_event_loop() -> None:
    backend = Saturating(4, ScriptedConfig(), tick_fn(0, 5))
    hub = hub_for(backend)
    mine = hub.router()
    assert hub.router() is mine

    def other_loop() -> object:
        async def get() -> object:
            return hub.router()

        return asyncio.run(get())

    theirs = await asyncio.to_thread(other_loop)
    assert theirs is not mine


async def test_the_dispatcher_learns_hit_rates_across_queries() -> None:
    """Every query's launches and adoptions teach the backend's one dispatcher, per policy
    and level: a later query starts from what earlier ones showed."""
    backend = Saturating(8, ScriptedConfig(seed=1, depth=4), tick_fn(1, 10), tick_fn(2, 2))
    app = make_app(backend, "rebase", "full", params={"width": 4})
    for i in range(3):
        assert (await app.ainvoke({"question": f"p{i}"})).status == "ok"
    dispatcher = hub_for(backend).dispatcher
    launched = sum(c[0] for (kind, _, _), c in dispatcher.rates.counts.items() if kind == "rebase")
    assert launched == dispatcher.launches > 0
    assert dispatcher.curve.measured  # committed requests sampled the step curve
    assert dispatcher.queued() == 0 and dispatcher.speculative == {}  # queries forgotten


def test_the_hub_is_kept_beside_the_backend_not_on_it() -> None:
    """Nothing is written on the user's object, and a backend that goes away takes its hub
    (and the hub's dispatcher) with it."""
    import gc
    import weakref

    backend = Saturating(4, ScriptedConfig(), tick_fn(0, 5))
    before = set(vars(backend))
    hub = weakref.ref(hub_for(backend))
    assert set(vars(backend)) == before
    assert backend.reported_load() == hub_for(backend).dispatcher.load()
    del backend
    gc.collect()
    assert hub() is None


def test_a_backend_that_cannot_be_weakly_referenced_is_named() -> None:
    from spec_tot.adapters.scripted import ScriptedBackend

    class Slotted(ScriptedBackend):
        __slots__ = ()

    class NoWeakref:
        __slots__ = ("capabilities",)

    backend = NoWeakref()
    backend.capabilities = ScriptedBackend(ScriptedConfig()).capabilities
    with pytest.raises(ConfigError, match=r"NoWeakref.*__weakref__"):
        hub_for(backend)  # type: ignore[arg-type]
    assert hub_for(Slotted(ScriptedConfig())) is not None  # a __dict__ above: fine
