"""``ToTChatModel``: a compiled ToT app as a LangChain chat model.

Messages in (the last human message is the question), the search's answer out. While the
search runs, its events (nodes expanded, scored, pruned, adopted, cancelled) go to the
callback manager as custom events (``astream_events`` shows them under the model's run),
and ``stream`` yields them as content-free ``AIMessageChunk``s (``additional_kwargs
["spec_tot_events"]``) before the answer chunk. ``usage_metadata`` counts the question's
tokens in and every token the search generated out; ``response_metadata`` holds the status,
score, votes, the tree (``SearchTree.to_dict()``) and the run's metrics.

A search that fails, ends without an answer or passes ``timeout`` raises (``ExecutionError``
/ ``QueryTimeoutError``), so ``with_retry`` and ``with_fallbacks`` work; input the search
cannot use (no human message, non-text content) raises ``ConfigError``. Sampling is the
app's own (its thought nodes' ``SamplingParams``): ``temperature``/``max_tokens`` are
reported for tracing only, ``stop`` cuts the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import (
    AsyncCallbackManager,
    AsyncCallbackManagerForLLMRun,
    BaseCallbackHandler,
    CallbackManagerForLLMRun,
)
from langchain_core.callbacks.manager import ahandle_event, handle_event
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig, ensure_config
from pydantic import Field

from spec_tot._private.threads import iterate_in_thread, run_sync
from spec_tot.app import ToTApp, ToTResult
from spec_tot.chat_common import (
    SpecTotChat,
    cut_at_stop,
    last_chunk,
    last_human_text,
    usage,
)
from spec_tot.errors import ExecutionError, QueryTimeoutError
from spec_tot.events import ToTEvent
from spec_tot.metrics import RunMetrics

__all__ = ["ToTChatModel"]

Dispatch = Callable[[str, dict[str, Any]], Awaitable[None]]


class ToTChatModel(SpecTotChat):
    """A chat model whose answer is a Tree-of-Thought search by ``app``.

    ``input_key``: the state key the question goes to; ``extra_state``: more input state for
    every query (a target for ``check``, ...); ``progress``: stream search events as chunks.
    """

    app: ToTApp
    model_name: str = Field(default="spec-tot", alias="model")
    input_key: str = "question"
    extra_state: dict[str, Any] = Field(default_factory=dict)
    temperature: float | None = None
    max_tokens: int | None = None
    timeout: float | None = None
    stop: list[str] | None = None
    max_retries: int = 0
    progress: bool = True

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "mode": self.app.config.mode}

    # -- the search -----------------------------------------------------------------------
    async def _search(
        self, messages: list[BaseMessage], dispatch: Dispatch | None
    ) -> AsyncIterator[ToTEvent | tuple[ToTResult, RunMetrics]]:
        """Events as they happen, then (result, metrics); raises when the search fails."""
        state = {**self.extra_state, self.input_key: last_human_text(messages)}
        events: asyncio.Queue[ToTEvent] = asyncio.Queue()

        async def search() -> Any:
            async with asyncio.timeout(self.timeout):
                return await self.app.arun_batch([state], on_event=events.put_nowait)

        task = asyncio.ensure_future(search())
        try:
            while not task.done() or not events.empty():
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait([task, getter], return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                event = getter.result()
                if dispatch is not None:
                    await dispatch(event.kind, event.payload())
                yield event
            try:
                batch = task.result()
            except TimeoutError as exc:
                raise QueryTimeoutError(f"the search exceeded {self.timeout}s") from exc
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait([task])
        result = batch.results[0]
        if result.status == "timeout":
            raise QueryTimeoutError("; ".join(result.errors) or "the search timed out")
        if result.status != "ok" or result.answer is None:
            why = "; ".join(result.errors) or "it ended without an answer"
            raise ExecutionError(f"ToT search {result.query_id} failed: {why}")
        yield result, batch.metrics

    def _message(
        self,
        result: ToTResult,
        metrics: RunMetrics,
        stop: list[str] | None,
        messages: list[BaseMessage],
        name: str,
    ) -> AIMessage:
        text = cut_at_stop(result.answer or "", stop or self.stop)
        metadata = {
            "model_name": name,
            "query_id": result.query_id,
            "status": result.status,
            "score": result.score,
            "solved": result.solved,
            "votes": dict(result.votes),
            "errors": list(result.errors),
            "truncated": result.truncated,
            "latency_s": result.latency_s,
            "tree": result.tree.to_dict(),
            "metrics": dataclasses.asdict(metrics),
        }
        tokens = self.app.backend.count_tokens(last_human_text(messages))
        return AIMessage(
            content=text,
            response_metadata=metadata,
            usage_metadata=usage(tokens, metrics.output_tokens),
        )

    async def _answer(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        dispatch: Dispatch | None,
        name: str,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for item in self._search(messages, dispatch):
            if isinstance(item, ToTEvent):
                if self.progress:
                    payload = {"event": item.kind, **item.payload()}
                    chunk = AIMessageChunk(
                        content="", additional_kwargs={"spec_tot_events": [payload]}
                    )
                    yield ChatGenerationChunk(message=chunk)
                continue
            yield last_chunk(self._message(*item, stop, messages, name))

    # -- LangChain's entry points ---------------------------------------------------------
    async def _collect(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        dispatch: Dispatch | None,
        name: str,
    ) -> ChatResult:
        async for item in self._search(messages, dispatch):
            if not isinstance(item, ToTEvent):
                message = self._message(*item, stop, messages, name)
                return ChatResult(generations=[ChatGeneration(message=message)])
        raise ExecutionError("the search returned nothing")  # pragma: no cover

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        name = kwargs.get("model", self.model_name)
        return await self._collect(messages, stop, _run_dispatch(run_manager), name)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        name = kwargs.get("model", self.model_name)
        return run_sync(self._collect(messages, stop, _run_dispatch(run_manager), name))

    # LangChain's stream/astream call _stream/_astream without the run's callback manager;
    # a handler added for the call learns the run id, so search events still go to the
    # callbacks as events of this model's run.
    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[AIMessageChunk]:
        config, target = _with_run_capture(config)
        token = _STREAM_TARGET.set(target)
        try:
            async for chunk in super().astream(input, config, **kwargs):
                yield chunk
        finally:
            with contextlib.suppress(ValueError):  # closed from another context
                _STREAM_TARGET.reset(token)

    def stream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[AIMessageChunk]:
        config, target = _with_run_capture(config)
        token = _STREAM_TARGET.set(target)
        try:
            yield from super().stream(input, config, **kwargs)
        finally:
            with contextlib.suppress(ValueError):
                _STREAM_TARGET.reset(token)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        dispatch = _run_dispatch(run_manager) or _captured_dispatch()
        name = kwargs.get("model", self.model_name)
        async for chunk in self._answer(messages, stop, dispatch, name):
            yield chunk

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        dispatch = _run_dispatch(run_manager) or _captured_dispatch()
        name = kwargs.get("model", self.model_name)
        yield from iterate_in_thread(self._answer(messages, stop, dispatch, name))


class _RunCapture(BaseCallbackHandler):
    """Remembers the id of the chat-model run it is handed to."""

    run_id: UUID | None = None

    def on_chat_model_start(
        self, serialized: Any, messages: Any, *, run_id: UUID, **kwargs: Any
    ) -> None:
        if self.run_id is None:
            self.run_id = run_id


_STREAM_TARGET: ContextVar[tuple[_RunCapture, Any] | None] = ContextVar(
    "spec_tot_tot_chat_stream", default=None
)


def _with_run_capture(config: RunnableConfig | None) -> tuple[RunnableConfig, Any]:
    config = ensure_config(config)
    capture = _RunCapture()
    callbacks = config.get("callbacks")
    if callbacks is None:
        merged: Any = [capture]
    elif isinstance(callbacks, list):
        merged = [*callbacks, capture]
    else:
        merged = callbacks.copy()
        merged.add_handler(capture, inherit=False)
    return {**config, "callbacks": merged}, (capture, merged)


def _captured_dispatch() -> Dispatch | None:
    target = _STREAM_TARGET.get()
    if target is None:
        return None
    capture, callbacks = target
    manager = AsyncCallbackManager.configure(callbacks)

    async def dispatch(name: str, data: dict[str, Any]) -> None:
        if capture.run_id is not None:
            await manager.on_custom_event(name, data, run_id=capture.run_id)

    return dispatch


def _run_dispatch(run_manager: Any) -> Dispatch | None:
    """Search events as custom events of the model's own run (``astream_events``); the
    run manager is an async or a sync one."""
    if run_manager is None:
        return None
    manager = run_manager
    args = ("on_custom_event", "ignore_custom_event")

    async def dispatch(name: str, data: dict[str, Any]) -> None:
        meta = {"run_id": manager.run_id, "tags": manager.tags, "metadata": manager.metadata}
        if isinstance(manager, AsyncCallbackManagerForLLMRun):
            await ahandle_event(manager.handlers, *args, name, data, **meta)
        else:
            handle_event(manager.handlers, *args, name, data, **meta)

    return dispatch
