"""ToTChatModel and ChatSpecTot: langchain-tests' standard unit AND integration suites, on the
scripted backend and on the embedded engine, then what the suites do not cover: streamed
search progress, search events in astream_events, failures that raise (so fallbacks work),
unusable input, and ChatSpecTot inside a speculative LangGraph branch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from chat_setups import engine, engine_backend, free_text_app, toy_app  # noqa: F401
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from spec_tot import ExecutorConfig
from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.chat_model import ToTChatModel
from spec_tot.chat_spec_tot import ChatSpecTot
from spec_tot.errors import BackendError, ConfigError, ExecutionError, QueryTimeoutError
from spec_tot.requests import GenerateRequest, GenerateResult


# -- the standard suites ----------------------------------------------------------------------
class _Suite:
    """One chat model under a langchain-tests suite: its class and its parameters."""

    model_class: type[Any]
    params: Callable[[], dict[str, Any]]

    @property
    def chat_model_class(self) -> type[Any]:
        return self.model_class

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return type(self).params()


class _Integration(_Suite, ChatModelIntegrationTests):
    """What these models do not have, so the suite skips it (each skip names it)."""

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def model_override_value(self) -> str:
        return "another-name"  # reported as the model name of that call


def _tot_scripted() -> dict[str, Any]:
    return {"app": toy_app()}


def _spec_scripted() -> dict[str, Any]:
    return {"backend": ScriptedBackend()}


def _tot_engine() -> dict[str, Any]:
    return {"app": free_text_app(engine_backend())}


def _spec_engine() -> dict[str, Any]:
    return {"backend": engine_backend(), "max_tokens": 12, "seed": 0}


class TestToTChatModelUnit(_Suite, ChatModelUnitTests):
    model_class, params = ToTChatModel, staticmethod(_tot_scripted)


class TestChatSpecTotUnit(_Suite, ChatModelUnitTests):
    model_class, params = ChatSpecTot, staticmethod(_spec_scripted)


class TestToTChatModelScripted(_Integration):
    model_class, params = ToTChatModel, staticmethod(_tot_scripted)


class TestChatSpecTotScripted(_Integration):
    model_class, params = ChatSpecTot, staticmethod(_spec_scripted)


@pytest.mark.usefixtures("engine")
class TestToTChatModelEngine(_Integration):
    model_class, params = ToTChatModel, staticmethod(_tot_engine)


@pytest.mark.usefixtures("engine")
class TestChatSpecTotEngine(_Integration):
    model_class, params = ChatSpecTot, staticmethod(_spec_engine)


# -- beyond the suites ----------------------------------------------------------------------
def test_invoke_answers_with_tree_metrics_and_usage() -> None:
    model = ToTChatModel(app=toy_app(), extra_state={"target": "24"})
    reply = model.invoke([SystemMessage("be brief"), HumanMessage("toy puzzle 0")])
    direct = toy_app().invoke({"question": "toy puzzle 0", "target": "24"})
    assert isinstance(reply, AIMessage) and reply.content == direct.answer
    meta = reply.response_metadata
    assert meta["status"] == "ok" and meta["score"] == direct.score
    assert meta["tree"]["question"] == "toy puzzle 0" and meta["metrics"]["queries"] == 1
    usage = reply.usage_metadata
    assert usage is not None and usage["output_tokens"] == meta["metrics"]["output_tokens"] > 0


async def test_stream_yields_search_progress_then_the_answer() -> None:
    model = ToTChatModel(app=toy_app(config=ExecutorConfig(mode="full")))
    chunks = [c async for c in model.astream("toy puzzle 1")]
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    progress, last = chunks[:-1], chunks[-1]
    kinds = [e["event"] for c in progress for e in c.additional_kwargs["spec_tot_events"]]
    assert {"expanded", "scored"} <= set(kinds) and kinds[-1] == "answer"
    assert all(c.content == "" for c in progress) and last.chunk_position == "last"
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == last.content and full.usage_metadata == last.usage_metadata


async def test_search_events_reach_astream_events() -> None:
    model = ToTChatModel(app=toy_app())
    events = [e async for e in model.astream_events("toy puzzle 2", version="v2")]
    start = next(e for e in events if e["event"] == "on_chat_model_start")
    custom = [e for e in events if e["event"] == "on_custom_event"]
    assert {"expanded", "scored", "answer"} <= {e["name"] for e in custom}
    assert all(e["run_id"] == start["run_id"] for e in custom)


def test_failed_and_timed_out_searches_raise_so_fallbacks_work() -> None:
    failing = ScriptedBackend(ScriptedConfig(fail_prefixes=("bad",)))
    model = ToTChatModel(app=toy_app(failing), extra_state={"query_id": "bad"})
    with pytest.raises(ExecutionError, match="failed"):
        model.invoke("toy puzzle 3")
    hanging = ScriptedBackend(ScriptedConfig(hang_prefixes=("slow",)))
    slow = ToTChatModel(app=toy_app(hanging), extra_state={"query_id": "slow"}, timeout=0.05)
    with pytest.raises(QueryTimeoutError):
        slow.invoke("toy puzzle 3")
    assert hanging.num_inflight == 0
    backup = ToTChatModel(app=toy_app(), extra_state={"query_id": "b"})
    reply = model.with_fallbacks([backup]).invoke("toy puzzle 3")
    assert reply.content == backup.invoke("toy puzzle 3").content


def test_unusable_input_raises_a_clear_error() -> None:
    model = ToTChatModel(app=toy_app())
    with pytest.raises(ConfigError, match="human message"):
        model.invoke([SystemMessage("hi")])
    image = HumanMessage(content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    with pytest.raises(ConfigError, match="only text"):
        model.invoke([image])
    with pytest.raises(ConfigError, match="empty"):
        model.invoke([HumanMessage("  ")])
    with pytest.raises(ValueError, match="backend: expected a GenerationBackend"):
        ChatSpecTot(backend=object())  # pydantic wraps the ConfigError


def test_game24_app_refuses_a_question_that_is_not_a_puzzle() -> None:
    from spec_tot.graphs import game24

    app = game24.compile_game24(backend=engine_backend(), search="beam")
    with pytest.raises(ExecutionError, match="puzzle"):
        ToTChatModel(app=app).invoke("Hello")


class Failing(ScriptedBackend):
    def __init__(self, *, hang: bool = False) -> None:
        super().__init__()
        self.hang = hang

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.hang:
            await asyncio.sleep(3600)
        raise BackendError("failing", f"{request.request_id} failed")


def test_chat_spec_tot_raises_backend_errors_so_fallbacks_work() -> None:
    model = ChatSpecTot(backend=Failing())
    with pytest.raises(BackendError, match="failed"):
        model.invoke("hi")
    with pytest.raises(BackendError, match="no answer within"):
        ChatSpecTot(backend=Failing(hang=True), timeout=0.05).invoke("hi")
    backup = ChatSpecTot(backend=ScriptedBackend(), seed=1)
    assert model.with_fallbacks([backup]).invoke("hi").content == backup.invoke("hi").content


@pytest.mark.usefixtures("engine")
async def test_chat_spec_tot_streams_tokens_when_the_backend_streams() -> None:
    backend = engine_backend()
    model = ChatSpecTot(backend=backend, max_tokens=12, seed=0, temperature=0)
    assert model.streams() and not ChatSpecTot(backend=ScriptedBackend()).streams()
    chunks = [c async for c in model.astream("4 4 6 8")]
    assert len(chunks) > 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    *tokens, last = chunks
    assert all(c.usage_metadata is None for c in tokens) and last.chunk_position == "last"
    whole = await model.ainvoke("4 4 6 8")
    assert "".join(str(c.content) for c in chunks) == whole.content
    assert last.usage_metadata == whole.usage_metadata
    assert last.response_metadata["finish_reason"] == whole.response_metadata["finish_reason"]
    assert "".join(str(c.content) for c in model.stream("4 4 6 8")) == whole.content
    # leaving a stream early aborts its request
    stream = model.astream("1 2 3 4")
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(200):
        if backend.num_inflight == 0:
            break
        await asyncio.sleep(0.01)
    assert backend.num_inflight == 0


@pytest.mark.usefixtures("engine")
def test_short_lived_stream_loops_leave_the_engine_serving() -> None:
    """Each sync ``stream`` runs on a loop that closes right after its last token; the
    engine's worker posting the request's end there must not die of it (it did, within a
    few calls: every later request then hung)."""
    model = ChatSpecTot(backend=engine_backend(), max_tokens=2, seed=0, timeout=30)
    for _ in range(40):
        assert "".join(str(c.content) for c in model.stream("Hello"))
    assert model.invoke("Hello").content  # raises BackendError after 30 s if none answers


async def test_a_tot_app_as_a_langgraph_node_streams_its_search_to_langgraphs_writer() -> None:
    """A ToT app used as a node of a LangGraph graph: its search events reach LangGraph's
    ``custom`` stream (its public stream writer), one chunk per event."""
    from langgraph.graph import START, StateGraph
    from typing_extensions import TypedDict

    class State(TypedDict, total=False):
        question: str

    builder = StateGraph(State)
    builder.add_node("solve", toy_app())
    builder.add_edge(START, "solve")
    graph = builder.compile()
    chunks = [c async for c in graph.astream({"question": "toy puzzle 3"}, stream_mode="custom")]
    kinds = [c["event"] for c in chunks]
    assert {"expanded", "scored"} <= set(kinds) and kinds[-1] == "answer"
