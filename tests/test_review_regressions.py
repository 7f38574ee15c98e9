"""Regressions for bugs a review found in the executor: each of these once hung a query,
failed an innocent query, or let a tool act after its query had ended."""

from __future__ import annotations

import asyncio

import pytest
from spec_helpers import LatencyBackend, OneRuleRouter, fingerprint, inputs, make_app, tick_fn

from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.config import ExecutorConfig, LazyVerification
from spec_tot.errors import ConfigError
from spec_tot.graph import END, START, GraphNode, NodeKind, ThoughtGraph
from spec_tot.graphs.toy import _answer, _prompt, _route
from spec_tot.nodes import default_reward_item


async def test_full_score_shortcut_never_hangs_on_unstarted_branches() -> None:
    backend = LatencyBackend(
        ScriptedConfig(), gen_latency=tick_fn(14, 30), reward_latency=tick_fn(1014, 20)
    )
    overrides = {
        "ep": True,
        "ep_full_score": True,
        "full_score": 0.0,  # every score is "full": the shortcut fires on every round
        "max_speculative_per_query": 2,
    }
    app = make_app(backend, "beam", "naive", query_timeout_s=5.0, speculation_overrides=overrides)
    result = (await app.arun_batch(inputs("a"))).results[0]
    assert result.status == "ok"
    assert backend.num_inflight == 0


def test_router_loop_without_a_path_map_fails_the_query_instead_of_spinning() -> None:
    graph = ThoughtGraph()
    graph.add_thought("t", _prompt)
    graph.add_function("f", lambda s: {"n": s.get("n", 0) + 1})
    graph.add_reward("r")
    graph.add_edge(START, "t")
    graph.add_edge("t", "f")
    graph.add_conditional_edges("f", lambda s: "f" if s["n"] > 0 else "r")  # loops on f
    graph.add_conditional_edges("r", _route, {"more": "t", "done": END})
    app = graph.compile(
        backend=ScriptedBackend(),
        search="beam",
        search_params={"n": 2, "width": 1},
        answer=_answer,
        config=ExecutorConfig(query_timeout_s=5.0),
    )
    result = app.run_batch(["q"]).results[0]
    assert result.status == "failed"
    assert any("'f' is on a loop" in e for e in result.errors)


def test_a_reward_input_that_breaks_token_counting_fails_only_its_branches() -> None:
    graph = ThoughtGraph()
    graph.add_thought("t", _prompt)
    graph.add_reward(
        "r",
        reward_input=lambda s: (
            None if s["steps"][-1].endswith("1") else s["question"],
            tuple(s["steps"]),
        ),
    )
    graph.add_edge(START, "t")
    graph.add_edge("t", "r")
    graph.add_conditional_edges("r", _route, {"more": "t", "done": END})
    app = graph.compile(
        backend=ScriptedBackend(),
        search="beam",
        search_params={"n": 4, "width": 2},
        answer=_answer,
        config=ExecutorConfig(query_timeout_s=5.0),
    )
    result = app.run_batch(["q"]).results[0]
    assert result.status in ("ok", "failed")  # never "timeout": the round still completes


@pytest.mark.parametrize(
    "override", [{"lv": "fast"}, {"lv": {"bogus": 1}}, {"tau": "1"}, {"et_alpha": float("nan")}]
)
def test_bad_switch_values_are_config_errors(override: dict) -> None:
    with pytest.raises(ConfigError):
        ExecutorConfig(mode="full", speculation_overrides=override)


@pytest.mark.parametrize("mode", ["naive", "specscale", "full"])
async def test_one_querys_reward_failure_leaves_the_other_query_alone(mode: str) -> None:
    alone = (
        await make_app(LatencyBackend(ScriptedConfig()), "beam", mode).arun_batch(inputs("a"))
    ).results[0]
    backend = LatencyBackend(ScriptedConfig(fail_reward_questions=("puzzle b",)))
    mixed = {
        r.query_id: r
        for r in (await make_app(backend, "beam", mode).arun_batch(inputs("a", "b"))).results
    }
    assert mixed["a"].status == "ok" and not mixed["a"].errors
    assert fingerprint(mixed["a"]) == fingerprint(alone)
    assert mixed["b"].errors


async def test_lazy_verification_does_not_flush_on_a_group_already_being_scored() -> None:
    calls: list[list[str]] = []
    release = asyncio.Event()  # A's batch stays in flight until the check is done

    async def scorer(items: list) -> list[float]:
        calls.append([i.request_id for i in items])
        await release.wait()
        return [0.5] * len(items)

    node = GraphNode("r", NodeKind.REWARD, scorer=scorer, reward_input=default_reward_item)
    lv = LazyVerification(token_threshold=10_000, max_deferrals=1000, max_wait_s=5.0)
    router = OneRuleRouter(lv)
    state = {"question": "q", "steps": ["s"]}
    for i in range(2):
        router.expect("A", f"A/{i}")
    for i in range(3):
        router.expect("B", f"B/{i}")

    def score(query: str, node_id: str) -> asyncio.Task[tuple[float, ...]]:
        item, scorer = router.prepare(query, node_id, node, state)
        return asyncio.create_task(
            router.score(query, item, scorer, speculative=False, node_name="r")
        )

    a = [score("A", f"A/{i}") for i in range(2)]
    for _ in range(200):  # A's complete group is sent at once
        if calls:
            break
        await asyncio.sleep(0.005)
    b = score("B", "B/0")
    await asyncio.sleep(0.03)  # room for a wrong flush of B/0 to happen
    assert calls == [["A/0", "A/1"]]  # B/0 waits for its own group (or the timer)
    router.forget("B")
    release.set()
    await asyncio.gather(*a, b, return_exceptions=True)


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
