"""One speculation budget, one reward router and one set of query ids per backend, shared by
every app, batch and concurrent call in the process (``spec_tot.executor.hub_for``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from spec_helpers import LatencyBackend, make_app, tick_fn

from spec_tot.adapters.scripted import ScriptedConfig
from spec_tot.errors import ConfigError
from spec_tot.executor import SpeculationBudget, hub_for
from spec_tot.requests import Capabilities, GenerateRequest, GenerateResult


class Saturating(LatencyBackend):
    """Saturates at ``capacity`` sequences; records the most speculative generations in
    flight at once, and (optionally) reports a server-side load."""

    def __init__(self, capacity: int, *args: Any, load: float | None = None) -> None:
        super().__init__(*args)
        self.capacity = capacity
        self.load = load
        self.speculative_now = self.peak_speculative = 0
        self.speculative_requests = 0

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="saturating", saturation_batch=self.capacity)

    def reported_load(self) -> float | None:
        return self.load

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not request.speculative:
            return await super().generate(request)
        self.speculative_requests += 1
        self.speculative_now += 1
        self.peak_speculative = max(self.peak_speculative, self.speculative_now)
        try:
            return await super().generate(request)
        finally:
            self.speculative_now -= 1


@pytest.mark.parametrize("mode", ["spex", "full"])
async def test_eight_concurrent_ainvokes_never_exceed_the_backends_capacity(mode: str) -> None:
    """Eight ``ainvoke`` calls at once (two apps) share the backend's one budget: the
    speculative sequences in flight never pass its saturation batch (8 per-call budgets
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
        assert hub_for(backend).budget.peak_speculative <= 6
        assert backend.num_inflight == 0
        assert hub_for(backend).active == set()  # every query id released


async def test_a_server_reported_load_is_the_committed_load() -> None:
    """Another client's load, as the server reports it, leaves this process no room."""
    backend = Saturating(4, ScriptedConfig(seed=0, depth=4), tick_fn(0, 10), None, load=4.0)
    app = make_app(backend, "rebase", "full", params={"width": 6})
    result = await app.ainvoke({"question": "puzzle"})
    assert result.status == "ok"
    assert backend.speculative_requests == 0
    budget = SpeculationBudget(capacity=8, load=lambda: 5.0)
    budget.started("a", 2)  # this process's speculation is part of the reported load
    assert budget.committed == 3 and budget.room() == 3
    budget.committed_started()
    budget.committed_started()
    budget.committed_started()
    budget.committed_started()
    assert budget.committed == 4  # the local count when it is the larger


def test_demand_expires_when_a_query_goes_quiet() -> None:
    now = [0.0]
    budget = SpeculationBudget(capacity=10, demand_ttl_s=1.0, clock=lambda: now[0])
    budget.grant("quiet", 0, 1.0)
    assert budget.grant("busy", 10, 1.0) == 5  # shared with the other asker
    now[0] = 2.0
    assert budget.grant("busy", 10, 1.0) == 10  # the quiet query's claim expired
    assert "quiet" not in budget.demand
    budget.forget("busy")
    assert budget.demand == {} and budget.speculative == {}


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


def test_allowance_says_whether_a_prediction_could_be_granted_and_changes_nothing() -> None:
    budget = SpeculationBudget(capacity=4)
    for q in "abcdefgh":
        budget.grant(q, 0, 1.0 if q == "a" else 0.1, 0.05)
    before = dict(budget.demand)
    assert budget.allowance("a", 0.05) >= 1  # the most useful query
    assert budget.allowance("h", 0.05) == 1  # a query holding nothing: one slot while there is room
    assert budget.demand == before  # asking changed nothing
    for q in "abcd":
        budget.started(q)
    assert budget.allowance("h", 0.05) == 0  # many queries, no room left: skip predicting
    assert budget.allowance("new", 0.05) == 0


def test_a_caller_holding_slots_gets_no_more_than_its_share() -> None:
    """The room past the shares is not drained by the most useful caller: a caller that
    holds slots gets its share, and a caller that holds none still finds one."""
    budget = SpeculationBudget(capacity=8)
    budget.grant("lg", 0, 0.1)  # a caller that has not shown a hit rate yet
    granted = budget.grant("tot", 8, 1.0, 0.05)
    budget.started("tot", granted)
    assert granted < 8
    for _ in range(5):
        assert budget.grant("tot", 8, 1.0, 0.05) == 0  # no slot past its share
    assert budget.grant("lg", 1, 0.1, 0.05) == 1
