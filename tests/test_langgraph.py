"""LangGraph interop: ``from_langgraph`` answers as LangGraph's own runtime does (baseline),
full mode is measured against it, ToTApp works as a node of a StateGraph, events stream."""

from __future__ import annotations

import importlib.util
import operator
import sys
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

import spec_tot
from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.errors import ConfigError, GraphValidationError
from spec_tot.graphs.toy import compile_toy

_PATH = Path(__file__).resolve().parents[1] / "examples" / "langgraph_tot.py"
_SPEC = importlib.util.spec_from_file_location("langgraph_tot_example", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
lg_example = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = lg_example
_SPEC.loader.exec_module(lg_example)

QUESTIONS = [f"puzzle {i}" for i in range(5)]


def _app(backend: ScriptedBackend, mode: str = "baseline", **kw: Any) -> spec_tot.ToTApp:
    return spec_tot.from_langgraph(
        lg_example.build_state_graph(backend, n=kw.pop("n", 8), width=kw.pop("width", 2)),
        backend=backend,
        search="beam",
        search_params={"n": 8, "width": 2, "max_depth": 3},
        config=spec_tot.ExecutorConfig(mode=mode, **kw),
    )


@pytest.mark.parametrize("seed", [0, 7])
async def test_baseline_answers_equal_langgraph_runtime(seed: int) -> None:
    cfg = ScriptedConfig(seed=seed, p_correct=0.3, choices=("24", "23", "25", "12", "1"))
    graph = lg_example.build_state_graph(ScriptedBackend(cfg)).compile()
    finals = [
        await graph.ainvoke({"question": q, "query_id": f"p{i}"}, {"recursion_limit": 100})
        for i, q in enumerate(QUESTIONS)
    ]
    batch = await _app(ScriptedBackend(cfg)).arun_batch(
        [{"question": q, "query_id": f"p{i}"} for i, q in enumerate(QUESTIONS)]
    )
    assert [lg_example.langgraph_answer(f) for f in finals] == [r.answer for r in batch.results]
    for final, result in zip(finals, batch.results, strict=True):
        theirs = sorted((c["id"], c["score"]) for c in final["finished"])
        ours = sorted((n.id, n.reward) for n in result.tree.terminals())
        assert theirs == ours  # the same finished traces with the same scores


async def test_full_mode_is_measured_against_baseline_and_langgraph() -> None:
    slow = ScriptedConfig(token_latency_s=0.002, straggler_rate=0.3, p_correct=0.3, depth=5)
    shape = {"n": 4, "width": 2, "max_depth": 5}
    qs = [f"q {i}" for i in range(8)]
    timings: dict[str, float] = {}
    answers: dict[str, list[Any]] = {}
    for name in ("langgraph", "baseline", "full"):
        backend = ScriptedBackend(slow)
        started = time.perf_counter()
        if name == "langgraph":
            answers[name] = await lg_example.run_langgraph(backend, qs, **shape)
        else:
            answers[name], _ = await lg_example.run_spec_tot(backend, qs, name, **shape)
        timings[name] = time.perf_counter() - started
        assert backend.num_inflight == 0
    assert answers["langgraph"] == answers["baseline"] == answers["full"]
    print(
        f"\nwall s: langgraph {timings['langgraph']:.3f}, baseline {timings['baseline']:.3f}, "
        f"full {timings['full']:.3f}; full/baseline speedup "
        f"{timings['baseline'] / timings['full']:.2f}x, full/langgraph "
        f"{timings['langgraph'] / timings['full']:.2f}x"
    )


# -- a direct ThoughtGraph shape: thought -> function -> tool -> reward -> router ----------
class Flat(TypedDict, total=False):
    question: str
    steps: Annotated[list[str], operator.add]
    notes: list[str]


def _flat_graph(log: list[str]) -> StateGraph[Any, Any, Any, Any]:
    def note(state: dict[str, Any]) -> dict[str, Any]:
        return {"notes": [*state.get("notes", []), f"n{len(state['steps'])}"]}

    def tool(state: dict[str, Any]) -> dict[str, Any]:
        log.append(state["steps"][-1])
        return {}

    def route(state: dict[str, Any]) -> str:
        return "done" if state["steps"][-1].startswith("answer: ") else "more"

    b = StateGraph(Flat)
    prompt = lg_example.prompt
    b.add_node(
        "propose", lambda s: {}, metadata={"spec_tot": {"kind": "thought", "prompt": prompt}}
    )
    b.add_node("note", note, metadata={"spec_tot": {"kind": "function"}})
    b.add_node("log", tool, metadata={"spec_tot": {"kind": "tool"}})
    b.add_node("score", lambda s: {}, metadata={"spec_tot": {"kind": "reward"}})
    b.add_edge(START, "propose")
    b.add_edge("propose", "note")
    b.add_edge("note", "log")
    b.add_edge("log", "score")
    b.add_conditional_edges("score", route, {"more": "propose", "done": END})
    return b


@pytest.mark.parametrize("mode", ["baseline", "full"])
async def test_direct_shape_runs_node_functions_and_matches_toy(mode: str) -> None:
    log: list[str] = []
    params = {"search": "beam", "search_params": {"n": 4, "width": 2}}
    cfg = spec_tot.ExecutorConfig(mode=mode)
    app = spec_tot.from_langgraph(
        _flat_graph(log).compile(), backend=ScriptedBackend(), config=cfg, **params
    )
    ours = await app.ainvoke("toy puzzle 0")
    toy = await compile_toy(backend=ScriptedBackend(), config=cfg, **params).ainvoke("toy puzzle 0")
    assert ours.tree.terminals()[0].state["notes"]  # the function node ran per branch
    assert [n.text for n in ours.tree.terminals()] == [n.text for n in toy.tree.terminals()]
    committed = {n.text for n in ours.tree.nodes() if n.parent and not n.speculative}
    assert log and set(log) <= committed  # the tool saw committed branches only


def _node(b: StateGraph[Any, Any, Any, Any], name: str, spec: dict[str, Any] | None) -> None:
    b.add_node(name, lambda s: {}, metadata={"spec_tot": spec} if spec else None)


@pytest.mark.parametrize(
    ("specs", "node", "words"),
    [
        ({"score": None}, "score", "no metadata"),
        ({"score": {"kind": "judge"}}, "score", "not one of"),
        ({"score": {"kind": "reward", "colour": 1}}, "score", "unknown reward metadata"),
        ({"expand": {"kind": "thought"}}, "expand", "needs prompt"),
        ({"expand": {"kind": "thought", "prompt": str, "speculable": False}}, "expand", "baseline"),
        ({"prune": {"kind": "select"}}, "prune", "terminal"),
        ({"score": {"kind": "function"}}, "prune", "from a reward node"),
    ],
)
def test_unsupported_shapes_name_the_node(specs: dict[str, Any], node: str, words: str) -> None:
    b = StateGraph(Flat)
    base: dict[str, Any] = {
        "expand": {"kind": "thought", "prompt": lg_example.prompt},
        "score": {"kind": "reward"},
        "prune": {"kind": "select", "terminal": lg_example.is_answer},
    }
    for name, spec in {**base, **specs}.items():
        _node(b, name, spec)
    b.add_edge(START, "expand")
    b.add_edge("expand", "score")
    b.add_edge("score", "prune")
    b.add_conditional_edges("prune", lambda s: END, ["expand", END])
    with pytest.raises(GraphValidationError) as info:
        spec_tot.from_langgraph(b, backend=ScriptedBackend())
    assert info.value.node == node and words in str(info.value)


def test_joins_and_non_graphs_are_refused() -> None:
    b = StateGraph(Flat)
    _node(b, "a", {"kind": "thought", "prompt": lg_example.prompt})
    _node(b, "c", {"kind": "reward"})
    _node(b, "d", {"kind": "function"})
    b.add_edge(START, "a")
    b.add_edge(["a", "d"], "c")
    with pytest.raises(GraphValidationError, match="joins"):
        spec_tot.from_langgraph(b, backend=ScriptedBackend())
    with pytest.raises(ConfigError, match="StateGraph"):
        spec_tot.from_langgraph(object(), backend=ScriptedBackend())


# -- ToTApp inside LangGraph, events ---------------------------------------------------------
class Outer(TypedDict, total=False):
    question: str
    query_id: str
    answer: str | None
    score: float | None


def _outer(app: spec_tot.ToTApp) -> Any:
    b = StateGraph(Outer)
    b.add_node("tot", app | (lambda r: {"answer": r.answer, "score": r.score}))
    b.add_edge(START, "tot")
    b.add_edge("tot", END)
    return b.compile()


async def test_app_is_a_node_of_a_state_graph_and_streams_events() -> None:
    app = compile_toy(
        backend=ScriptedBackend(),
        search="beam",
        search_params={"n": 4, "width": 2},
        config=spec_tot.ExecutorConfig(mode="full"),
    )
    outer = _outer(app)
    direct = await app.ainvoke({"question": "toy puzzle 3", "query_id": "d"})
    out = await outer.ainvoke({"question": "toy puzzle 3", "query_id": "d"})
    assert out["answer"] == direct.answer and out["score"] == direct.score
    names = [
        e["name"]
        async for e in outer.astream_events({"question": "toy puzzle 3"}, version="v2")
        if e["event"] == "on_custom_event"
    ]
    assert {"expanded", "scored", "answer"} <= set(names)
    custom = [c async for c in outer.astream({"question": "toy puzzle 3"}, stream_mode="custom")]
    assert custom and custom[-1]["event"] == "answer"


# -- Runnable: events, callbacks, RunnableConfig ------------------------------------------------
def _toy(mode: str = "full", backend: ScriptedBackend | None = None) -> spec_tot.ToTApp:
    return compile_toy(
        backend=backend
        or ScriptedBackend(ScriptedConfig(straggler_rate=0.4, token_latency_s=5e-4)),
        search="beam",
        search_params={"n": 4, "width": 2},
        config=spec_tot.ExecutorConfig(mode=mode),
    )


async def test_astream_events_v2_shows_search_events() -> None:
    app = _toy()
    events = [e async for e in app.astream_events("toy puzzle 1", version="v2")]
    custom = [e for e in events if e["event"] == "on_custom_event"]
    kinds = {"expanded", "scored", "pruned", "speculative_hit", "cancelled", "answer"}
    assert {"expanded", "scored", "answer"} <= {e["name"] for e in custom} <= kinds
    assert events[0]["event"] == "on_chain_start" and events[0]["name"] == "ToTApp"
    assert events[-1]["event"] == "on_chain_end"
    assert events[-1]["data"]["output"].answer == custom[-1]["data"]["text"]
    assert all(e["run_id"] == events[0]["run_id"] for e in custom)  # under the app's run
    chunks = [c async for c in app.astream("toy puzzle 1")]
    assert len(chunks) == 1 and isinstance(chunks[0], spec_tot.ToTResult)


def test_sync_stream_yields_the_result() -> None:
    assert [r.status for r in _toy().stream("toy puzzle 1")] == ["ok"]


async def test_callbacks_tags_metadata_and_configurable() -> None:
    from langchain_core.callbacks import AsyncCallbackHandler

    class Spy(AsyncCallbackHandler):
        def __init__(self) -> None:
            self.custom: list[tuple[str, Any, Any]] = []
            self.chains: list[Any] = []

        async def on_custom_event(self, name: str, data: Any, **kw: Any) -> None:
            self.custom.append((name, kw.get("tags"), kw.get("metadata")))

        async def on_chain_start(self, serialized: Any, inputs: Any, **kw: Any) -> None:
            self.chains.append(kw.get("name"))

    spy = Spy()
    app = _toy(mode="baseline")
    config: Any = {
        "callbacks": [spy],
        "tags": ["t1"],
        "metadata": {"who": "me"},
        "run_name": "tot-run",
        "configurable": {"spec_tot": {"seed": 5}},
    }
    result = await app.ainvoke({"question": "toy puzzle 2", "query_id": "c"}, config)
    assert spy.chains == ["tot-run"]
    assert spy.custom and all(t == ["t1"] and m["who"] == "me" for _, t, m in spy.custom)
    reseeded = compile_toy(
        backend=ScriptedBackend(),
        search="beam",
        search_params={"n": 4, "width": 2},
        config=spec_tot.ExecutorConfig(seed=5),
    )
    expected = await reseeded.ainvoke({"question": "toy puzzle 2", "query_id": "c"})
    assert [n.text for n in result.tree.nodes()] == [n.text for n in expected.tree.nodes()]
    plain = await app.ainvoke({"question": "toy puzzle 2", "query_id": "c"})
    assert [n.text for n in plain.tree.nodes()] != [n.text for n in result.tree.nodes()]
    assert app.config.mode == "baseline"
    with pytest.raises(ConfigError, match="unknown keys"):
        await app.ainvoke("x", {"configurable": {"spec_tot": {"colour": 1}}})


async def test_recursion_limit_bounds_depth_and_max_concurrency_queries() -> None:
    app = _toy(mode="baseline")
    shallow = await app.ainvoke("toy puzzle 0", {"recursion_limit": 1})
    assert max(n.depth for n in shallow.tree.nodes()) == 1 and shallow.answer is None
    deep = await app.ainvoke("toy puzzle 0")
    assert max(n.depth for n in deep.tree.nodes()) == 3
    backend = ScriptedBackend(ScriptedConfig(token_latency_s=0.001))
    results = await _toy("baseline", backend).abatch(
        [f"toy puzzle {i}" for i in range(4)], {"max_concurrency": 1}
    )
    assert all(r.status == "ok" for r in results) and backend.peak_inflight <= 4
