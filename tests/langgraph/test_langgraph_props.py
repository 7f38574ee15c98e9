"""Random LangGraph graphs (reducers, ``Send``, conditional edges, ``Command``, speculable
nodes, random latencies) run as LangGraph runs them in every mode: the final state, the
``updates`` stream and the checkpoint history equal LangGraph's own; cancelled runs leave
nothing running and spare the runs beside them."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import operator
import time
from dataclasses import dataclass
from typing import Annotated, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send
from lg_examples import eager
from typing_extensions import TypedDict

from spec_tot.langgraph import arun, from_langgraph, speculation_of

MODES = ("baseline", "full")


def _later(a: str | None, b: str | None) -> str:
    return max(a or "", b or "")


def _extend(a: list[str] | None, b: list[str]) -> list[str]:
    """A reducer that mutates its accumulated value in place, as people write them."""
    a = a if a is not None else []
    a.extend(b)
    return a


class State(TypedDict, total=False):
    log: Annotated[list[str], operator.add]
    bag: Annotated[list[str], _extend]
    hops: Annotated[int, operator.add]
    last: Annotated[str, _later]
    seed: str


def digest(*parts: Any) -> str:
    """A hash of the parts (a state without its ``bag``: LangGraph's own fresh reads for
    conditional edges extend an in-place reducer's value too, in whichever order tasks
    finish, so nothing may depend on its order)."""
    parts = tuple(
        {k: v for k, v in p.items() if k != "bag"} if isinstance(p, dict) else p for p in parts
    )
    return hashlib.sha1(repr(parts).encode()).hexdigest()


def _settled(values: dict[str, Any]) -> dict[str, Any]:
    return {**values, "bag": sorted(values["bag"])} if "bag" in values else values


@dataclass(frozen=True)
class NodeSpec:
    name: str
    command: bool  # returns Command(goto=...) instead of using a conditional edge
    targets: tuple[str, ...]  # where it may route (never itself twice in a row: hops grow)
    fan: int  # Sends per route
    kind: str  # spec-tot kind (full mode): thought, reward, select or tool


@dataclass(frozen=True)
class GraphSpec:
    nodes: tuple[NodeSpec, ...]
    max_hops: int
    latency_ms: int
    salt: int


@st.composite
def graphs(draw: st.DrawFn) -> GraphSpec:
    n = draw(st.integers(2, 4))
    names = [f"n{i}" for i in range(n)]
    nodes = []
    for name in names:
        targets = tuple(draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)))
        nodes.append(
            NodeSpec(
                name,
                command=draw(st.booleans()),
                targets=targets,
                fan=draw(st.integers(1, 2)),
                kind=draw(st.sampled_from(["thought", "thought", "reward", "select", "tool"])),
            )
        )
    return GraphSpec(
        tuple(nodes),
        max_hops=draw(st.integers(2, 6)),
        latency_ms=draw(st.integers(0, 4)),
        salt=draw(st.integers(0, 10**6)),
    )


def _route(spec: GraphSpec, node: NodeSpec, state: dict[str, Any]) -> list[Any] | str:
    if state.get("hops", 0) >= spec.max_hops:
        return END
    key = digest(spec.salt, node.name, state)
    out: list[Any] = []
    for i in range(node.fan):
        target = node.targets[int(key[i], 16) % len(node.targets)]
        if int(key[8 + i], 16) % 3:
            out.append(Send(target, {"seed": key[:6] + str(i), "hops": state.get("hops", 0)}))
        elif target not in out:
            out.append(target)
    return out


def build(
    spec: GraphSpec, *, sync: bool, calls: list[str] | None = None
) -> StateGraph[Any, Any, Any, Any]:
    builder = StateGraph(State)

    def make(node: NodeSpec) -> Any:
        def update(state: dict[str, Any]) -> tuple[dict[str, Any], float]:
            key = digest(spec.salt, node.name, state)
            delay = spec.latency_ms * (int(key[:4], 16) % 5) / 4000
            upd = {
                "log": [f"{node.name}:{key[:6]}"],
                "bag": [node.name],
                "hops": 1,
                "last": node.name,
            }
            return upd, delay

        def finish(state: dict[str, Any], upd: dict[str, Any]) -> Any:
            if calls is not None and node.kind == "tool":
                calls.append(upd["log"][0])  # a side effect: only ever on the real path
            if node.command:  # routes on its own input: a Send chain carries its hop count
                seen = {**state, "hops": state.get("hops", 0) + 1}
                return Command(update=upd, goto=_route(spec, node, seen))
            return upd

        if sync:

            def run_sync(state: dict[str, Any]) -> Any:
                upd, delay = update(state)
                time.sleep(delay)
                return finish(state, upd)

            return run_sync

        async def run_async(state: dict[str, Any]) -> Any:
            upd, delay = update(state)
            await asyncio.sleep(delay)
            return finish(state, upd)

        return run_async

    for node in spec.nodes:
        meta = {
            "spec_tot": {"kind": node.kind, **({"top_k": True} if node.kind == "select" else {})}
        }
        destinations = (*node.targets, END) if node.command else None
        builder.add_node(node.name, make(node), metadata=meta, destinations=destinations)
        if not node.command:
            builder.add_conditional_edges(
                node.name,
                lambda s, node=node: _route(spec, node, s),
                [*node.targets, END],
            )
    first = spec.nodes[0]
    builder.add_conditional_edges(
        START, lambda s: [Send(first.name, {"seed": "root", "hops": 0}), first.name]
    )
    return builder


RUN = {"recursion_limit": 60}


def _history(app: Any, config: Any) -> list[Any]:
    return [
        (_settled(s.values), s.next, s.metadata.get("step"), s.metadata.get("source"))
        for s in app.get_state_history(config)
    ]


async def _arun(spec: GraphSpec, mode: str) -> tuple[Any, list[str], list[Any], list[str]]:
    calls: list[str] = []
    builder = build(spec, sync=False, calls=calls)
    compiled = builder.compile(checkpointer=InMemorySaver())
    app = compiled if mode == "langgraph" else from_langgraph(compiled, mode=mode)
    config = {**RUN, "configurable": {"thread_id": "t"}}
    updates = [repr(c) async for c in app.astream({"log": []}, config, stream_mode="updates")]
    final = _settled((await app.aget_state(config)).values)
    return final, sorted(updates), _history(app, config), sorted(calls)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=graphs())
def test_random_graphs_run_as_langgraph_runs_them(spec: GraphSpec) -> None:
    async def main() -> None:
        want = await _arun(spec, "langgraph")
        for mode in MODES:
            assert await _arun(spec, mode) == want, mode

    asyncio.run(main())


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=graphs())
def test_random_sync_graphs_run_as_langgraph_runs_them(spec: GraphSpec) -> None:
    builder = build(spec, sync=True)
    want = _settled(builder.compile().invoke({"log": []}, RUN))
    for mode in MODES:
        app = from_langgraph(builder, mode=mode)
        assert _settled(app.invoke({"log": []}, RUN)) == want, mode


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=graphs(), cancel_after_ms=st.integers(0, 15))
def test_cancelled_runs_leave_nothing_running_and_spare_the_others(
    spec: GraphSpec, cancel_after_ms: int
) -> None:
    async def main() -> None:
        builder = build(spec, sync=False)
        want = _settled(await builder.compile().ainvoke({"log": []}, RUN))
        app = from_langgraph(builder, mode="full", max_speculative=8)
        victim = asyncio.ensure_future(app.ainvoke({"log": []}, RUN))
        others = [asyncio.ensure_future(app.ainvoke({"log": []}, RUN)) for _ in range(2)]
        await asyncio.sleep(cancel_after_ms / 1000)
        victim.cancel()
        assert [_settled(await o) for o in others] == [want, want]
        with contextlib.suppress(asyncio.CancelledError):
            await victim
        assert speculation_of(app).slots.used == 0  # no speculative task holds a slot
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert leftover == []  # nothing of any run is still running

    asyncio.run(main())


FIXED = GraphSpec(
    (
        NodeSpec("n0", False, ("n1",), 3, "thought"),
        NodeSpec("n1", False, ("n0", "n1"), 2, "thought"),
    ),
    max_hops=6,
    latency_ms=4,
    salt=7,
)


async def test_speculation_happens_on_fan_out_graphs() -> None:
    """The equalities above are not vacuous: on a fan-out graph with stragglers, full mode
    launches speculative tasks and the loop adopts some of them. Nodes of 20 ms: at 4 ms, in
    one full suite run on a busy host, the committed path overtook all 58 speculative tasks
    launched (none adopted): on so short a node a task that starts a little late is never
    ahead, which says nothing of whether speculation works."""
    adopted = launched = 0
    for salt in range(6):
        spec = GraphSpec(FIXED.nodes, FIXED.max_hops, 20, salt)
        want = _settled(await build(spec, sync=False).compile().ainvoke({"log": []}, RUN))
        app = eager(from_langgraph(build(spec, sync=False)))
        result = await arun(app, {"log": []}, RUN)
        assert _settled(result.state) == want
        launched += result.metrics.speculative
        adopted += result.metrics.adopted
    assert launched > 0 and adopted > 0


@pytest.mark.parametrize("mode", MODES)
def test_tools_never_run_ahead(mode: str) -> None:
    spec = GraphSpec(
        (
            NodeSpec("n0", False, ("n1", "n2"), 3, "thought"),
            NodeSpec("n1", False, ("n0",), 2, "thought"),
            NodeSpec("n2", False, ("n0",), 1, "tool"),
        ),
        max_hops=7,
        latency_ms=4,
        salt=3,
    )

    async def main() -> None:
        want = await _arun(spec, "langgraph")
        got = await _arun(spec, mode)
        assert got == want  # the tool's calls (each once, real path only) included
        assert want[3]  # the tool did run

    asyncio.run(main())
