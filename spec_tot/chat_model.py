"""``ToTChatModel``: a compiled ToT app as a LangChain chat model.

Messages in (the last human message is the question), the ToT answer out as an ``AIMessage``;
``response_metadata`` holds the query's status, score, votes, the search tree
(``SearchTree.to_dict()``) and the run's metrics. Sampling is the app's own (its thought
nodes' ``SamplingParams``): the standard chat-model parameters are accepted and reported
for tracing, and ``stop`` cuts the answer text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict, Field

from spec_tot.app import ToTApp
from spec_tot.errors import ConfigError

__all__ = ["ToTChatModel"]


def _question(messages: Sequence[BaseMessage]) -> str:
    for message in reversed(messages):
        if isinstance(message, HumanMessage):
            return message.text
    raise ConfigError("messages", "ToTChatModel needs at least one human message (the question)")


def _cut(text: str, stop: Sequence[str] | None) -> str:
    for word in stop or ():
        if word and word in text:
            text = text[: text.index(word)]
    return text


class ToTChatModel(BaseChatModel):
    """A chat model whose answer is a Tree-of-Thought search by ``app``.

    ``input_key``: the state key the question goes to (the app's default input reads
    ``question``); ``extra_state``: more input state for every query (a target for
    ``check``, ...).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    app: ToTApp
    model_name: str = Field(default="spec-tot", alias="model")
    input_key: str = "question"
    extra_state: dict[str, Any] = Field(default_factory=dict)
    temperature: float | None = None
    max_tokens: int | None = None
    timeout: float | None = None
    stop: list[str] | None = None
    max_retries: int = 0
    streaming: bool = False

    @property
    def _llm_type(self) -> str:
        return "spec-tot"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "mode": self.app.config.mode}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="spec_tot",
            ls_model_name=str(kwargs.get("model", self.model_name)),
            ls_model_type="chat",
        )
        if self.temperature is not None:
            params["ls_temperature"] = self.temperature
        if self.max_tokens is not None:
            params["ls_max_tokens"] = self.max_tokens
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        state = {**self.extra_state, self.input_key: _question(messages)}
        batch = await self.app.arun_batch([state])
        result = batch.results[0]
        text = _cut(result.answer or "", stop or self.stop)
        metadata = {
            "model_name": self.model_name,
            "query_id": result.query_id,
            "status": result.status,
            "score": result.score,
            "solved": result.solved,
            "votes": dict(result.votes),
            "errors": list(result.errors),
            "truncated": result.truncated,
            "latency_s": result.latency_s,
            "tree": result.tree.to_dict(),
            "metrics": dataclasses.asdict(batch.metrics),
        }
        message = AIMessage(content=text, response_metadata=metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        coro = self._agenerate(messages, stop, None, **kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        # Called from inside a running loop (a notebook): run the search on its own loop.
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, coro).result()
