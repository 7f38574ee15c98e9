"""Helpers for the speculation tests: a scripted backend whose request latencies are an
arbitrary (hypothesis-drawn) pure function of the request id, a registry of the live search
trees, a tool-call recorder, and fingerprints of what a run *committed*.

Latencies are real ``asyncio.sleep``s of a few milliseconds at most, so each run is fast but
arrival orders of generations and reward batches are genuinely shuffled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import spec_tot.executor.run_queries
from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.app import ToTApp, ToTResult
from spec_tot.config import ExecutorConfig, LazyVerification
from spec_tot.errors import BackendError
from spec_tot.executor.reward_router import RewardRouter
from spec_tot.executor.reward_rules import BatchRule, EagerRule, LazyRule, RoundRule
from spec_tot.graph import END, START, State, ThoughtGraph
from spec_tot.graphs.toy import ANSWER_PREFIX
from spec_tot.metrics import MetricsRecorder
from spec_tot.requests import (
    Capabilities,
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RewardItem,
)
from spec_tot.seeds import stable_seed
from spec_tot.tree import Node, NodeStatus, SearchTree

MODES = ("baseline", "dedup", "naive", "spex", "specscale", "full")
SPEC_MODES = ("dedup", "naive", "spex", "specscale", "full")  # compared with baseline

# Small, fast parameters for every policy (answers appear at depth 3 of the scripted backend).
POLICIES: dict[str, dict[str, Any]] = {
    "beam": {"n": 4, "width": 2, "max_depth": 5},
    "dvts": {"n": 4, "width": 2, "max_depth": 5},
    "rebase": {"width": 4, "max_depth": 5},
    "ets": {"width": 4, "max_depth": 5},
    "tot_bfs": {"breadth": 2, "width": 3, "max_depth": 4},
    "mcts": {"width": 2, "iterations": 6, "max_depth": 5},
    "rstar": {"width": 2, "iterations": 4, "max_depth": 5},
    "rest_mcts": {"width": 2, "iterations": 5, "max_depth": 5},
    "best_of_n": {"n": 4, "max_depth": 5},
    "tot_dfs": {"width": 3, "threshold": 0.5, "max_depth": 4},
}


def latency_fn(seed: int, max_ms: float) -> Callable[[str], float]:
    """A pure function request id -> seconds in [0, max_ms] ms, drawn by ``seed``."""

    def fn(key: str) -> float:
        if max_ms <= 0:
            return 0.0
        return (stable_seed(seed, key) % 1000) / 1000 * max_ms / 1000

    return fn


def tick_fn(seed: int, max_ticks: int) -> Callable[[str], int]:
    """A pure function request id -> event-loop ticks in [0, max_ticks]: a virtual clock, so
    the schedule (and any failure) is exactly reproducible and costs no real time."""

    def fn(key: str) -> int:
        return stable_seed(seed, key) % (max_ticks + 1) if max_ticks > 0 else 0

    return fn


async def pause(delay: float, aborted: asyncio.Event | None = None) -> None:
    """Wait ``delay`` seconds (a float) or ``delay`` loop ticks (an int), or until aborted."""
    if isinstance(delay, int):
        for _ in range(delay):
            if aborted is not None and aborted.is_set():
                return
            await asyncio.sleep(0)
        return
    if aborted is None:
        await asyncio.sleep(delay)
        return
    waiter = asyncio.ensure_future(aborted.wait())
    try:
        await asyncio.wait({waiter}, timeout=delay)
    finally:
        waiter.cancel()


class LatencyBackend(ScriptedBackend):
    """A ScriptedBackend (same texts, token counts and scores) whose generation latency is
    ``gen_latency(request_id)`` and reward latency ``reward_latency(first item id)``; both pure
    functions returning seconds (float) or loop ticks (int), so a run's schedule is arbitrary
    but reproducible (exactly so with ticks). Requests matching
    ``config.hang_prefixes`` hang until aborted; ``config.fail_prefixes`` raise."""

    def __init__(
        self,
        config: ScriptedConfig | None = None,
        gen_latency: Callable[[str], float] | Callable[[str], int] | None = None,
        reward_latency: Callable[[str], float] | Callable[[str], int] | None = None,
    ) -> None:
        super().__init__(config or ScriptedConfig())
        self.gen_latency = gen_latency or (lambda _rid: 0.0)
        self.reward_latency = reward_latency or (lambda _rid: 0.0)
        self.requests: list[GenerateRequest] = []
        self.score_batches: list[list[str]] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.request_id in self._inflight:
            raise BackendError("latency", f"duplicate request id {request.request_id!r}")
        self.num_generate_calls += 1
        self.requests.append(request)
        rid = request.request_id
        if any(rid == p or rid.startswith(p + "/") for p in self.config.fail_prefixes):
            raise BackendError("latency", f"injected failure for {rid!r}")
        samples = [self.sample(request, i) for i in range(request.n)]
        aborted = asyncio.Event()
        self._inflight[rid] = aborted
        self.peak_inflight = max(self.peak_inflight, len(self._inflight))
        try:
            hang = any(rid == p or rid.startswith(p + "/") for p in self.config.hang_prefixes)
            if hang:
                await aborted.wait()
            else:
                await pause(self.gen_latency(rid), aborted)
        finally:
            del self._inflight[rid]
        reason = FinishReason.ABORT if aborted.is_set() else FinishReason.STOP
        completions = tuple(
            Completion(text=text, num_tokens=tokens, finish_reason=reason)
            for text, tokens in samples
        )
        self.num_generated_tokens += sum(c.num_tokens for c in completions)
        return GenerateResult(rid, completions, prompt_tokens=len(request.prompt or ""))

    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        self.score_batches.append([i.request_id for i in items])
        if items:
            await pause(self.reward_latency(items[0].request_id))
        return await super().score(items)


# -- the toy program with optional tool nodes ------------------------------------------------
def prompt(state: State) -> str:
    return "\n".join([state["question"], *state["steps"]])


def is_answer(state: State) -> bool:
    return bool(state["steps"]) and state["steps"][-1].startswith(ANSWER_PREFIX)


def stops_early(state: State) -> bool:
    """The mixed graph also ends a trace at an intermediate "step N" with N % 4 == 0, so
    that terminal and non-terminal candidates compete in one round."""
    last = state["steps"][-1] if state["steps"] else ""
    return last.startswith("step ") and int(last[5:]) % 4 == 0


def route(state: State) -> str:
    return "done" if is_answer(state) else "more"


def route_mixed(state: State) -> str:
    return "done" if is_answer(state) or stops_early(state) else "more"


def answer_of(state: State) -> str | None:
    if is_answer(state):
        return str(state["steps"][-1][len(ANSWER_PREFIX) :])
    return "early" if state["steps"] and stops_early(state) else None


def check(state: State, answer: str | None) -> bool:
    return answer == "24"


def hinted_prompt(state: State) -> str:
    """The prompt with the last reward in it: a branch's next step depends on the score."""
    hint = state.get("hint")
    head = state["question"] if hint is None else f"{state['question']} [hint {hint}]"
    return "\n".join([head, *state["steps"]])


def remember_reward(state: State) -> dict[str, Any]:
    return {"hint": round(float(state["reward"]), 1)}


def route_on_reward(state: State) -> str:
    """A low score ends the trace (it is terminal without an answer)."""
    return "done" if is_answer(state) or float(state["reward"]) < 0.3 else "more"


def toy_graph(
    *,
    tool_before: Callable[[State], Any] | None = None,
    tool_after: Callable[[State], Any] | None = None,
    pure: bool = False,
    mixed: bool = False,
    reward_dependent: bool = False,
) -> ThoughtGraph:
    """thought -> [tool_before] -> reward -> [tool_after] -> (thought | END); ``mixed``:
    some intermediate steps end their trace too (``stops_early``); ``reward_dependent``:
    a function after the reward writes it into the state, the next prompt shows it, and a
    low score ends the trace (walks ahead on a provisional reward then often go wrong)."""
    if reward_dependent:
        g = ThoughtGraph()
        g.add_thought("t", hinted_prompt)
        g.add_reward("r")
        g.add_function("remember", remember_reward)
        g.add_edge(START, "t")
        g.add_edge("t", "r")
        g.add_edge("r", "remember")
        g.add_conditional_edges("remember", route_on_reward, {"more": "t", "done": END})
        return g
    router = route_mixed if mixed else route
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r")
    g.add_edge(START, "t")
    if tool_before is not None:
        g.add_tool("before", tool_before, speculable=pure, pure=pure)
        g.add_edge("t", "before")
        g.add_edge("before", "r")
    else:
        g.add_edge("t", "r")
    if tool_after is not None:
        g.add_tool("after", tool_after, speculable=pure, pure=pure)
        g.add_edge("r", "after")
        g.add_conditional_edges("after", router, {"more": "t", "done": END})
    else:
        g.add_conditional_edges("r", router, {"more": "t", "done": END})
    return g


def make_app(
    backend: ScriptedBackend,
    policy: str,
    mode: str,
    *,
    graph: ThoughtGraph | None = None,
    params: dict[str, Any] | None = None,
    **config: Any,
) -> ToTApp:
    return (graph or toy_graph()).compile(
        backend=backend,
        search=policy,
        search_params=POLICIES[policy] if params is None else params,
        config=ExecutorConfig(mode=mode, **config),
        answer=answer_of,
        check=check,
    )


def inputs(*ids: str) -> list[dict[str, Any]]:
    return [{"question": f"puzzle {qid}", "query_id": qid} for qid in ids]


# -- fingerprints ----------------------------------------------------------------------------
def committed(tree: SearchTree) -> list[Node]:
    """Non-root nodes the search committed to (never speculative, never cancelled)."""
    return [
        n
        for n in tree.nodes()
        if n.parent is not None and not n.speculative and n.status is not NodeStatus.CANCELLED
    ]


def expansions(tree: SearchTree) -> set[str]:
    """Nodes with at least one committed child: the policy's selections."""
    return {n.parent.id for n in committed(tree) if n.parent is not None}


@dataclass(frozen=True)
class Fingerprint:
    expansions: frozenset[str]
    nodes: dict[str, tuple[str, float | None, bool, str | None]]
    answer: str | None
    answer_node: str | None
    score: float | None
    status: str


def fingerprint(result: ToTResult) -> Fingerprint:
    answer_node = None
    tree = result.tree
    if result.answer is not None:
        # the answer node is the terminal the vote chose; Answer is not kept on ToTResult,
        # so recover it as the best terminal with that answer text
        finals = [n for n in tree.terminals() if n.answer == result.answer]
        answer_node = min(finals, key=lambda n: (-(n.reward or 0.0), n.id)).id if finals else None
    return Fingerprint(
        expansions=frozenset(expansions(tree)),
        nodes={n.id: (n.text, n.reward, n.terminal, n.answer) for n in committed(tree)},
        answer=result.answer,
        answer_node=answer_node,
        score=result.score,
        status=result.status,
    )


# -- live trees and tool calls ---------------------------------------------------------------
class TreeRegistry:
    """Patches ``spec_tot.executor.run_queries.SearchTree`` so that every query's live tree is
    reachable by query id while the query runs (the tool recorder looks branches up there)."""

    def __init__(self) -> None:
        self.trees: dict[str, SearchTree] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[TreeRegistry]:
        registry = self

        class RegisteredTree(SearchTree):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                registry.trees[self.query_id] = self

        with mock.patch.object(spec_tot.executor.run_queries, "SearchTree", RegisteredTree):
            yield self


@dataclass(frozen=True)
class ToolCall:
    tool: str
    node_id: str
    speculative: bool  # the branch's node was speculative at call time
    status: NodeStatus  # its status at call time


@dataclass
class ToolRecorder:
    """A side-effecting tool: each call records which branch (looked up in the live tree
    through the running segment task, whose name is the node id) made it, and its state."""

    registry: TreeRegistry
    calls: list[ToolCall] = field(default_factory=list)

    def tool(self, name: str) -> Callable[[State], dict[str, Any]]:
        def fn(state: State) -> dict[str, Any]:
            task = asyncio.current_task()
            assert task is not None
            node_id = task.get_name()
            tree = self.registry.trees[node_id.split("/", 1)[0]]
            node = tree[node_id]
            self.calls.append(ToolCall(name, node_id, node.speculative, node.status))
            return {f"{name}_calls": state.get(f"{name}_calls", 0) + 1}

        return fn


# -- a reward router for unit tests -----------------------------------------------------------
class OneRuleRouter(RewardRouter):
    """A RewardRouter whose queries all use one batch rule; a query opens on first sight."""

    def __init__(
        self,
        rule: str | LazyVerification | BatchRule,
        recorder: MetricsRecorder | None = None,
        *,
        busy: Callable[[], bool] | None = None,
        saturated: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(rule, LazyVerification):
            rule = LazyRule(rule, busy, saturated)
        elif rule == "round":
            rule = RoundRule()
        elif rule == "eager":
            rule = EagerRule()
        assert isinstance(rule, BatchRule)
        self.rule = rule
        self.recorder = recorder or MetricsRecorder()

    def _ensure(self, query_id: str) -> None:
        if query_id not in self._queries:
            self.open_query(query_id, self.rule, self.recorder, None)

    def expect(self, query_id: str, node_id: str) -> None:
        self._ensure(query_id)
        super().expect(query_id, node_id)

    def prepare(self, query_id: str, *args: Any, **kwargs: Any) -> Any:
        self._ensure(query_id)
        return super().prepare(query_id, *args, **kwargs)


def straggly(seed: int, **extra: Any) -> LatencyBackend:
    """Shuffled arrivals on a virtual clock (loop ticks): deterministic, and no real sleeps.
    Generation latency is long-tailed: a fifth of the requests are 10x slower."""

    def gen(rid: str) -> int:
        ticks = tick_fn(seed, 6)(rid)
        return ticks * 10 if stable_seed(seed + 7, rid) % 5 == 0 else ticks

    return LatencyBackend(
        ScriptedConfig(seed=seed, depth=4, straggler_rate=0.3, **extra),
        gen_latency=gen,
        reward_latency=tick_fn(seed + 1, 3),
    )


async def run_two(
    policy: str, mode: str, seed: int, *, params: dict[str, Any] | None = None, **kw: Any
) -> tuple[Any, LatencyBackend]:
    mixed = kw.pop("mixed", False)
    backend = straggly(seed)
    app = make_app(backend, policy, mode, graph=toy_graph(mixed=mixed), params=params, **kw)
    batch = await app.arun_batch(inputs("q0", "q1"))
    assert backend.num_inflight == 0
    return batch, backend


class Saturating(LatencyBackend):
    """Saturates at ``capacity`` sequences; records the most speculative generations in
    flight at once, and (optionally) reports a server-side load."""

    def __init__(self, capacity: int, *args: Any, load: float | None = None) -> None:
        super().__init__(*args)
        self.capacity = capacity
        self.load = load
        self.speculative_now = self.peak_speculative = 0
        self.speculative_requests = 0

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="saturating", saturation_batch=self.capacity)

    def reported_load(self) -> float | None:
        return self.load

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not request.speculative:
            return await super().generate(request)
        self.speculative_requests += 1
        self.speculative_now += 1
        self.peak_speculative = max(self.peak_speculative, self.speculative_now)
        try:
            return await super().generate(request)
        finally:
            self.speculative_now -= 1
