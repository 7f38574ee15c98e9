"""A side-effecting LangChain tool runs only on committed branches: never on a speculative
branch, never on a cancelled one, in every mode and under random schedules."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.tools import tool

from spec_tot.adapters.langchain import add_tool, tool_node
from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.config import MODES, ExecutorConfig
from spec_tot.graph import END, START, ThoughtGraph
from spec_tot.graphs.toy import build_toy_graph
from spec_tot.tree import NodeStatus


def _graph(log: list[tuple[str, ...]], *, pure: bool = False) -> ThoughtGraph:
    @tool
    def record(trace: str) -> str:
        """Append a trace to the side-effect log."""
        log.append(tuple(trace.split("\n")))
        return "logged"

    graph = ThoughtGraph()
    toy = build_toy_graph()
    propose = toy.nodes["propose"]
    assert propose.prompt is not None
    graph.add_thought("propose", propose.prompt, sampling=propose.sampling)
    add_tool(
        graph,
        "record",
        record,
        args=lambda s: {"trace": "\n".join([s["question"], *s["steps"]])},
        pure=pure,
    )
    graph.add_reward("score")
    graph.add_edge(START, "propose")
    graph.add_edge("propose", "record")
    graph.add_edge("record", "score")
    route = toy.branches["score"]
    graph.add_conditional_edges("score", route.router, {"more": "propose", "done": END})
    return graph


def _run(mode: str, cfg: ScriptedConfig, queries: int) -> tuple[Any, list[tuple[str, ...]]]:
    log: list[tuple[str, ...]] = []
    backend = ScriptedBackend(cfg)
    app = _graph(log).compile(
        backend=backend,
        search="beam",
        search_params={"n": 4, "width": 2},
        config=ExecutorConfig(mode=mode),
    )
    batch = app.run_batch([f"toy puzzle {i}" for i in range(queries)])
    assert backend.num_inflight == 0
    return batch, log


def _check(results: list[Any], log: list[tuple[str, ...]]) -> None:
    """Each call is the branch of a node that was committed when it ran (never adopted
    speculative nodes keep ``speculative``, cancelled ones too), at most once; every
    committed node that got its reward was called."""
    committed: Counter[tuple[str, ...]] = Counter()
    scored: set[tuple[str, ...]] = set()
    for result in results:
        for node in result.tree.nodes():
            if node.parent is None or node.speculative:
                continue
            key = (result.tree.question, *node.steps())
            committed[key] += 1
            if node.status in (NodeStatus.SCORED, NodeStatus.PRUNED):
                scored.add(key)
    calls = Counter(log)
    assert not calls - committed, "the tool ran on a speculative or cancelled branch"
    assert scored <= set(calls), "a committed branch skipped its tool"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(sorted(MODES)),
    seed=st.integers(0, 1000),
    straggler_rate=st.sampled_from([0.0, 0.3, 0.6]),
    latency=st.sampled_from([0.0, 0.0005]),
)
def test_side_effecting_tool_only_on_committed_branches(
    mode: str, seed: int, straggler_rate: float, latency: float
) -> None:
    cfg = ScriptedConfig(seed=seed, straggler_rate=straggler_rate, token_latency_s=latency)
    batch, log = _run(mode, cfg, queries=2)
    _check(batch.results, log)


def test_every_mode_once_with_stragglers() -> None:
    cfg = ScriptedConfig(straggler_rate=0.4, token_latency_s=0.0005)
    for mode in sorted(MODES):
        batch, log = _run(mode, cfg, queries=3)
        _check(batch.results, log)
        if MODES[mode].speculate != "off":  # speculation happened, the tool never saw it
            assert batch.metrics.wasted_tokens > 0 or batch.metrics.spec_hit_rate > 0, mode


def test_tool_node_writes_its_result_and_pure_tools_may_speculate() -> None:
    @tool
    def double(x: int) -> int:
        """Double x."""
        return 2 * x

    fn = tool_node(double, args=lambda s: {"x": s["x"]}, result_key="y")
    import asyncio

    assert asyncio.run(fn({"x": 4})) == {"y": 8}
    graph = _graph([], pure=True)
    node = graph.nodes["record"]
    assert node.speculable and node.pure
    assert not _graph([]).nodes["record"].speculable
