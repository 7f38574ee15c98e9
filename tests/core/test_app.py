"""ToTApp as a langchain_core Runnable: invoke/ainvoke/batch/abatch, piping, input checks."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from conftest import RecordingBackend

from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.app import BatchResult, ToTApp, ToTResult
from spec_tot.config import ExecutorConfig
from spec_tot.errors import ConfigError, QueryTimeoutError
from spec_tot.graphs.toy import compile_toy, toy_questions
from spec_tot.tree import NodeStatus

BEAM = {"search": "beam", "search_params": {"n": 4, "width": 2}}


def make_app(backend: ScriptedBackend | None = None, **kwargs: Any) -> ToTApp:
    return compile_toy(backend=backend or ScriptedBackend(), **{**BEAM, **kwargs})


def assert_ok(result: Any, question: str) -> None:
    assert isinstance(result, ToTResult)
    assert result.status == "ok"
    assert result.tree.question == question
    assert result.answer in {"24", "23", "25", "12"}
    assert result.solved == (result.answer == "24")
    assert result.errors == ()
    assert result.latency_s > 0


def test_is_a_runnable() -> None:
    from langchain_core.runnables import Runnable

    app = make_app()
    assert isinstance(app, Runnable)


def test_invoke_returns_a_result() -> None:
    backend = ScriptedBackend()
    result = make_app(backend).invoke("toy puzzle 0")
    assert_ok(result, "toy puzzle 0")
    assert result.query_id == "q0"
    assert all(n.status is NodeStatus.SCORED for n in result.tree.nodes())
    best = max(result.tree.terminals(), key=lambda n: n.reward or 0.0)
    assert result.score == best.reward  # beam answers with its best-scored terminal
    assert result.answer == best.answer
    assert result.votes and result.answer in result.votes
    assert backend.num_inflight == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.status = "x"  # type: ignore[misc]


async def test_ainvoke_returns_a_result() -> None:
    result = await make_app().ainvoke({"question": "toy puzzle 1", "target": "24"})
    assert_ok(result, "toy puzzle 1")


async def test_ainvoke_keeps_extra_state_for_check() -> None:
    app = make_app()
    hit = await app.ainvoke({"question": "toy puzzle 1", "target": "24"})
    miss = await app.ainvoke({"question": "toy puzzle 1", "target": "nope"})
    assert hit.answer == miss.answer == "24"
    assert hit.solved and not miss.solved


async def test_query_ids_are_assigned_in_order_and_explicit_ids_kept() -> None:
    app = make_app()
    first = await app.ainvoke("a")
    second = await app.ainvoke("b")
    named = await app.ainvoke({"question": "c", "query_id": "mine"})
    assert (first.query_id, second.query_id, named.query_id) == ("q0", "q1", "mine")
    assert all(n.id.startswith("mine") for n in named.tree.nodes())


def test_batch_returns_results_in_input_order_in_one_loop() -> None:
    backend = RecordingBackend()
    questions = [q["question"] for q in toy_questions(6)]
    results = make_app(backend).batch(questions)
    assert len(results) == 6
    for question, result in zip(questions, results, strict=True):
        assert_ok(result, question)
    assert len(backend.loops) == 1  # every request ran on one event loop
    assert backend.peak_inflight > 4  # queries overlapped on the shared backend
    assert len({r.query_id for r in results}) == 6


async def test_abatch_and_max_concurrency() -> None:
    backend = RecordingBackend(ScriptedConfig(token_latency_s=0.0002))
    app = make_app(backend)
    results = await app.abatch(toy_questions(4))
    assert [r.tree.question for r in results] == [f"toy puzzle {i}" for i in range(4)]
    assert all(r.status == "ok" for r in results)
    assert backend.peak_inflight > 4
    serial_backend = RecordingBackend(ScriptedConfig(token_latency_s=0.0002))
    serial = await make_app(serial_backend).abatch(toy_questions(4), {"max_concurrency": 1})
    assert all(r.status == "ok" for r in serial)
    assert serial_backend.peak_inflight <= 4
    assert [tuple(sorted(n.text for n in r.tree.nodes())) for r in serial] == [
        tuple(sorted(n.text for n in r.tree.nodes())) for r in results
    ]


def test_pipe_with_runnable_lambda() -> None:
    from langchain_core.runnables import RunnableLambda

    chain = RunnableLambda(lambda n: f"toy puzzle {n}") | make_app()
    result = chain.invoke(7)
    assert_ok(result, "toy puzzle 7")
    results = chain.batch([1, 2])
    assert [r.tree.question for r in results] == ["toy puzzle 1", "toy puzzle 2"]


async def test_pipe_async() -> None:
    from langchain_core.runnables import RunnableLambda

    chain = RunnableLambda(lambda n: {"question": f"toy puzzle {n}"}) | make_app()
    result = await chain.ainvoke(3)
    assert_ok(result, "toy puzzle 3")


def test_stream_yields_the_result() -> None:
    chunks = list(make_app().stream("toy puzzle 0"))
    assert len(chunks) == 1
    assert_ok(chunks[0], "toy puzzle 0")


async def test_sync_calls_inside_a_running_loop_run_on_a_worker_thread() -> None:
    # One bridge for every Runnable here (the chat models and the LangGraph app too): a sync
    # call inside a running loop (a notebook cell) runs on a fresh loop in a worker thread.
    app = make_app()
    assert_ok(app.invoke("toy puzzle 0"), "toy puzzle 0")
    [one] = app.batch(["toy puzzle 1"])
    assert_ok(one, "toy puzzle 1")
    batch = app.run_batch(["toy puzzle 2"])
    assert_ok(batch.results[0], "toy puzzle 2")


@pytest.mark.parametrize("bad", [5, None, {"q": "no question key"}, ["list"]])
def test_bad_input_is_a_config_error_naming_input(bad: Any) -> None:
    backend = ScriptedBackend()
    app = make_app(backend)
    with pytest.raises(ConfigError) as info:
        app.invoke(bad)
    assert info.value.field == "input"
    assert isinstance(info.value, ValueError)
    assert backend.num_generate_calls == 0


def test_one_bad_input_fails_the_batch_before_any_work() -> None:
    backend = ScriptedBackend()
    with pytest.raises(ConfigError) as info:
        make_app(backend).batch(["fine", 42, "also fine"])
    assert info.value.field == "input"
    assert "int" in str(info.value)
    assert backend.num_generate_calls == 0


def test_custom_input_to_state() -> None:
    app = make_app(input_to_state=lambda n: {"question": f"toy puzzle {n}", "steps": []})
    assert_ok(app.invoke(9), "toy puzzle 9")


async def test_ainvoke_timeout_raises() -> None:
    backend = ScriptedBackend(ScriptedConfig(hang_prefixes=("slow",)))
    app = make_app(backend, config=ExecutorConfig(query_timeout_s=0.1))
    with pytest.raises(QueryTimeoutError, match="slow"):
        await app.ainvoke({"question": "x", "query_id": "slow"})
    assert backend.num_inflight == 0
    # the same query in a batch is reported, not raised
    batch = await app.abatch([{"question": "x", "query_id": "slow"}, "y"])
    assert [r.status for r in batch] == ["timeout", "ok"]


async def test_ainvoke_failed_query_is_returned_not_raised() -> None:
    backend = ScriptedBackend(ScriptedConfig(fail_prefixes=("q0",)))
    result = await make_app(backend).ainvoke("x")
    assert result.status == "failed"
    assert result.answer is None and result.score is None and result.votes == {}
    assert not result.solved


def test_run_batch_returns_results_and_metrics() -> None:
    out = make_app().run_batch(toy_questions(3))
    assert isinstance(out, BatchResult)
    assert len(out.results) == 3
    assert out.metrics.queries == 3
    assert out.metrics.solved == sum(r.solved for r in out.results)


def test_named_backend() -> None:
    app = compile_toy(backend="scripted", backend_options={"p_correct": 1.0}, **BEAM)
    result = app.invoke("toy puzzle 0")
    assert result.status == "ok" and result.answer == "24" and result.solved
    assert isinstance(app.backend, ScriptedBackend)
    assert app.reward_scorer is app.backend


async def test_aclose_reaches_the_backend() -> None:
    closed: list[bool] = []

    class Closing(ScriptedBackend):
        async def aclose(self) -> None:
            closed.append(True)

    app = make_app(Closing())
    await app.aclose()
    assert closed == [True]
    lazy = compile_toy(backend="scripted", **BEAM)
    await lazy.aclose()  # never created: nothing to close, no error
    assert lazy._backend is None


async def test_concurrent_ainvokes_share_the_backend() -> None:
    backend = ScriptedBackend(ScriptedConfig(token_latency_s=0.0002))
    app = make_app(backend)
    results = await asyncio.gather(*(app.ainvoke(q) for q in toy_questions(5)))
    assert len({r.query_id for r in results}) == 5
    assert all(r.status == "ok" for r in results)
    assert backend.peak_inflight > 4
