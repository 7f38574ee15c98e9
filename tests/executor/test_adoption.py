"""SPEX adoption (``executor/controller.py``): an adopted speculative node is the baseline's
node, hits and wasted tokens are counted, failures change nothing, naive continues every
finished candidate. Property tests over random schedules: ``test_speculation_props.py``."""

from __future__ import annotations

from typing import Any

import pytest
from spec_helpers import (
    SPEC_MODES,
    LatencyBackend,
    fingerprint,
    inputs,
    make_app,
    run_two,
    tick_fn,
)

from spec_tot.adapters.scripted import ScriptedConfig

BEAM6 = {"n": 6, "width": 2, "max_depth": 6}  # k = 3
TOT_BFS = {"breadth": 3, "width": 3, "max_depth": 4}  # k = 3


@pytest.mark.parametrize("mode", ["naive", "spex"])
async def test_adopted_speculative_nodes_are_the_baseline_nodes(mode: str) -> None:
    adopted_total = 0
    for seed in range(3):
        base, base_backend = await run_two("beam", "baseline", seed, params=BEAM6)
        got, backend = await run_two("beam", mode, seed, params=BEAM6)
        base_nodes = {n.id: n for r in base.results for n in r.tree.nodes()}
        base_requests = {r.request_id: r for r in base_backend.requests}
        final = {n.id: n for r in got.results for n in r.tree.nodes()}
        adopted = [
            r for r in backend.requests if r.speculative and not final[r.request_id].speculative
        ]
        adopted_total += len(adopted)
        for request in adopted:
            node, twin = final[request.request_id], base_nodes[request.request_id]
            assert (node.text, node.reward, node.terminal) == (
                twin.text,
                twin.reward,
                twin.terminal,
            )
            # the very same request the baseline sent, apart from its priority class
            same = base_requests[request.request_id]
            assert (request.prompt, request.sampling) == (same.prompt, same.sampling)
        assert got.metrics.speculative_hits >= len({r.request_id for r in adopted})
    assert adopted_total > 0


@pytest.mark.parametrize("mode", SPEC_MODES)
async def test_hit_rate_and_wasted_tokens(mode: str) -> None:
    base, _ = await run_two("rebase", "baseline", 0)
    got, _ = await run_two("rebase", mode, 0)
    assert base.metrics.wasted_tokens == 0
    assert base.metrics.speculative_nodes == 0 and base.metrics.spec_hit_rate == 0.0
    m = got.metrics
    assert 0.0 <= m.spec_hit_rate <= 1.0
    assert m.speculative_hits <= m.speculative_nodes
    if mode in ("naive", "spex"):
        assert m.spec_hit_rate > 0
    if mode == "naive":
        assert m.wasted_tokens > 0
    assert m.wasted_tokens <= m.output_tokens


@pytest.mark.parametrize("mode", ["naive", "spex"])
async def test_deterministic_failures_do_not_change_the_search(mode: str) -> None:
    """Repro (deterministic, virtual clock): scripted seed 2, beam n=4 width=2 max_depth 5,
    fail_prefixes = the first child of every root child, generation latency tick_fn(1, 5).
    Baseline commits q0/x/0 (failed) + q0/x/1 for each selected x; naive/spex commit
    q0/x/1 + q0/x/2 (q0/x/2 does not exist in the baseline) and the later rounds differ."""
    fail = ("q0/0/0", "q0/1/0", "q0/2/0", "q0/3/0")

    async def one(mode: str) -> Any:
        backend = LatencyBackend(
            ScriptedConfig(seed=2, fail_prefixes=fail), tick_fn(1, 5), tick_fn(2, 0)
        )
        app = make_app(backend, "beam", mode, params={"n": 4, "width": 2, "max_depth": 5})
        return (await app.arun_batch(inputs("q0"))).results[0]

    base, got = await one("baseline"), await one(mode)
    assert set(fingerprint(got).nodes) == set(fingerprint(base).nodes)
    assert fingerprint(got) == fingerprint(base)


async def test_naive_continues_every_finished_candidate_not_just_the_predicted_ones() -> None:
    counts = {}
    for speculate in ("all", "ranked"):
        backend = LatencyBackend(
            ScriptedConfig(), gen_latency=tick_fn(3, 30), reward_latency=tick_fn(4, 5)
        )
        app = make_app(backend, "beam", "naive", speculation_overrides={"speculate": speculate})
        batch = await app.arun_batch(inputs("a", "b", "c"))
        counts[speculate] = batch.metrics.speculative_nodes
    assert counts["all"] > counts["ranked"]
