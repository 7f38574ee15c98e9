"""A LangGraph app whose model calls go to a spec-tot backend (``ChatSpecTot``) takes its
speculative slots from that backend's one dispatcher (``hub_for(backend)``), shared with the
ToT apps on it: run side by side they never exceed the backend's speculative capacity."""

from __future__ import annotations

import asyncio
import operator
from typing import Annotated, Any

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send
from lg_examples import eager
from spec_helpers import Saturating, make_app, tick_fn
from typing_extensions import TypedDict

from spec_tot.adapters.scripted import ScriptedConfig
from spec_tot.adapters.scripted_chat import stable_unit
from spec_tot.chat_spec_tot import ChatSpecTot
from spec_tot.errors import ConfigError
from spec_tot.executor import hub_for
from spec_tot.langgraph import from_langgraph, speculation_of

CAPACITY = 16


def saturating(seed: int) -> Saturating:
    """A backend that saturates at ``CAPACITY`` sequences and records the most speculative
    requests in flight at once. A request takes 10-50 ms of wall time (a function of its
    id): the graphs' sync nodes run on worker threads, whose hops (up to the GIL's switch
    interval) a virtual clock in loop turns would not model; with one, the real step won
    every race on a quiet machine and nothing was left to speculate on."""
    ticks = tick_fn(seed, 40)
    return Saturating(
        CAPACITY, ScriptedConfig(seed=seed, depth=4), lambda rid: 0.01 + 0.001 * ticks(rid)
    )


def speculative_requests(backend: Saturating, prefix: str) -> int:
    return sum(r.speculative and r.request_id.startswith(prefix) for r in backend.requests)


def _merge(existing: list[Any] | None = None, update: list[Any] | str | None = None) -> list[Any]:
    return [] if update == "clear" else [*(existing or []), *(update or [])]


class State(TypedDict, total=False):
    question: str
    seed: str
    candidates: Annotated[list[str], _merge]
    scored: Annotated[list[tuple[float, str]], _merge]
    depth: Annotated[int, operator.add]


def search_graph(llm: ChatSpecTot, *, sync: bool = False) -> StateGraph[Any, Any, Any, Any]:
    """The ToT tutorial's shape over ``ChatSpecTot``: two guesses per expansion, a ``Send``
    per kept beam, fan-out from the start (speculation may begin before any model call).
    ``sync``: ``expand`` is a sync node that streams its guesses."""

    def prompts(state: State) -> list[str]:
        prompt = "\n".join(p for p in (state["question"], state.get("seed", "")) if p)
        return [f"{prompt}\nguess {i}" for i in range(2)]

    def guesses(state: State, replies: list[str]) -> dict[str, Any]:
        return {"candidates": [f"{state.get('seed', '')}|{r}"[-60:] for r in replies]}

    async def expand_async(state: State) -> dict[str, Any]:
        replies = await asyncio.gather(*(llm.ainvoke(p) for p in prompts(state)))
        return guesses(state, [str(r.content) for r in replies])

    def expand_sync(state: State) -> dict[str, Any]:
        streams = [llm.stream(p) for p in prompts(state)]
        return guesses(state, ["".join(str(c.content) for c in s) for s in streams])

    expand = expand_sync if sync else expand_async

    def score(state: State) -> dict[str, Any]:
        scored = [(stable_unit(c), c) for c in state.get("candidates", [])]
        return {"scored": scored, "candidates": "clear"}

    def prune(state: State) -> dict[str, Any]:
        ranked = sorted(state.get("scored", []), reverse=True)[:2]
        return {"candidates": [c for _, c in ranked], "scored": "clear", "depth": 1}

    def fan_out(state: State) -> Any:
        return [Send("expand", {"question": state["question"], "seed": s}) for s in ("a", "b")]

    def next_step(state: State) -> Any:
        if state.get("depth", 0) >= 3 or not state.get("candidates"):
            return END
        return [Send("expand", {**state, "seed": c}) for c in state["candidates"]]

    builder = StateGraph(State)
    builder.add_node(
        "expand", expand, metadata={"spec_tot": {"kind": "thought", "reads": ["question", "seed"]}}
    )
    builder.add_node("score", score, metadata={"spec_tot": {"kind": "reward"}})
    builder.add_node("prune", prune, metadata={"spec_tot": {"kind": "select", "top_k": True}})
    builder.add_conditional_edges(START, fan_out, ["expand"])
    builder.add_edge("expand", "score")
    builder.add_edge("score", "prune")
    builder.add_conditional_edges("prune", next_step, ["expand", END])
    return builder


async def _side_by_side(seed: int, known: str) -> tuple[int, int]:
    """Two ToT queries and two LangGraph runs at once on one backend; checks the shared
    budget held; returns the speculative requests of each (LangGraph's, ToT's)."""
    backend = saturating(seed)
    llm = ChatSpecTot(backend=backend, seed=seed, max_tokens=8)
    graph = search_graph(llm)
    lg = from_langgraph(graph, backend=backend if known == "given" else None)
    eager(lg)
    tot = make_app(backend, "rebase", "full", params={"width": 4})
    questions = [f"puzzle {i}" for i in range(2)]
    results = await asyncio.gather(
        *(tot.ainvoke({"question": q}) for q in questions),
        *(lg.ainvoke({"question": q}) for q in questions),
    )
    assert all(r.status == "ok" for r in results[:2])
    # together never past the backend's capacity
    hub = hub_for(backend)
    assert backend.peak_speculative <= CAPACITY and hub.dispatcher.peak_speculative <= CAPACITY
    assert speculation_of(lg).slots.hubs == [hub] and speculation_of(lg).slots.used == 0
    # nothing left behind: no request, no slot, no reserved key, no demand
    assert backend.num_inflight == 0 and hub.active == set()
    assert sum(hub.dispatcher.speculative.values()) == 0 and hub.dispatcher.local_committed == 0
    # the shared budget changes when tasks run, never what a run answers
    baseline = from_langgraph(graph, mode="baseline")
    for q, final in zip(questions, results[2:], strict=True):
        assert final == await baseline.ainvoke({"question": q})
    # request ids: LangGraph runs' start with "lg-", the ToT queries' with "q"
    return speculative_requests(backend, "lg-"), speculative_requests(backend, "q")


@pytest.mark.parametrize("known", ["learnt", "given"])
async def test_langgraph_and_tot_apps_share_one_speculation_budget(known: str) -> None:
    """Every seed keeps the budget; seeds run until both apps have speculated in two of
    them (whether a LangGraph run gets room in a given schedule is up to the budget's
    split, which follows timing: a few schedules always give it some)."""
    both = 0
    for seed in range(12):
        lg, tot = await _side_by_side(seed, known)
        both += lg > 0 and tot > 0
        if both == 2:
            return
    pytest.fail(f"both apps speculated in {both} of 12 schedules")


def test_sync_nodes_stream_through_the_runs_loop_and_budget() -> None:
    """A sync graph run (nodes on worker threads) whose nodes stream: their requests are
    made on the run's loop, inside their branches (ids, priorities, the shared budget)."""
    backend = saturating(0)
    llm = ChatSpecTot(backend=backend, seed=0, max_tokens=8)
    app = from_langgraph(search_graph(llm, sync=True))
    eager(app)
    final = app.invoke({"question": "puzzle 0"})
    assert all(r.request_id.startswith("lg-") for r in backend.requests)
    assert speculative_requests(backend, "lg-") > 0 and speculation_of(app).slots.hubs == [
        hub_for(backend)
    ]
    assert backend.peak_speculative <= CAPACITY and backend.num_inflight == 0
    baseline = from_langgraph(search_graph(llm, sync=True), mode="baseline")
    assert final == baseline.invoke({"question": "puzzle 0"})


def test_backend_given_to_from_langgraph_is_checked() -> None:
    backend = saturating(0)
    llm = ChatSpecTot(backend=backend)
    app = from_langgraph(search_graph(llm), backend=llm)
    slots = speculation_of(app).slots
    assert slots.hubs == [hub_for(backend)] and slots.limit is None
    assert slots.dispatchers() == [hub_for(backend).dispatcher]
    unknown = speculation_of(from_langgraph(search_graph(ChatSpecTot(backend=backend)))).slots
    assert unknown.dispatchers() == [unknown.own] and unknown.own.capacity == 16
    with pytest.raises(ConfigError, match="backend: expected a spec-tot GenerationBackend"):
        from_langgraph(search_graph(ChatSpecTot(backend=backend)), backend="local")


class Fan(TypedDict, total=False):
    items: Annotated[list[str], operator.add]


async def test_speculative_tasks_count_against_max_concurrency() -> None:
    """LangGraph's ``test_max_concurrency`` with every node speculable: a fan-out of 40
    ``Send``s then a second one per item, run with ``max_concurrency=6``; real and
    speculative calls together never pass 6 at once, and the answer is LangGraph's."""
    now = {"running": 0, "peak": 0}

    async def work(state: dict[str, Any]) -> dict[str, Any]:
        now["running"] += 1
        now["peak"] = max(now["peak"], now["running"])
        await asyncio.sleep(0.002 * (1 + hash(state["item"]) % 5))
        now["running"] -= 1
        return {"items": [state["item"] + "!"]}

    def fan_out(state: Fan) -> list[Send]:
        return [Send("work", {"item": f"{i}"}) for i in range(40)]

    def fan_again(state: Fan) -> list[Send]:
        return [Send("again", {"item": i}) for i in state.get("items", [])]

    marked = {"metadata": {"spec_tot": {"kind": "thought"}}}
    builder = StateGraph(Fan)
    builder.add_node("start", lambda s: {}, **marked)
    builder.add_node("work", work, **marked)
    builder.add_node("again", work, **marked)
    builder.add_edge(START, "start")
    builder.add_conditional_edges("start", fan_out, ["work"])
    builder.add_conditional_edges("work", fan_again, ["again"])
    builder.add_edge("again", END)
    graph = builder.compile()
    expected = await graph.ainvoke({}, {"max_concurrency": 6})
    assert now["peak"] == 6  # LangGraph itself uses the whole limit
    now["peak"] = 0
    app = from_langgraph(graph, mode="full")
    slots = speculation_of(app).slots  # the CPU gate off: a loaded machine must not
    slots.max_lag_s, slots.max_cpu_share = 1.0, float("inf")  # keep it from running ahead
    result = await app.ainvoke({}, {"max_concurrency": 6})
    assert sorted(result["items"]) == sorted(expected["items"])
    assert 0 < now["peak"] <= 6
    totals = speculation_of(app).totals
    assert totals.speculative > 0 and totals.adopted > 0  # it did run ahead


def test_function_node_pays_its_waiting_outside_the_process() -> None:
    """A function node is run ahead on its committed cost: a hit saves its wall seconds, a
    miss wastes its CPU plus the time the process sat idle while it ran (what it waited on
    outside). A node that only waits is not run ahead on a coin's odds; a CPU-bound one,
    slowed by the process's own work, is."""
    from spec_tot.langgraph.slots import SpeculationSlots

    slots = SpeculationSlots()
    slots.max_cpu_share = float("inf")  # the gates on this process's load are not tested here
    slots.observe_node("waits", wall_s=0.2, cpu_s=0.001, away_s=0.199)
    slots.observe_node("computes", wall_s=0.2, cpu_s=0.05, away_s=0.0)
    assert slots.node_costs == {"waits": (0.2, 0.2), "computes": (0.2, 0.05)}
    run = slots.for_run("r")
    assert run.acquire("langgraph:waits", 1, False, "waits") is None
    assert run.acquire("langgraph:never_ran", 1, False, "never_ran") is None
    assert run.acquire("langgraph:computes", 1, False, "computes") is not None
    # ... and a waiting node that lets a model call run ahead is worth it
    assert run.acquire("langgraph:waits", 1, False, "waits", unblocks_s=0.3) is not None
