"""A deterministic LangChain chat model: its reply is a function of its input.

``ScriptedChatModel(respond=...)`` stands in for a hosted chat model in tests, examples and
benchmarks of LangGraph graphs: ``respond(messages, tools, index)`` returns the reply (a
string or an ``AIMessage`` with tool calls) for sample ``index`` of a call, and the latency
of each sample is drawn from ``[min_latency_s, max_latency_s]`` by a hash of (``seed``, the
input, the index): random-looking, reproducible, and another schedule with another seed.
It supports ``bind_tools`` and so ``with_structured_output``, ``n`` samples per call (as
``generate(..., n=3)``), ``stop``, streaming (word by word) and ``usage_metadata``, and it
counts its calls (``num_calls``, thread-safe: sync nodes call it from worker threads).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr

from spec_tot.chat_common import cut_at_stop, usage
from spec_tot.errors import ConfigError

__all__ = ["Responder", "ScriptedChatModel", "echo", "render", "stable_unit"]

Responder = Callable[[list[BaseMessage], list[dict[str, Any]], int], "str | AIMessage"]


def render(messages: Sequence[BaseMessage]) -> str:
    """The messages as one text (role, then content), the input the reply depends on."""
    lines = []
    for m in messages:
        calls = getattr(m, "tool_calls", None) or []
        extra = "".join(f" [{c['name']}({sorted(c['args'].items())})]" for c in calls)
        lines.append(f"{m.type}: {m.text}{extra}")
    return "\n".join(lines)


def stable_unit(*parts: object) -> float:
    """A number in [0, 1) that depends only on ``parts`` (not on the process's hash seed)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def echo(messages: list[BaseMessage], tools: list[dict[str, Any]], index: int) -> str:
    """The default responder: a short reply derived from the last message."""
    last = messages[-1].text if messages else ""
    return f"reply {int(stable_unit(render(messages), index) * 1000)} to: {last[:40]}"


class ScriptedChatModel(BaseChatModel):
    """A chat model whose reply is ``respond(messages, tools, index)``; see module doc."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    respond: Responder = Field(default=echo)
    min_latency_s: float = 0.0
    max_latency_s: float = 0.0
    seed: int = 0
    model_name: str = Field(default="scripted-chat", alias="model")
    _calls: int = PrivateAttr(default=0)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def model_post_init(self, context: Any) -> None:
        if not 0 <= self.min_latency_s <= self.max_latency_s:
            raise ConfigError("min_latency_s", "need 0 <= min_latency_s <= max_latency_s")

    @property
    def _llm_type(self) -> str:
        return "scripted-chat"

    @property
    def num_calls(self) -> int:
        """Model calls so far (a call with ``n`` samples is one call)."""
        return self._calls

    def bind_tools(
        self,
        tools: Sequence[Any],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        schemas = [convert_to_openai_tool(t) for t in tools]
        return self.bind(tools=schemas, tool_choice=tool_choice, **kwargs)

    # -- the reply ------------------------------------------------------------------------
    def _replies(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> list[tuple[float, AIMessage]]:
        with self._lock:
            self._calls += 1
        tools = [t.get("function", t) for t in kwargs.get("tools") or []]
        n = int(kwargs.get("n") or 1)
        text = render(messages)
        input_tokens = max(1, len(text) // 4)
        out = []
        for index in range(n):
            reply = self.respond(messages, tools, index)
            message = reply if isinstance(reply, AIMessage) else AIMessage(content=reply)
            if stop and isinstance(message.content, str):
                message = message.model_copy(update={"content": cut_at_stop(message.content, stop)})
            message = message.model_copy(
                update={
                    "usage_metadata": usage(input_tokens, max(1, len(message.text) // 4)),
                    "response_metadata": {"model_name": self.model_name},
                }
            )
            span = self.max_latency_s - self.min_latency_s
            delay = self.min_latency_s + span * stable_unit(self.seed, text, index)
            out.append((delay, message))
        return out

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        replies = self._replies(messages, stop, kwargs)
        time.sleep(max((d for d, _ in replies), default=0.0))
        return ChatResult(generations=[ChatGeneration(message=m) for _, m in replies])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        replies = self._replies(messages, stop, kwargs)
        await asyncio.sleep(max((d for d, _ in replies), default=0.0))
        return ChatResult(generations=[ChatGeneration(message=m) for _, m in replies])

    def _chunks(self, message: AIMessage) -> list[AIMessageChunk]:
        if message.tool_calls:
            return [
                AIMessageChunk(
                    content="",
                    tool_call_chunks=[
                        {"name": c["name"], "args": _json(c["args"]), "id": c["id"], "index": i}
                        for i, c in enumerate(message.tool_calls)
                    ],
                )
            ]
        text = message.text
        words = [w + " " for w in text.split(" ")]
        words[-1] = words[-1][:-1]
        return [AIMessageChunk(content=w) for w in words if w] or [AIMessageChunk(content="")]

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        delay, message = self._replies(messages, stop, {**kwargs, "n": 1})[0]
        chunks = self._chunks(message)
        for i, chunk in enumerate(chunks):
            time.sleep(delay / len(chunks))
            yield self._chunk(chunk, message, last=i == len(chunks) - 1, run_manager=run_manager)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        delay, message = self._replies(messages, stop, {**kwargs, "n": 1})[0]
        chunks = self._chunks(message)
        for i, chunk in enumerate(chunks):
            await asyncio.sleep(delay / len(chunks))
            out = self._chunk(chunk, message, last=i == len(chunks) - 1)
            if run_manager is not None:
                await run_manager.on_llm_new_token(out.text, chunk=out)
            yield out

    def _chunk(
        self,
        chunk: AIMessageChunk,
        message: AIMessage,
        *,
        last: bool,
        run_manager: CallbackManagerForLLMRun | None = None,
    ) -> ChatGenerationChunk:
        if last:
            chunk = chunk.model_copy(
                update={
                    "usage_metadata": message.usage_metadata,
                    "response_metadata": message.response_metadata,
                    "chunk_position": "last",
                }
            )
        out = ChatGenerationChunk(message=chunk)
        if run_manager is not None:
            run_manager.on_llm_new_token(out.text, chunk=out)
        return out


def _json(args: Any) -> str:
    import json

    return json.dumps(args)
