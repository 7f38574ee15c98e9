"""``ChatSpecTot``: a LangChain chat model over any spec-tot generation backend.

Put it in a LangGraph node (``prompt | ChatSpecTot(backend=...)``) and run the graph with
``from_langgraph``: calls made inside a branch carry the branch's identity
(``spec_tot.branch_context.current_branch``), so each request gets a hierarchical id under
the branch (a cancelled speculative branch is aborted on the engine by prefix) and the branch's
priority (the engine serves committed work first). Outside a branch a call is committed work
with an id of its own.

The backend is the embedded engine, SGLang, an OpenAI-compatible server, the scripted
backend, or any registered name (``backend="local"`` plus ``backend_options``). Messages
become one text prompt (``to_prompt``; default: their texts, one a line; give a chat
template for instruction-tuned models). ``seed`` makes a prompt's sample reproducible.
``stream``/``astream`` yield the text token by token when the backend streams (the embedded
engine: ``stream(request)``), the last chunk carrying ``usage_metadata`` and the finish
reason; a backend that cannot stream (the scripted one; SGLang and OpenAI-compatible, whose
adapters expose only ``generate``) answers in one chunk. A failed, aborted or timed-out
request raises (``BackendError``), so retries and fallbacks work.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from typing import Any, ClassVar

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import Field, PrivateAttr

from spec_tot._private.threads import iterate_in_thread, run_sync
from spec_tot.backends import (
    BackendRegistry,
    GenerationBackend,
    default_registry,
    start_backends,
)
from spec_tot.branch_context import BranchContext, current_branch
from spec_tot.chat_common import (
    SpecTotChat,
    cut_at_stop,
    last_chunk,
    messages_to_text,
    usage,
)
from spec_tot.errors import BackendError, ConfigError
from spec_tot.executor.hub import hub_for
from spec_tot.requests import (
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    StreamUpdate,
)
from spec_tot.seeds import stable_seed

__all__ = ["ChatSpecTot"]


class ChatSpecTot(SpecTotChat):
    """A chat model whose completions come from a spec-tot ``GenerationBackend``."""

    llm_type: ClassVar[str] = "spec-tot-backend"

    backend: Any = Field(description="a GenerationBackend, or a registered backend name")
    backend_options: dict[str, Any] = Field(default_factory=dict)
    registry: BackendRegistry | None = Field(default=None, exclude=True)
    model_name: str = Field(default="spec-tot", alias="model")
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop: list[str] | None = None
    seed: int | None = None
    timeout: float | None = None
    max_retries: int = 0
    to_prompt: Callable[[Sequence[BaseMessage]], str] | None = Field(default=None, exclude=True)
    _backend: GenerationBackend | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        if isinstance(self.backend, GenerationBackend):
            hub_for(self.backend)  # refuses, now, a backend that cannot hold its budget
            self._backend = self.backend
        elif not isinstance(self.backend, str):
            raise ConfigError(
                "backend", f"expected a GenerationBackend or a backend name, got {self.backend!r}"
            )
        self.sampling()  # validates temperature, top_p, top_k, max_tokens now
        super().model_post_init(context)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "backend": self.backend_name}

    @property
    def backend_name(self) -> str:
        return (
            self.backend
            if isinstance(self.backend, str)
            else self.generation_backend.capabilities.name
        )

    @property
    def generation_backend(self) -> GenerationBackend:
        """The backend (created from the registry on first use when given by name)."""
        if self._backend is None:
            registry = self.registry or default_registry()
            self._backend = registry.create(str(self.backend), **self.backend_options)
        return self._backend

    def sampling(self, stop: Sequence[str] | None = None, **kwargs: Any) -> SamplingParams:
        """The request's sampling: the model's fields, overridden per call by ``kwargs``."""
        return SamplingParams(
            temperature=float(kwargs.get("temperature", self.temperature)),
            top_p=float(kwargs.get("top_p", self.top_p)),
            top_k=int(kwargs.get("top_k", self.top_k)),
            max_tokens=int(kwargs.get("max_tokens", self.max_tokens)),
            stop=tuple(stop if stop is not None else self.stop or ()),
        )

    # -- one request ----------------------------------------------------------------------
    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[GenerateRequest, BranchContext | None]:
        prompt = (self.to_prompt or messages_to_text)(messages)
        sampling = self.sampling(stop, **kwargs)
        seed = kwargs.get("seed", self.seed)
        if seed is not None:
            sampling = dataclasses.replace(sampling, seed=stable_seed(seed, prompt))
        branch = current_branch.get()
        n = int(kwargs.get("n", 1))
        if branch is None:
            request = GenerateRequest(f"chat-{uuid.uuid4().hex[:16]}", sampling, prompt=prompt, n=n)
            return request, None
        request = GenerateRequest(
            branch.request_id(),
            sampling,
            prompt=prompt,
            n=n,
            priority=branch.priority,
            speculative=branch.speculative,
        )
        return request, branch

    @contextlib.asynccontextmanager
    async def _requesting(
        self,
        backend: GenerationBackend,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
    ) -> AsyncIterator[GenerateRequest]:
        """The request of one call, while it runs: admitted by the branch's runner (a
        speculative branch holds budget sequences), abortable with its branch, and counted
        as the backend's committed load unless speculative."""
        await start_backends(backend)  # an engine comes up before any budget is held on it
        branch = current_branch.get()
        admit = branch.admit(backend, int(kwargs.get("n", 1))) if branch is not None else None
        async with admit or contextlib.nullcontext():
            # Built once admitted: a branch adopted while waiting sends committed work.
            request, branch = self._request(messages, stop, kwargs)
            if branch is not None:
                prefix = branch.prefix
                branch.on_cancel(backend, lambda: backend.abort(prefix))
            # Committed requests are the backend's committed load, which every app's
            # speculation on it yields to (a speculative one holds its runner's sequence).
            dispatcher = None if request.speculative else hub_for(backend).dispatcher
            if dispatcher is not None:
                dispatcher.committed_started()
            started = time.perf_counter()
            try:
                yield request
            finally:
                if dispatcher is not None:  # its latency sizes the gain loop's epochs
                    dispatcher.committed_finished(seconds=time.perf_counter() - started)

    def _late(self) -> BackendError:
        return BackendError(self.backend_name, f"no answer within {self.timeout}s")

    async def _complete(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> ChatResult:
        backend = self.generation_backend
        async with self._requesting(backend, messages, stop, kwargs) as request:
            try:
                async with asyncio.timeout(self.timeout):
                    result = await backend.generate(request)
            except TimeoutError as exc:
                raise self._late() from exc
        name = kwargs.get("model", self.model_name)
        return _chat_result(self.backend_name, result, request.sampling.stop, name)

    async def _tokens(
        self,
        backend: GenerationBackend,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
    ) -> AsyncIterator[ChatGenerationChunk]:
        """One sample streamed token by token (``backend.stream``); the last chunk carries
        the usage and the finish reason. ``timeout`` bounds the whole call."""
        async with self._requesting(backend, messages, stop, {**kwargs, "n": 1}) as request:
            words = request.sampling.stop
            now = asyncio.get_running_loop().time()
            deadline = None if self.timeout is None else now + self.timeout
            sent = ""
            stream: Callable[[GenerateRequest], AsyncGenerator[StreamUpdate]]
            stream = backend.stream  # type: ignore[attr-defined]  # checked by streams()
            updates = stream(request)
            async with contextlib.aclosing(updates):  # leaving early aborts the request
                while True:
                    try:
                        async with asyncio.timeout_at(deadline):
                            update = await anext(updates)
                    except StopAsyncIteration:
                        raise BackendError(
                            self.backend_name, f"stream of {request.request_id} ended early"
                        ) from None
                    except TimeoutError as exc:
                        raise self._late() from exc
                    done = update.completion
                    if done is not None and done.finish_reason == FinishReason.ABORT:
                        raise BackendError(
                            self.backend_name, f"request {request.request_id} was aborted"
                        )
                    text = cut_at_stop(done.text if done else update.text, words)
                    if not text.startswith(sent):
                        raise BackendError(
                            self.backend_name, f"stream of {request.request_id} rewrote its text"
                        )
                    delta, sent = text[len(sent) :], text
                    if done is None:
                        if delta:
                            yield ChatGenerationChunk(message=AIMessageChunk(content=delta))
                        continue
                    name = kwargs.get("model", self.model_name)
                    prompt_tokens = backend.count_tokens(request.prompt or "")
                    message = AIMessageChunk(
                        content=delta,
                        usage_metadata=usage(prompt_tokens, done.num_tokens),
                        response_metadata=_metadata(name, request.request_id, done),
                        chunk_position="last",
                    )
                    yield ChatGenerationChunk(message=message)
                    return

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await self._complete(messages, stop, kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        coro = self._complete(messages, stop, kwargs)
        loop = _branch_loop()
        if loop is not None:
            return asyncio.run_coroutine_threadsafe(coro, loop).result()
        return run_sync(coro)

    def streams(self) -> bool:
        """Whether calls stream token by token: the backend streams
        (``capabilities.streaming``) and offers ``stream(request)``, as the embedded engine
        does. Other backends (the scripted one; SGLang and OpenAI-compatible servers, whose
        adapters stream internally but expose only ``generate``) answer in one chunk."""
        backend = self.generation_backend
        return backend.capabilities.streaming and callable(getattr(backend, "stream", None))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        await start_backends(self.generation_backend)
        if self.streams():
            async for chunk in self._tokens(self.generation_backend, messages, stop, kwargs):
                yield chunk
            return
        result = await self._complete(messages, stop, {**kwargs, "n": 1})
        yield last_chunk(result.generations[0].message)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        chunks = self._astream(messages, stop, None, **kwargs)
        yield from iterate_in_thread(chunks, _branch_loop())


def _chat_result(
    backend_name: str, result: GenerateResult, stop: Sequence[str], name: str
) -> ChatResult:
    """A finished request as LangChain's result: one generation per sample, stops cut."""
    generations = []
    for i, completion in enumerate(result.completions):
        if completion.finish_reason == FinishReason.ABORT:
            raise BackendError(backend_name, f"request {result.request_id} was aborted")
        text = cut_at_stop(completion.text, stop)
        message = AIMessage(
            content=text,
            usage_metadata=usage(result.prompt_tokens if i == 0 else 0, completion.num_tokens),
            response_metadata=_metadata(name, result.request_id, completion),
        )
        generations.append(ChatGeneration(message=message))
    return ChatResult(generations=generations)


def _metadata(name: str, request_id: str, completion: Completion) -> dict[str, Any]:
    return {
        "model_name": name,
        "request_id": request_id,
        "finish_reason": completion.finish_reason.name.lower(),
    }


def _branch_loop() -> asyncio.AbstractEventLoop | None:
    """The loop a sync call runs its coroutine on: the current branch's run loop when this
    is a sync node on a worker thread of a spec-tot run (the backend lives on that loop, and
    cancelling the branch aborts the request there); otherwise None (a loop of its own)."""
    branch = current_branch.get()
    loop = branch.loop if branch is not None else None
    if loop is not None and loop.is_running() and not _on_loop(loop):
        return loop
    return None


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
