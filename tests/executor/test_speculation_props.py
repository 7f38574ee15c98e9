"""Property tests of the speculative executor over random schedules.

Every example draws a backend seed (texts, lengths, scores), an executor seed, and two pure
latency functions (generation latency per request id, reward latency per batch) of a few
milliseconds at most, so arrival orders of thoughts and rewards are arbitrary. What must hold
in every schedule:

- equivalence: with strict EP and no full-score shortcut, every mode commits exactly the
  baseline's expansions, nodes (ids, texts, rewards) and answer;
- tools: a non-speculable tool never runs on a speculative branch nor on one that ends
  cancelled, and runs exactly once on every committed branch (the baseline's calls);
- no leaks: after every query, cancelled or timed out or not, nothing is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spec_helpers import (
    MODES,
    POLICIES,
    SPEC_MODES,
    LatencyBackend,
    ToolRecorder,
    TreeRegistry,
    committed,
    fingerprint,
    inputs,
    latency_fn,
    make_app,
    tick_fn,
    toy_graph,
)

from spec_tot.adapters.scripted import ScriptedConfig
from spec_tot.tree import NodeStatus


def examples(n: int) -> settings:
    """Few, fast examples (each runs real but millisecond-scale schedules)."""
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )


@st.composite
def schedules(draw: st.DrawFn) -> dict[str, Any]:
    """A workload and an arbitrary (but reproducible) schedule for it."""
    return {
        "seed": draw(st.integers(0, 10_000)),
        "exec_seed": draw(st.integers(0, 3)),
        "straggler_rate": draw(st.sampled_from([0.0, 0.2, 0.5])),
        "mean_tokens": draw(st.integers(2, 24)),
        "gen_seed": draw(st.integers(0, 10_000)),
        "reward_seed": draw(st.integers(0, 10_000)),
        # "ticks": a virtual clock (exactly reproducible, free); "ms": real sleeps
        "clock": draw(st.sampled_from(["ticks", "ticks", "ms"])),
        "gen_max": draw(st.sampled_from([0, 3, 12, 40])),
        "reward_max": draw(st.sampled_from([0, 1, 4])),
        # 3: rewards in {0, 0.5, 1}, so ties are everywhere
        "score_levels": draw(st.sampled_from([0, 3, 3])),
    }


def backend_for(s: dict[str, Any], **extra: Any) -> LatencyBackend:
    config = ScriptedConfig(
        seed=s["seed"],
        straggler_rate=s["straggler_rate"],
        mean_tokens=s["mean_tokens"],
        score_levels=s.get("score_levels", 0),
        **extra,
    )
    if s["clock"] == "ticks":
        gen, reward = (
            tick_fn(s["gen_seed"], s["gen_max"]),
            tick_fn(s["reward_seed"], s["reward_max"]),
        )
    else:  # the same shapes in milliseconds (at most 4 ms a request, 0.4 ms a reward batch)
        gen = latency_fn(s["gen_seed"], s["gen_max"] / 10)
        reward = latency_fn(s["reward_seed"], s["reward_max"] / 10)
    return LatencyBackend(config, gen_latency=gen, reward_latency=reward)


async def run_mode(
    s: dict[str, Any],
    policy: str,
    mode: str,
    *,
    mixed: bool = False,
    reward_dependent: bool = False,
    queries: int = 2,
) -> tuple[list[Any], Any, LatencyBackend]:
    backend = backend_for(s)
    graph = toy_graph(mixed=mixed, reward_dependent=reward_dependent)
    app = make_app(backend, policy, mode, graph=graph, seed=s["exec_seed"])
    batch = await app.arun_batch(inputs(*(f"q{i}" for i in range(queries))))
    assert backend.num_inflight == 0, backend.inflight_ids()
    return batch.results, batch.metrics, backend


# -- 1. equivalence --------------------------------------------------------------------------
@pytest.mark.parametrize("policy", list(POLICIES))
@examples(10)
@given(s=schedules(), shape=st.sampled_from(["plain", "mixed", "reward_dependent"]))
def test_every_mode_commits_the_baseline_search(policy: str, s: dict[str, Any], shape: str) -> None:
    """``reward_dependent``: routes and prompts read the reward, so walks ahead on a
    provisional reward often turn out wrong (children generated again or detached)."""
    graph = {"mixed": shape == "mixed", "reward_dependent": shape == "reward_dependent"}

    async def main() -> None:
        base, _, _ = await run_mode(s, policy, "baseline", **graph)
        expected = [fingerprint(r) for r in base]
        assert all(r.status == "ok" for r in base)
        for mode in SPEC_MODES:
            results, metrics, _ = await run_mode(s, policy, mode, **graph)
            for want, got in zip(expected, (fingerprint(r) for r in results), strict=True):
                assert got.expansions == want.expansions, mode
                assert got.nodes == want.nodes, mode
                assert (got.answer, got.answer_node, got.score) == (
                    want.answer,
                    want.answer_node,
                    want.score,
                ), mode
                assert got.status == want.status, mode
            assert 0.0 <= metrics.spec_hit_rate <= 1.0
            for result in results:
                for node in result.tree.nodes():
                    # nothing is left half-done: every node ends in a final status
                    assert node.status.final, (mode, node.id, node.status)
                    if node.speculative:
                        assert node.status is NodeStatus.CANCELLED, (mode, node.id)
                    if node.status is NodeStatus.PRUNED:
                        assert not node.terminal
                        assert all(c.status is NodeStatus.CANCELLED for c in node.children)

    asyncio.run(main())


# Where speculation must happen: every policy in a speculative mode, on a schedule with
# stragglers and reward waits (the gaps speculation fills), runs ahead and adopts.
SPECULATING = {"seed": 7, "exec_seed": 1, "straggler_rate": 0.5, "mean_tokens": 12,
               "gen_seed": 3, "reward_seed": 4, "clock": "ticks", "gen_max": 12,
               "reward_max": 4, "score_levels": 3}  # fmt: skip


@pytest.mark.parametrize("mode", ["spex", "full"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_speculation_happens_where_it_should(policy: str, mode: str) -> None:
    """The equivalence above would also hold if speculation never ran: here it must."""

    async def main() -> tuple[Any, Any]:
        base, _, _ = await run_mode(SPECULATING, policy, "baseline", queries=4)
        results, metrics, _ = await run_mode(SPECULATING, policy, mode, queries=4)
        assert [fingerprint(r) for r in results] == [fingerprint(r) for r in base]
        return metrics, results

    metrics, _ = asyncio.run(main())
    assert metrics.speculative_nodes > 0, policy
    assert metrics.speculative_hits > 0, policy


# -- 2. tool nodes ---------------------------------------------------------------------------
TOOL_POLICIES = ["beam", "dvts", "rebase", "tot_bfs", "mcts", "tot_dfs", "best_of_n"]


async def run_with_tools(
    s: dict[str, Any], policy: str, mode: str, *, before: bool, after: bool, pure: bool
) -> tuple[list[Any], ToolRecorder, LatencyBackend]:
    registry = TreeRegistry()
    recorder = ToolRecorder(registry)
    graph = toy_graph(
        tool_before=recorder.tool("before") if before else None,
        tool_after=recorder.tool("after") if after else None,
        pure=pure,
    )
    backend = backend_for(s)
    app = make_app(backend, policy, mode, graph=graph, seed=s["exec_seed"])
    with registry.installed():
        batch = await app.arun_batch(inputs("q0", "q1"))
    assert backend.num_inflight == 0, backend.inflight_ids()
    return batch.results, recorder, backend


@examples(12)
@given(
    s=schedules(),
    policy=st.sampled_from(TOOL_POLICIES),
    where=st.sampled_from(["before", "after", "both"]),
)
def test_side_effecting_tools_run_once_and_only_on_committed_branches(
    s: dict[str, Any], policy: str, where: str
) -> None:
    before, after = where in ("before", "both"), where in ("after", "both")

    async def main() -> None:
        expected: set[tuple[str, str]] | None = None
        for mode in MODES:
            results, rec, _ = await run_with_tools(
                s, policy, mode, before=before, after=after, pure=False
            )
            assert all(r.status == "ok" for r in results), mode
            nodes = {n.id: n for r in results for n in r.tree.nodes()}
            for call in rec.calls:
                assert not call.speculative, (mode, call)
                assert call.status is not NodeStatus.CANCELLED, (mode, call)
                final = nodes[call.node_id]
                assert not final.speculative, (mode, call)
                assert final.status is not NodeStatus.CANCELLED, (mode, call, final.status)
            calls = [(c.tool, c.node_id) for c in rec.calls]
            assert len(calls) == len(set(calls)), f"{mode}: a tool ran twice on one branch"
            # exactly once on every committed branch
            want = {
                (tool, n.id)
                for r in results
                for n in committed(r.tree)
                for tool in ("before", "after")
                if (tool == "before" and before) or (tool == "after" and after)
            }
            assert set(calls) == want, mode
            if expected is None:
                expected = want
            assert set(calls) == expected, f"{mode}: tool calls differ from the baseline"

    asyncio.run(main())


@examples(6)
@given(s=schedules(), policy=st.sampled_from(["beam", "rebase", "mcts"]))
def test_pure_speculable_tool_may_run_speculatively_without_changing_the_search(
    s: dict[str, Any], policy: str
) -> None:
    async def main() -> None:
        base, _, _ = await run_with_tools(s, policy, "baseline", before=True, after=True, pure=True)
        for mode in SPEC_MODES:
            results, rec, _ = await run_with_tools(
                s, policy, mode, before=True, after=True, pure=True
            )
            assert [fingerprint(r) for r in results] == [fingerprint(r) for r in base], mode
            calls = [(c.tool, c.node_id) for c in rec.calls]
            assert len(calls) == len(set(calls)), mode  # still at most once per branch
            done = {
                (tool, n.id)
                for r in results
                for n in committed(r.tree)
                for tool in ("before", "after")
            }
            assert done <= set(calls), mode  # every committed branch ran it (maybe early)

    asyncio.run(main())


async def test_pure_tool_runs_speculatively_in_naive_mode() -> None:
    s = {
        "seed": 1,
        "exec_seed": 0,
        "straggler_rate": 0.5,
        "mean_tokens": 12,
        "gen_seed": 3,
        "reward_seed": 4,
        "clock": "ticks",
        "gen_max": 40,
        "reward_max": 0,
    }
    _, pure_rec, _ = await run_with_tools(s, "beam", "naive", before=True, after=True, pure=True)
    assert any(c.speculative for c in pure_rec.calls)
    _, rec, _ = await run_with_tools(s, "beam", "naive", before=True, after=True, pure=False)
    assert rec.calls and not any(c.speculative for c in rec.calls)


# -- 3. no leaks under cancellation and timeouts --------------------------------------------
@examples(10)
@given(
    s=schedules(),
    mode=st.sampled_from(MODES),
    policy=st.sampled_from(["beam", "rebase", "mcts", "rstar", "tot_dfs", "best_of_n"]),
    plan=st.lists(st.one_of(st.none(), st.floats(0.0, 0.02)), min_size=2, max_size=5),
    reward_dependent=st.booleans(),
)
def test_random_cancellations_leave_nothing_in_flight_and_spare_the_rest(
    s: dict[str, Any], mode: str, policy: str, plan: list[float | None], reward_dependent: bool
) -> None:
    """``plan[i]``: None = query i runs to the end, else it is cancelled after that many
    seconds (0: before it starts). Deep speculative chains, detached and regenerated
    branches included (``reward_dependent``)."""

    async def main() -> None:
        ids = [f"q{i}" for i in range(len(plan))]
        reference, _, _ = await run_mode(
            s, policy, mode, reward_dependent=reward_dependent, queries=len(plan)
        )
        want = {r.query_id: fingerprint(r) for r in reference}

        backend = backend_for(s)
        graph = toy_graph(reward_dependent=reward_dependent)
        app = make_app(backend, policy, mode, graph=graph, seed=s["exec_seed"])
        tasks = {qid: asyncio.create_task(app.arun_batch(inputs(qid)), name=qid) for qid in ids}

        async def cancel_later(qid: str, delay: float) -> None:
            await asyncio.sleep(delay)
            tasks[qid].cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tasks[qid]
            # a cancelled query leaves none of its requests behind, at once
            assert not [r for r in backend.inflight_ids() if r.split("/")[0] == qid]

        cancels = [cancel_later(q, d) for q, d in zip(ids, plan, strict=True) if d is not None]
        await asyncio.gather(*cancels)
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for qid in ids:
            if tasks[qid].cancelled():
                continue
            # never cancelled, or finished before its cancellation came: the same search
            got = tasks[qid].result().results[0]
            assert got.status == "ok"
            assert fingerprint(got) == want[qid]
        assert backend.num_inflight == 0
        assert backend.inflight_ids() == []

    asyncio.run(main())


@examples(8)
@given(s=schedules(), mode=st.sampled_from(MODES), victim=st.sampled_from(["q1/0", "q1/2", "q1"]))
def test_hanging_requests_time_out_alone_and_leave_nothing_in_flight(
    s: dict[str, Any], mode: str, victim: str
) -> None:
    async def main() -> None:
        reference, _, _ = await run_mode(s, "beam", mode, queries=3)
        want = {r.query_id: fingerprint(r) for r in reference}
        backend = backend_for(s, hang_prefixes=(victim,))
        # generous: the innocent queries must finish in time even on a loaded machine
        app = make_app(backend, "beam", mode, seed=s["exec_seed"], query_timeout_s=0.8)
        batch = await app.arun_batch(inputs("q0", "q1", "q2"))
        by_id = {r.query_id: r for r in batch.results}
        assert by_id["q1"].status == "timeout"
        for qid in ("q0", "q2"):
            assert by_id[qid].status == "ok"
            assert fingerprint(by_id[qid]) == want[qid]
        assert backend.num_inflight == 0
        assert backend.inflight_ids() == []
        assert backend.num_aborted >= 1
        assert batch.metrics.cancelled == 1

    asyncio.run(main())


@examples(6)
@given(s=schedules(), mode=st.sampled_from(SPEC_MODES), delay=st.floats(0.0, 0.03))
def test_cancelling_a_whole_batch_leaves_nothing_in_flight(
    s: dict[str, Any], mode: str, delay: float
) -> None:
    async def main() -> None:
        backend = backend_for(s)
        app = make_app(backend, "rebase", mode, seed=s["exec_seed"])
        task = asyncio.create_task(app.arun_batch(inputs("q0", "q1", "q2")))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert backend.num_inflight == 0, backend.inflight_ids()

    asyncio.run(main())
