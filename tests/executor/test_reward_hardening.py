"""Bad rewards fail only their query: NaN, infinities, strings, bools, wrong lengths,
out-of-range scores, raising, hanging and blocking (sync) scorers, in baseline and every
speculative mode. The other queries finish with the answers they get with a good scorer."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
from spec_helpers import (
    MODES,
    LatencyBackend,
    fingerprint,
    inputs,
    make_app,
    prompt,
    route,
    tick_fn,
)

from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.backends import RewardBackend
from spec_tot.config import ExecutorConfig
from spec_tot.executor.reward_scorer import check_score
from spec_tot.graph import END, START, ThoughtGraph
from spec_tot.graphs.toy import _answer, _prompt, _route
from spec_tot.requests import RewardItem

BAD = "puzzle bad"
QUERIES = [
    {"question": "puzzle a", "query_id": "a"},
    {"question": BAD, "query_id": "bad"},
    {"question": "puzzle b", "query_id": "b"},
]


class Scorer:
    """The scripted backend's scores, except for items of the bad question."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.reference = ScriptedBackend(ScriptedConfig(seed=4))
        self.hung: list[asyncio.Event] = []

    def good(self, item: RewardItem) -> tuple[float, ...]:
        score = self.reference.step_score
        return tuple(score(item.question, item.steps[: i + 1]) for i in range(len(item.steps)))

    def bad(self, item: RewardItem) -> Any:
        n = len(item.steps)
        return {
            "nan": float("nan"),
            "inf": (float("inf"),) * n,
            "-inf": float("-inf"),
            "string": "12",
            "bool": True,
            "too_long": (0.5,) * (n + 1),
            "empty": (),
            "none": None,
        }[self.kind]

    async def __call__(self, items: Sequence[RewardItem]) -> list[Any]:
        if any(i.question == BAD for i in items):
            if self.kind == "raise":
                raise RuntimeError("the scorer broke on the bad question")
            if self.kind == "hang":
                never = asyncio.Event()
                self.hung.append(never)
                await never.wait()
            if self.kind == "count":
                return [self.good(i) for i in items][:-1]
        return [self.bad(i) if i.question == BAD else self.good(i) for i in items]


def _graph(scorer: Any) -> ThoughtGraph:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("judge", scorer)
    g.add_edge(START, "t")
    g.add_edge("t", "judge")
    g.add_conditional_edges("judge", route, {"more": "t", "done": END})
    return g


async def _run(
    mode: str, scorer: Any, timeout: float | None = None, queries: list[Any] = QUERIES
) -> dict[str, Any]:
    backend = LatencyBackend(
        ScriptedConfig(seed=4, depth=3, straggler_rate=0.3), tick_fn(2, 12), tick_fn(3, 2)
    )
    app = make_app(
        backend,
        "beam",
        mode,
        graph=_graph(scorer),
        params={"n": 4, "width": 2, "max_depth": 4},
        query_timeout_s=timeout,
    )
    batch = await app.arun_batch(queries)
    assert backend.num_inflight == 0
    return {r.query_id: r for r in batch.results}


KINDS = ["nan", "inf", "-inf", "string", "bool", "too_long", "empty", "none", "raise", "count"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_bad_score_fails_only_its_query_in_every_mode(kind: str) -> None:
    want = {q: fingerprint(r) for q, r in (await _run("baseline", Scorer("good"))).items()}
    for mode in MODES:
        got = await _run(mode, Scorer(kind))
        bad = got["bad"]
        assert bad.status == "failed", (mode, bad.status)
        assert bad.errors and all("reward node 'judge'" in e for e in bad.errors), bad.errors
        for qid in ("a", "b"):
            assert got[qid].status == "ok", (mode, qid, got[qid].errors)
            assert fingerprint(got[qid]) == want[qid], (mode, qid)


async def test_a_hanging_scorer_holds_only_its_query_in_every_mode() -> None:
    """Shared reward batches that hang are split per query long before the good queries'
    deadline: only the bad query times out."""
    want = {q: fingerprint(r) for q, r in (await _run("baseline", Scorer("good"))).items()}
    for mode in MODES:
        scorer = Scorer("hang")
        got = await _run(mode, scorer, timeout=0.6)
        assert got["bad"].status == "timeout", (mode, got["bad"].status)
        for qid in ("a", "b"):
            assert got[qid].status == "ok", (mode, qid, got[qid].errors)
            assert fingerprint(got[qid]) == want[qid], (mode, qid)
        assert scorer.hung  # the bad batch really hung


class OneRequestPerItem(Scorer):
    """A scorer that is a model keyed by item (the policy judging itself sends
    ``<node>/judge``): an item already in flight is refused, as the engine refuses a
    request id twice."""

    def __init__(self) -> None:
        super().__init__("hang")
        self.inflight: set[str] = set()
        self.refused: list[str] = []

    async def __call__(self, items: Sequence[RewardItem]) -> list[Any]:
        ids = [i.request_id for i in items]
        again = [i for i in ids if i in self.inflight]
        if again:
            self.refused.extend(again)
            raise RuntimeError(f"{again[0]!r} is already in flight")
        self.inflight.update(ids)
        try:
            return await super().__call__(items)
        finally:
            self.inflight.difference_update(ids)


async def test_a_hung_shared_call_ends_before_its_items_are_scored_again() -> None:
    """Splitting a hung shared call cancels it first: its good items, sent again per
    query, are never in flight twice (a self-judging engine refused them and failed every
    node of the batch)."""
    want = {q: fingerprint(r) for q, r in (await _run("baseline", Scorer("good"))).items()}
    for mode in MODES:
        scorer = OneRequestPerItem()
        got = await _run(mode, scorer, timeout=0.6)
        assert got["bad"].status == "timeout", (mode, got["bad"].status)
        assert not scorer.refused, (mode, scorer.refused)
        for qid in ("a", "b"):
            assert got[qid].status == "ok", (mode, qid, got[qid].errors)
            assert fingerprint(got[qid]) == want[qid], (mode, qid)


class BlockingSyncScorer:
    """A sync scorer (``time.sleep``, as a blocking model call would) that blocks for the bad
    question's items, and counts the calls that hold them."""

    def __init__(self, block_s: float) -> None:
        self.block_s = block_s
        self.inner = Scorer("good")
        self.bad_calls = 0
        self.late: list[float] = []  # when each blocked call returned (its result unused)
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, items: Sequence[RewardItem]) -> list[Any]:
        with self._lock:
            self.threads.add(threading.current_thread().name)
        if any(i.question == BAD for i in items):
            with self._lock:
                self.bad_calls += 1
            time.sleep(self.block_s)
            self.late.append(time.monotonic())
        return [self.inner.good(i) for i in items]


SEVEN = [{"question": f"puzzle {c}", "query_id": c} for c in "abcdef"] + [
    {"question": BAD, "query_id": "bad"}
]


async def test_a_blocking_sync_scorer_fails_only_its_query_in_every_mode() -> None:
    """The issue's case: a sync scorer that sleeps on one query's items once made all six
    good queries of its batch time out, and was called again after its query had timed out.
    It runs in a thread now, never mixing queries in one call: the bad query times out
    alone, the six finish with baseline's answers, and the bad items are sent once."""
    want = {
        q: fingerprint(r)
        for q, r in (await _run("baseline", Scorer("good"), queries=SEVEN)).items()
    }
    loop_thread = threading.current_thread().name
    for mode in MODES:
        scorer = BlockingSyncScorer(block_s=1.5)
        got = await _run(mode, scorer, timeout=0.8, queries=SEVEN)
        assert got["bad"].status == "timeout", (mode, got["bad"].status, got["bad"].errors)
        for qid in "abcdef":
            assert got[qid].status == "ok", (mode, qid, got[qid].errors)
            assert fingerprint(got[qid]) == want[qid], (mode, qid)
        assert scorer.bad_calls == 1, (mode, scorer.bad_calls)
        assert loop_thread not in scorer.threads  # never on the event loop


async def test_a_sync_scorer_s_late_result_is_discarded() -> None:
    """The blocked call returns after its query ended: nothing is scored from it and no
    second call follows."""
    scorer = BlockingSyncScorer(block_s=0.3)
    got = await _run("full", scorer, timeout=0.1)
    assert got["bad"].status == "timeout"
    await asyncio.sleep(0.5)  # the thread wakes and hands back a result nobody takes
    assert len(scorer.late) == 1 and scorer.bad_calls == 1
    assert got["a"].status == got["b"].status == "ok"


class RangedPrm(RewardBackend):
    """A reward backend that states its range, and breaks it for the bad question."""

    score_range = (0.0, 1.0)

    def __init__(self) -> None:
        self.inner = Scorer("good")

    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        return [(1.5,) * len(i.steps) if i.question == BAD else self.inner.good(i) for i in items]


@pytest.mark.parametrize("mode", ["baseline", "full"])
async def test_a_score_outside_the_backends_range_fails_only_its_query(mode: str) -> None:
    got = await _run(mode, RangedPrm())
    assert got["bad"].status == "failed"
    assert any("outside the scorer's range" in e for e in got["bad"].errors)
    assert got["a"].status == got["b"].status == "ok"


def test_check_score_accepts_real_numbers_and_names_what_is_wrong() -> None:
    item = RewardItem("q/0/1", "question", ("s1", "s2"))
    assert check_score(0.5, item, None) == (0.5,)
    assert check_score((0.1, 0.9), item, (0.0, 1.0)) == (0.1, 0.9)
    assert check_score([1], item, None) == (1.0,)  # one score for the trace
    import numpy as np

    assert check_score(np.float32(0.25), item, None) == (0.25,)
    assert check_score(np.array([0.5, 0.5]), item, None) == (0.5, 0.5)
    for bad, words in (
        ("12", "string"),
        (True, "not a real number"),
        (float("nan"), "not finite"),
        ((0.1, 0.2, 0.3), "3 scores for q/0/1"),
        ((0.1, "x"), "not a real number"),
        (None, "not a real number"),
    ):
        with pytest.raises(ValueError, match=words):
            check_score(bad, item, None)
    with pytest.raises(ValueError, match="outside"):
        check_score(-0.1, item, (0.0, 1.0))


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


class ColdScorer(Scorer):
    """Every call that starts before any call has finished is slow (a cold reward model
    under a run's first wave); records each item it is sent."""

    def __init__(self) -> None:
        super().__init__("good")
        self.sent: list[str] = []
        self.finished = 0

    async def __call__(self, items: Sequence[RewardItem]) -> list[Any]:
        self.sent.extend(i.request_id for i in items)
        if not self.finished:
            await asyncio.sleep(0.3)
        self.finished += 1
        return await super().__call__(items)


@pytest.mark.parametrize("mode", ["naive", "full"])
async def test_a_slow_first_shared_call_is_cold_not_hung(mode: str) -> None:
    """Before any call has finished there is no typical latency: a slow first shared batch
    is not split, and no item is scored twice (a run's first wave was, at 50 ms)."""
    want = {q: fingerprint(r) for q, r in (await _run("baseline", Scorer("good"))).items()}
    good = [QUERIES[0], QUERIES[2]]
    scorer = ColdScorer()
    got = await _run(mode, scorer, queries=good)
    assert all(r.status == "ok" for r in got.values())
    assert {q: fingerprint(r) for q, r in got.items()} == {q: want[q] for q in got}
    assert len(scorer.sent) == len(set(scorer.sent)), "an item was scored twice"
