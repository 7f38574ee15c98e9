"""LangGraph's semantics under spec-tot: reducers, Send, conditional edges, Command,
RunnableConfig and context, input/output schemas, streaming, recursion limits, retries and
errors behave as in LangGraph's own runtime; what spec-tot cannot honour is refused."""

from __future__ import annotations

import asyncio
import operator
import time
from dataclasses import dataclass
from typing import Annotated, Any

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.config import get_stream_writer
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import Command, RetryPolicy, Send
from typing_extensions import TypedDict

from spec_tot.errors import GraphValidationError, QueryTimeoutError
from spec_tot.langgraph import arun, from_langgraph

MODES = ["baseline", "full"]


class State(TypedDict, total=False):
    topic: str
    items: Annotated[list[str], operator.add]
    best: str
    rounds: Annotated[int, operator.add]
    seen_step: list[int]
    tag: str


@dataclass
class Ctx:
    width: int = 3
    suffix: str = "!"


def _graph(sync: bool = False) -> StateGraph[Any, Any, Any, Any]:
    async def adraft(state: dict[str, Any], runtime: Runtime[Ctx]) -> dict[str, Any]:
        await asyncio.sleep(0.001 * (len(state["seed"]) % 4))
        get_stream_writer()({"drafted": state["seed"]})
        return {"items": [f"{state['seed']}{runtime.context.suffix}"]}

    def draft(state: dict[str, Any], runtime: Runtime[Ctx]) -> dict[str, Any]:
        time.sleep(0.001 * (len(state["seed"]) % 4))
        get_stream_writer()({"drafted": state["seed"]})
        return {"items": [f"{state['seed']}{runtime.context.suffix}"]}

    def rank(state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        step = config["metadata"]["langgraph_step"]
        best = max(state["items"], key=lambda s: (len(s), s))
        return {"best": best, "rounds": 1, "seen_step": [*state.get("seen_step", []), step]}

    def fan_out(state: dict[str, Any], runtime: Runtime[Ctx]) -> Any:
        if state["rounds"] >= 3:
            return END
        width = runtime.context.width
        return [Send("draft", {"seed": f"{state['best']}.{i}"}) for i in range(width)]

    def start(state: dict[str, Any], config: RunnableConfig) -> Command[Any]:
        tag = config["configurable"].get("tag", "none")
        sends = [Send("draft", {"seed": state["topic"]})]
        return Command(update={"tag": tag}, goto=sends)

    builder = StateGraph(State, context_schema=Ctx)
    builder.add_node("start", start, destinations=("draft",))
    node = draft if sync else adraft
    builder.add_node("draft", node, metadata={"spec_tot": {"kind": "thought"}})
    builder.add_node("rank", rank, metadata={"spec_tot": {"kind": "select"}})
    builder.add_edge(START, "start")
    builder.add_edge("draft", "rank")
    builder.add_conditional_edges("rank", fan_out, ["draft", END])
    return builder


CONFIG: Any = {"configurable": {"tag": "t1"}}
CONTEXT = {"width": 2, "suffix": "?"}


@pytest.mark.parametrize("mode", MODES)
async def test_invoke_and_streams_equal_langgraph(mode: str) -> None:
    ours, theirs = from_langgraph(_graph(), mode=mode), _graph().compile()
    inp = {"topic": "x"}
    assert await ours.ainvoke(inp, CONFIG, context=CONTEXT) == await theirs.ainvoke(
        inp, CONFIG, context=CONTEXT
    )
    for stream_mode in ("values", "updates", "custom", ["values", "custom"]):
        got = [c async for c in ours.astream(inp, CONFIG, context=CONTEXT, stream_mode=stream_mode)]
        want = [
            c async for c in theirs.astream(inp, CONFIG, context=CONTEXT, stream_mode=stream_mode)
        ]
        key = repr  # chunks of one step may come in another order: compare as multisets
        assert sorted(got, key=key) == sorted(want, key=key), stream_mode


@pytest.mark.parametrize("mode", MODES)
def test_sync_twins_match_langgraph(mode: str) -> None:
    # sync nodes run on worker threads, as in LangGraph's sync runner
    ours, theirs = from_langgraph(_graph(sync=True), mode=mode), _graph(sync=True).compile()
    inp = {"topic": "y"}
    assert ours.invoke(inp, CONFIG, context=CONTEXT) == theirs.invoke(inp, CONFIG, context=CONTEXT)
    got = list(ours.stream(inp, CONFIG, context=CONTEXT, stream_mode="values"))
    want = list(theirs.stream(inp, CONFIG, context=CONTEXT, stream_mode="values"))
    assert got == want


class In(TypedDict):
    question: str


class Out(TypedDict):
    answer: str


class Whole(In, Out, total=False):
    scratch: list[str]


def test_input_and_output_schemas() -> None:
    builder = StateGraph(Whole, input_schema=In, output_schema=Out)
    builder.add_node("think", lambda s: {"scratch": [s["question"]]})
    builder.add_node("say", lambda s: {"answer": s["scratch"][0].upper()})
    builder.add_edge(START, "think")
    builder.add_edge("think", "say")
    builder.add_edge("say", END)
    inp = {"question": "why", "extra": 1}  # keys outside the input schema are dropped
    assert from_langgraph(builder).invoke(inp) == builder.compile().invoke(inp) == {"answer": "WHY"}
    ours = from_langgraph(builder)
    assert ours.get_graph().draw_mermaid() == builder.compile().get_graph().draw_mermaid()
    compiled = builder.compile()
    for mode in ("values", "updates"):
        assert list(ours.stream(inp, stream_mode=mode)) == list(
            compiled.stream(inp, stream_mode=mode)
        )
    assert ours.get_input_jsonschema() == compiled.get_input_jsonschema()
    assert ours.get_output_jsonschema() == compiled.get_output_jsonschema()
    assert set(ours.get_input_jsonschema()["properties"]) == {"question"}


def _loop() -> StateGraph[Any, Any, Any, Any]:
    builder = StateGraph(State)
    builder.add_node("spin", lambda s: {"rounds": 1}, metadata={"spec_tot": {"kind": "function"}})
    builder.add_edge(START, "spin")
    builder.add_edge("spin", "spin")
    return builder


@pytest.mark.parametrize("limit", [1, 4])
def test_recursion_limit_raises_graph_recursion_error(limit: int) -> None:
    with pytest.raises(GraphRecursionError, match=f"Recursion limit of {limit}"):
        _loop().compile().invoke({"topic": "x"}, {"recursion_limit": limit})
    with pytest.raises(GraphRecursionError, match=f"Recursion limit of {limit}"):
        from_langgraph(_loop()).invoke({"topic": "x"}, {"recursion_limit": limit})


def test_errors_and_retries_behave_as_in_langgraph() -> None:
    attempts: list[int] = []

    def flaky(state: dict[str, Any]) -> dict[str, Any]:
        attempts.append(1)
        if len(attempts) % 2:
            raise ConnectionError("transient")
        return {"best": "ok"}

    def boom(state: dict[str, Any]) -> dict[str, Any]:
        raise KeyError("missing")

    builder = StateGraph(State)
    builder.add_node("flaky", flaky, retry_policy=RetryPolicy(initial_interval=0.0, jitter=False))
    builder.add_edge(START, "flaky")
    builder.add_edge("flaky", END)
    assert from_langgraph(builder).invoke({"topic": "x"})["best"] == "ok"
    assert len(attempts) == 2
    broken = StateGraph(State)
    broken.add_node("boom", boom)
    broken.add_edge(START, "boom")
    with pytest.raises(KeyError, match="missing"):
        from_langgraph(broken).invoke({"topic": "x"})


def _asking() -> StateGraph[Any, Any, Any, Any]:
    """Drafts in parallel, then asks a human (``interrupt``) which one is best."""
    from langgraph.types import interrupt

    def ask(state: dict[str, Any]) -> dict[str, Any]:
        return {"best": str(interrupt({"choose from": sorted(state["items"])}))}

    builder = StateGraph(State)
    builder.add_node(
        "draft", lambda s: {"items": [s["seed"]]}, metadata={"spec_tot": {"kind": "thought"}}
    )
    builder.add_node("ask", ask)
    builder.add_conditional_edges(
        START, lambda s: [Send("draft", {"seed": f"{s['topic']}{i}"}) for i in range(3)]
    )
    builder.add_edge("draft", "ask")
    return builder


@pytest.mark.parametrize("mode", MODES)
def test_checkpoints_interrupts_and_resume_work_as_in_langgraph(mode: str) -> None:
    """What LangGraph's loop does, it does here: checkpointed threads, ``interrupt_after``,
    ``interrupt()`` and ``Command(resume=...)``, durability, stream modes LangGraph has and
    spec-tot once refused. (LangGraph's own suite is the full check:
    scripts/langgraph_suite.py.)"""

    def runs(app: Any, asking: Any) -> list[Any]:
        thread: Any = {"configurable": {"thread_id": "t", "tag": "t1"}}
        out = [app.invoke({"topic": "x"}, thread, context=CONTEXT, durability="sync")]
        out.append([s.next for s in app.get_state_history(thread)])
        out.append(app.invoke(None, thread, context=CONTEXT))  # resume after the interrupt
        out.append(app.get_state(thread).values)
        other: Any = {"configurable": {"thread_id": "u"}}
        first = asking.invoke({"topic": "y"}, other)
        out.append((first["__interrupt__"][0].value, asking.get_state(other).next))
        out.append(asking.invoke(Command(resume="y1"), other))
        modes = ["updates", "tasks", "checkpoints", "messages", "custom"]
        chunks = asking.stream(
            {"topic": "z"}, {"configurable": {"thread_id": "v"}}, stream_mode=modes
        )
        out.append(sorted(repr(m) for m, _ in chunks))
        return out

    theirs = runs(
        _graph(sync=True).compile(checkpointer=InMemorySaver(), interrupt_after=["start"]),
        _asking().compile(checkpointer=InMemorySaver()),
    )
    ours = runs(
        from_langgraph(
            _graph(sync=True).compile(checkpointer=InMemorySaver(), interrupt_after=["start"]),
            mode=mode,
        ),
        from_langgraph(_asking().compile(checkpointer=InMemorySaver()), mode=mode),
    )
    assert ours == theirs


@pytest.mark.parametrize(
    ("meta", "words"),
    [
        ({"kind": "judge"}, "not one of"),
        ({"kind": "thought", "colour": 1}, "unknown metadata keys"),
        ({"kind": "thought", "prompt": str}, "not used any more"),
        ({"kind": "thought", "top_k": True}, "'select' only"),
        ({"kind": "thought", "reads": "seed"}, "list of keys"),
        ({"kind": "tool", "reads": ["seed"]}, "pure nodes"),
        ({"kind": "select", "pure": False}, "pure"),
        ({"pure": "yes"}, "True or False"),
    ],
)
def test_bad_metadata_names_the_node(meta: dict[str, Any], words: str) -> None:
    builder = StateGraph(State)
    builder.add_node("odd", lambda s: {}, metadata={"spec_tot": meta})
    builder.add_edge(START, "odd")
    with pytest.raises(GraphValidationError) as info:
        from_langgraph(builder)
    assert info.value.node == "odd" and words in str(info.value)


async def test_timeout_and_cancellation_leave_nothing_running() -> None:
    running: set[str] = set()

    async def slow(state: dict[str, Any]) -> dict[str, Any]:
        running.add(state["seed"])
        try:
            await asyncio.sleep(10)
        finally:
            running.discard(state["seed"])
        return {}

    builder = StateGraph(State)
    builder.add_node("fan", lambda s: {}, metadata={"spec_tot": {"kind": "function"}})
    builder.add_node("slow", slow, metadata={"spec_tot": {"kind": "thought"}})
    builder.add_edge(START, "fan")
    builder.add_conditional_edges(
        "fan", lambda s: [Send("slow", {"seed": str(i)}) for i in range(3)]
    )
    from spec_tot.config import ExecutorConfig

    app = from_langgraph(builder, config=ExecutorConfig(mode="full", query_timeout_s=0.05))
    with pytest.raises(QueryTimeoutError):
        await arun(app, {"topic": "x"})
    assert running == set()
    task = asyncio.ensure_future(from_langgraph(builder).ainvoke({"topic": "x"}))
    async with asyncio.timeout(10):  # a loaded machine may take a while to start them
        while len(running) < 3:
            await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert running == set()
