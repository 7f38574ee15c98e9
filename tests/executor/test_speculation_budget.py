"""The dispatcher at run time (``executor/dispatcher.py``; its own rules in
``test_dispatcher.py``): speculation stays within the backend's room, and the room bounds
speculative generation, not branches waiting for rewards."""

from __future__ import annotations

from typing import Any

import pytest
from spec_helpers import (
    LatencyBackend,
    inputs,
    make_app,
    tick_fn,
)

from spec_tot.adapters.scripted import ScriptedConfig
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


class _SlotCountingBackend(LatencyBackend):
    """Saturation batch 3; records the most speculative generations in flight at once."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.speculative_now = self.peak_speculative = self.speculative_total = 0

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="slots", saturation_batch=3, max_running_requests=64)

    async def generate(self, request: Any) -> Any:
        if not request.speculative:
            return await super().generate(request)
        self.speculative_now += 1
        self.speculative_total += 1
        self.peak_speculative = max(self.peak_speculative, self.speculative_now)
        try:
            return await super().generate(request)
        finally:
            self.speculative_now -= 1


@pytest.mark.parametrize("policy", ["beam", "mcts"])
async def test_t2_bounds_speculative_generation_not_branches_waiting_for_rewards(
    policy: str,
) -> None:
    """T2's room is engine capacity: a speculative branch holds a slot while it generates,
    and gives it back while it waits for its (slow) reward."""
    backend = _SlotCountingBackend(ScriptedConfig(seed=0, depth=4), tick_fn(0, 4), tick_fn(1, 30))
    app = make_app(backend, policy, "full")
    batch = await app.arun_batch(inputs("q0", "q1"))
    assert all(r.status == "ok" for r in batch.results)
    assert backend.num_inflight == 0
    assert backend.speculative_total > 0
    # committed work may already fill the 3 slots; speculation never adds past the room
    assert backend.peak_speculative <= 3
