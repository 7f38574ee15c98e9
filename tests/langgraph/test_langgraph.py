"""Unmodified LangGraph graphs run by spec-tot: LangGraph's ToT and LATS tutorial shapes
answer as LangGraph's own runtime does (baseline: same answers and LLM calls on 20 inputs;
full: same answers), speculation is real (adopted branches) and tools never run on a
speculative or cancelled branch, over many random schedules."""

from __future__ import annotations

import asyncio
import operator
import threading
from typing import Annotated, Any

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send
from lg_examples import eager, lats, lats_answer, puzzles, tot, tot_answer
from typing_extensions import TypedDict

from spec_tot.branch_context import current_branch
from spec_tot.langgraph import arun, from_langgraph, speculation_of
from spec_tot.langgraph.adoption import speculating

# Test latencies are 0-10 ms (benchmarks/langgraph_tot.py uses 10-200 ms), and searches stop
# at depth 5 (the tutorial's own context knob), to keep the suite fast.
FAST = {"min_latency_s": 0.0, "max_latency_s": 0.01}
RUN = {"recursion_limit": 100}
CONTEXT = {"max_depth": 5}


async def _tot_runs(mode: str, inputs: list[str], seed: int = 3) -> tuple[list[Any], int]:
    llm = tot.tot_model(seed=seed, **FAST)
    graph = tot.build_tot_graph(llm)
    app = graph.compile() if mode == "langgraph" else from_langgraph(graph, mode=mode)
    finals = await asyncio.gather(
        *(app.ainvoke({"problem": p}, RUN, context=CONTEXT) for p in inputs)
    )
    return [tot_answer(f) for f in finals], llm.num_calls


async def test_tot_tutorial_answers_and_calls_equal_langgraph_on_20_inputs() -> None:
    inputs = puzzles(20)
    theirs, their_calls = await _tot_runs("langgraph", inputs)
    base, base_calls = await _tot_runs("baseline", inputs)
    full, full_calls = await _tot_runs("full", inputs)
    assert base == theirs and base_calls == their_calls
    assert full == base  # speculation never changes an answer
    assert full_calls >= base_calls  # what it adds is speculative calls
    assert any(depth == CONTEXT["max_depth"] for _, depth in theirs)  # deep searches too


def _lats_run(mode: str, inputs: list[str]) -> tuple[list[Any], int, Any]:
    log = lats.SearchLog()
    llm = lats.lats_model(**FAST)
    graph = lats.build_lats_graph(llm, log)
    app = graph.compile() if mode == "langgraph" else from_langgraph(graph, mode=mode)
    config: Any = {"configurable": {"N": 2}, "max_concurrency": len(inputs), **RUN}
    finals = app.batch([{"input": q} for q in inputs], config)
    return [lats_answer(f) for f in finals], llm.num_calls, log


def test_lats_tutorial_answers_calls_and_tools_equal_langgraph_on_20_inputs() -> None:
    inputs = [f"question {i}: compare two sources" for i in range(20)]
    theirs, their_calls, their_log = _lats_run("langgraph", inputs)
    base, base_calls, base_log = _lats_run("baseline", inputs)
    full, full_calls, full_log = _lats_run("full", inputs)
    assert base == theirs and base_calls == their_calls
    assert full == base and full_calls == base_calls  # nothing in LATS may run ahead
    assert their_log.calls == base_log.calls == full_log.calls > 0
    assert full_log.speculative_calls == 0


async def test_full_mode_adopts_speculative_branches() -> None:
    # Calls of 10-40 ms: long enough beside the executor's own CPU that a prediction pays on
    # a loaded test machine (at 0-10 ms the priced dispatcher launched none in 3 of 10 runs).
    llm = tot.tot_model(seed=1, min_latency_s=0.01, max_latency_s=0.04)
    app = eager(from_langgraph(tot.build_tot_graph(llm)))
    results = [await arun(app, {"problem": p}, RUN, context=CONTEXT) for p in puzzles(6, seed=2)]
    expands = [t for r in results for t in r.tasks if t.node == "expand"]
    assert any(t.status == "adopted" for t in expands)
    for r in results:
        m = r.metrics
        assert m.adopted + m.cancelled + m.unused + m.failed == m.speculative
        # every task of the tree hangs under a parent of an earlier step
        ids = {t.id: t for t in r.tasks}
        assert all(t.parent is None or ids[t.parent].step < t.step for t in r.tasks)
    assert speculation_of(app).slots.used == 0  # nothing left holding a speculative slot


def test_the_examples_run_and_agree(capsys: pytest.CaptureFixture[str]) -> None:
    asyncio.run(tot.main(min_latency_s=0.0, max_latency_s=0.005))
    lats.main(min_latency_s=0.0, max_latency_s=0.005)
    out = capsys.readouterr().out.splitlines()
    tot_lines = [line for line in out if "score=" in line]  # one answer line per puzzle
    half = len(tot_lines) // 2
    assert half and tot_lines[:half] == tot_lines[half:]  # LangGraph's and spec-tot's answers
    lats_runs = [
        line.split(maxsplit=1)[1] for line in out if line.startswith(("langgraph ", "spec-tot "))
    ]
    assert lats_runs[-2] == lats_runs[-1] and "speculative: 0" in out[-1]


async def test_callbacks_show_exactly_langgraphs_calls() -> None:
    """A speculative run's callbacks are replayed when a real task adopts it and dropped
    otherwise: astream_events shows the calls LangGraph's own run makes, no more."""

    async def chat_starts(app: Any) -> list[list[str]]:
        events = app.astream_events({"problem": "2 3 5 12"}, RUN, version="v2", context=CONTEXT)
        return [
            e["metadata"]["langgraph_node"]
            async for e in events
            if e["event"] == "on_chat_model_start"
        ]

    seen = {}
    for mode in ("langgraph", "baseline", "full"):
        llm = tot.tot_model(seed=2, **FAST)
        graph = tot.build_tot_graph(llm)
        app = graph.compile() if mode == "langgraph" else from_langgraph(graph, mode=mode)
        seen[mode] = (sorted(await chat_starts(app)), llm.num_calls)
    assert seen["baseline"] == seen["langgraph"]
    assert seen["full"][0] == seen["langgraph"][0]  # adopted calls shown as the real task's
    assert seen["full"][1] >= len(seen["full"][0])  # calls made ahead and dropped: not shown
    # The calls shown include adopted speculative ones (stragglers make room for them).
    adopted = 0
    for problem in puzzles(5, seed=3):
        llm = tot.tot_model(seed=2, min_latency_s=0.002, max_latency_s=0.03)
        app = eager(from_langgraph(tot.build_tot_graph(llm)))
        result = await arun(app, {"problem": problem}, RUN)
        adopted += result.metrics.adopted
    assert adopted > 0


# -- side effects: never on a speculative or cancelled branch -----------------------------
class Pool(TypedDict, total=False):
    problem: str
    candidates: Annotated[list[Any], tot._merge]
    scored_candidates: Annotated[list[Any], tot._merge]
    depth: Annotated[int, operator.add]
    audits: Annotated[list[str], operator.add]


class Audit:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.speculative: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, state: dict[str, Any]) -> dict[str, Any]:
        branch = current_branch.get()
        with self._lock:
            self.calls.append(state["note"])
            if speculating.get() is not None or (
                branch is not None and (branch.speculative or branch.cancelled)
            ):
                self.speculative.append(state["note"])
        return {"audits": [state["note"]]}


def _audited_tot(llm: Any, audit: Audit) -> StateGraph[Any, Any, Any, Any]:
    """The ToT tutorial graph with a side-effecting ``audit`` task sent beside every
    expand: it shares the superstep that speculation runs ahead into."""
    builder = tot.build_tot_graph(llm)
    route = builder.branches["prune"]["should_terminate"].path

    def should_terminate(state: dict[str, Any], runtime: Any) -> Any:
        out = route.func(state, runtime)
        if out == END:
            return END
        return [*out, Send("audit", {"note": f"depth {state['depth']}"})]

    graph = StateGraph(Pool, context_schema=tot.Context)
    for name, spec in builder.nodes.items():
        graph.add_node(name, spec.runnable, metadata=spec.metadata)
    graph.add_node("audit", audit, metadata={"spec_tot": {"kind": "tool"}})
    graph.add_edge(START, "expand")
    graph.add_edge("expand", "score")
    graph.add_edge("score", "prune")
    graph.add_conditional_edges("prune", should_terminate, ["expand", "audit", END])
    return graph


@pytest.mark.parametrize("schedule", range(10))
async def test_tools_never_run_on_speculative_branches(schedule: int) -> None:
    inputs = puzzles(3, seed=100 + schedule)
    runs = {}
    for mode in ("langgraph", "full"):
        audit = Audit()
        llm = tot.tot_model(seed=schedule, min_latency_s=0.0, max_latency_s=0.006)
        graph = _audited_tot(llm, audit)
        app = graph.compile() if mode == "langgraph" else from_langgraph(graph, max_speculative=8)
        finals = await asyncio.gather(
            *(app.ainvoke({"problem": p}, RUN, context=CONTEXT) for p in inputs)
        )
        runs[mode] = (sorted(audit.calls), [f["audits"] for f in finals], audit)
    assert runs["full"][:2] == runs["langgraph"][:2]  # the same audits, each once
    assert runs["full"][2].speculative == []


# -- ChatSpecTot inside branches: hierarchical ids, priorities, aborts by prefix ------------
class Beams(TypedDict, total=False):
    question: str
    drafts: Annotated[list[str], operator.add]
    kept: list[str]
    rounds: Annotated[int, operator.add]


def _chat_graph(model: Any) -> StateGraph[Any, Any, Any, Any]:
    async def think(state: dict[str, Any]) -> dict[str, Any]:
        reply = await model.ainvoke(f"{state['question']}\n{state['seed']}")
        return {"drafts": [f"{state['seed']}>{reply.content}"]}

    def pick(state: dict[str, Any]) -> dict[str, Any]:
        return {"kept": sorted(state["drafts"], key=lambda d: (-len(d), d))[:2], "rounds": 1}

    def fan(state: dict[str, Any]) -> Any:
        if state["rounds"] >= 4:
            return END
        q = state["question"]
        return [
            Send("think", {"question": q, "seed": f"{k}|{i}"})
            for k in state["kept"]
            for i in (0, 1)
        ]

    builder = StateGraph(Beams)
    builder.add_node("think", think, metadata={"spec_tot": {"kind": "thought", "reads": ["seed"]}})
    builder.add_node("pick", pick, metadata={"spec_tot": {"kind": "select", "top_k": True}})
    builder.add_conditional_edges(START, lambda s: [Send("think", {**s, "seed": "a"})])
    builder.add_edge("think", "pick")
    builder.add_conditional_edges("pick", fan, ["think", END])
    return builder


async def test_chat_spec_tot_requests_carry_the_branch_identity() -> None:
    from conftest import RecordingBackend

    from spec_tot.adapters.scripted import ScriptedConfig
    from spec_tot.chat_spec_tot import ChatSpecTot
    from spec_tot.requests import Priority

    seen: list[tuple[str, Priority, bool]] = []

    class Spy(RecordingBackend):
        async def generate(self, request: Any) -> Any:
            seen.append((request.request_id, request.priority, request.speculative))
            return await super().generate(request)

    config = ScriptedConfig(token_latency_s=0.001, straggler_rate=0.5, mean_tokens=8)
    baseline = await from_langgraph(
        _chat_graph(ChatSpecTot(backend=Spy(config), seed=3)), mode="baseline"
    ).ainvoke({"question": "q"})
    seen.clear()
    backend = Spy(config)
    app = from_langgraph(_chat_graph(ChatSpecTot(backend=backend, seed=3)))
    result = await arun(app, {"question": "q"})
    assert result.state == baseline  # the same drafts: seeds follow prompts, not ids
    committed = [s for s in seen if not s[2]]
    speculative = [s for s in seen if s[2]]
    assert committed and all(p == Priority.COMMITTED for _, p, _ in committed)
    assert speculative and all(p == Priority.SPECULATIVE for _, p, _ in speculative)
    # ids: <run>/<step>/<node>/<task>/<call> on the real path, <run>/spec<k>/<call> ahead of it
    run = committed[0][0].split("/")[0]
    assert all(rid.startswith(f"{run}/") for rid, _, _ in seen)
    assert all(rid.split("/")[2] == "think" for rid, _, _ in committed)
    assert all(rid.split("/")[1].startswith("spec") for rid, _, _ in speculative)
    cancelled = [t for t in result.tasks if t.status == "cancelled" and t.node == "think"]
    if cancelled:  # a cancelled branch is aborted on the backend by its prefix
        assert any(p.startswith(f"{run}/spec") for p in backend.abort_prefixes)
    assert backend.num_inflight == 0


async def test_a_cancelled_run_leaves_no_speculative_task_or_model_call() -> None:
    """Cancelled while speculative requests are in flight (the 1st, 2nd, ... moment one
    is): no request, no speculative slot, no task of the run is left."""
    from conftest import RecordingBackend

    from spec_tot.adapters.scripted import ScriptedConfig
    from spec_tot.chat_spec_tot import ChatSpecTot

    for nth in (1, 2, 4):
        config = ScriptedConfig(token_latency_s=0.002, straggler_rate=0.5, mean_tokens=8)
        backend = RecordingBackend(config)
        app = from_langgraph(_chat_graph(ChatSpecTot(backend=backend, seed=4)))
        task = asyncio.ensure_future(app.ainvoke({"question": "q"}))
        async with asyncio.timeout(10):
            while sum("/spec" in rid for rid in backend.request_ids) < nth:
                await asyncio.sleep(0.001)
        assert backend.num_inflight > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.num_inflight == 0  # every request, speculative or real, ended
        assert speculation_of(app).slots.used == 0
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
