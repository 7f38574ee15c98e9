"""The dispatcher at run time (``executor/dispatcher.py``; its own rules in
``test_dispatcher.py``): speculation stays within the backend's room, and the room bounds
speculative generation, not branches waiting for rewards."""

from __future__ import annotations

from typing import Any

import pytest
from spec_helpers import (
    LatencyBackend,
    Saturating,
    inputs,
    make_app,
    tick_fn,
)

from spec_tot.adapters.scripted import ScriptedConfig
from spec_tot.executor.dispatcher import Dispatcher
from spec_tot.requests import Capabilities


class SmallEngine(LatencyBackend):
    """Saturates at 3 sequences: the T2 budget must keep speculation within that."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="small", saturation_batch=3)

    async def generate(self, request: Any) -> Any:
        spec = sum(1 for r in self.requests if r.speculative and r.request_id in self._inflight)
        self.peak_speculative = max(
            getattr(self, "peak_speculative", 0), spec + request.speculative
        )
        return await super().generate(request)


@pytest.mark.parametrize("mode", ["spex", "full"])
async def test_runtime_speculation_stays_within_the_global_budget(mode: str) -> None:
    for seed in range(3):
        backend = SmallEngine(
            ScriptedConfig(seed=seed, depth=4, straggler_rate=0.3),
            gen_latency=tick_fn(seed, 20),
        )
        app = make_app(backend, "rebase", mode, params={"width": 8})
        batch = await app.arun_batch(inputs("q0", "q1", "q2"))
        assert all(r.status == "ok" for r in batch.results)
        assert getattr(backend, "peak_speculative", 0) <= 3
        assert backend.num_inflight == 0


class _SlotCountingBackend(Saturating):
    """Saturation batch 3 (room for 64 running requests); records the most speculative
    generations in flight at once."""

    def __init__(self, *args: Any) -> None:
        super().__init__(3, *args)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="slots", saturation_batch=3, max_running_requests=64)


@pytest.mark.parametrize("policy", ["beam", "mcts"])
async def test_t2_bounds_speculative_generation_not_branches_waiting_for_rewards(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T2's room is engine capacity: a speculative branch holds a slot while it generates,
    and gives it back while it waits for its (slow) reward. (Every offer is worth
    launching here: the scripted backend's microsecond step times are noise to value.)"""
    monkeypatch.setattr(Dispatcher, "value", lambda self, offer, p=None: 1.0)
    backend = _SlotCountingBackend(ScriptedConfig(seed=0, depth=4), tick_fn(0, 4), tick_fn(1, 30))
    app = make_app(backend, policy, "full")
    batch = await app.arun_batch(inputs("q0", "q1"))
    assert all(r.status == "ok" for r in batch.results)
    assert backend.num_inflight == 0
    assert backend.speculative_requests > 0
    # committed work may already fill the 3 slots; speculation never adds past the room
    assert backend.peak_speculative <= 3


async def test_prediction_stops_where_offers_stop_paying(monkeypatch: pytest.MonkeyPatch) -> None:
    """MCTS candidates are computed as they are pulled (each costs simulated selections):
    the controller pulls no further than the first candidate the dispatcher would not
    launch, and predicts nothing while no offer could pay at all."""
    from spec_tot.policies.mcts import MCTS

    pulls: list[int] = []  # candidates pulled per prediction
    full: list[int] = []  # what the whole prediction would have given
    lazy = MCTS.predictions

    def counting(self: MCTS, tree: Any, budget: int) -> Any:
        full.append(len(list(lazy(self, tree, budget))))
        pulls.append(0)
        for candidate in lazy(self, tree, budget):
            pulls[-1] += 1
            yield candidate

    monkeypatch.setattr(MCTS, "predictions", counting)
    # Only a prediction's first pick (utility 1) pays.
    monkeypatch.setattr(
        Dispatcher, "value", lambda self, offer, p=None: 1.0 if offer.confidence >= 1 else -1.0
    )
    backend = LatencyBackend(ScriptedConfig(seed=1, depth=4), tick_fn(0, 4), tick_fn(1, 8))
    batch = await make_app(backend, "mcts", "full").arun_batch(inputs("q0", "q1"))
    assert all(r.status == "ok" for r in batch.results)
    assert pulls and max(pulls) <= 2 < max(full)
    assert batch.metrics.speculative_nodes > 0
    pulls.clear()
    monkeypatch.setattr(Dispatcher, "value", lambda self, offer, p=None: -1.0)
    backend = LatencyBackend(ScriptedConfig(seed=1, depth=4), tick_fn(0, 4), tick_fn(1, 8))
    batch = await make_app(backend, "mcts", "full").arun_batch(inputs("q0", "q1"))
    assert all(r.status == "ok" for r in batch.results)
    assert pulls == []  # ``could_pay`` said no before any prediction
