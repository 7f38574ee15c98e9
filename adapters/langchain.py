"""LangChain as spec-tot backends and tools.

- ``LangChainBackend``: any ``BaseChatModel`` or ``BaseLLM`` as a ``GenerationBackend``. A
  request's ``n`` samples are ``n`` model calls, with distinct seeds (``seed`` derived from
  the request's seed and the sample index) where the model takes a ``seed``. Each call is an
  asyncio task: ``abort(prefix)`` cancels the tasks under the prefix (their samples come back
  with ``FinishReason.ABORT``) and cancelling the caller cancels its calls. An optional
  ``InMemoryRateLimiter`` (any ``BaseRateLimiter``) paces calls; ``max_concurrency`` bounds
  calls in flight, committed requests first.
- ``RunnableReward``: any Runnable as a ``RewardBackend`` (one ``abatch`` per batch).
- ``tool_node``/``add_tool``: a LangChain tool (``BaseTool``, ``@tool``) as a tool node. It
  runs only on committed branches unless declared ``pure``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel, BaseLanguageModel, BaseLLM
from langchain_core.messages import BaseMessage
from langchain_core.rate_limiters import BaseRateLimiter
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.tools import BaseTool

from spec_tot.adapters._saturation import LoadProbe
from spec_tot.backends import GenerationBackend, RewardBackend, matches_prefix
from spec_tot.errors import BackendError, ConfigError
from spec_tot.graph import State, ThoughtGraph
from spec_tot.requests import (
    Capabilities,
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RewardItem,
    SamplingParams,
)
from spec_tot.seeds import query_seed

__all__ = ["LangChainBackend", "RunnableReward", "add_tool", "tool_node"]


class _PriorityGate:
    """A semaphore that admits waiting committed calls before speculative ones."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def acquire(self, priority: int) -> None:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._order), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # granted and cancelled at once: pass the slot on
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)
                return
        self.free += 1


def _text(output: Any) -> str:
    if isinstance(output, BaseMessage):
        return output.text
    return str(output)


def _num_tokens(output: Any, text: str) -> int:
    usage = getattr(output, "usage_metadata", None)
    if usage and usage.get("output_tokens"):
        return int(usage["output_tokens"])
    return max(1, len(text) // 4)


class LangChainBackend(GenerationBackend):
    """A LangChain chat model or LLM as a thought generator.

    ``seed``: pass a per-sample ``seed`` to the model (None: when the model declares a
    ``seed`` field). ``sampling_kwargs``: also pass temperature/top_p/max_tokens per call
    (only for models that take them as call arguments). ``to_input`` turns the prompt text
    into the model's input (default: the text; chat models read it as one human message).

    ``saturation``: the concurrency past which the provider slows down (the speculation
    budget's capacity). None: measured from the backend's own traffic (``LoadProbe``: call
    latency against calls in flight), bounded by ``max_concurrency``; ``measure_saturation``
    measures it up front with probe calls.
    """

    def __init__(
        self,
        model: BaseLanguageModel[Any],
        *,
        rate_limiter: BaseRateLimiter | None = None,
        max_concurrency: int | None = None,
        seed: bool | None = None,
        sampling_kwargs: bool = False,
        to_input: Callable[[str], Any] | None = None,
        name: str | None = None,
        saturation: int | None = None,
    ) -> None:
        if not isinstance(model, BaseChatModel | BaseLLM):
            raise ConfigError("model", f"expected a BaseChatModel or BaseLLM, got {model!r}")
        if max_concurrency is not None and max_concurrency < 1:
            raise ConfigError("max_concurrency", f"must be >= 1, got {max_concurrency}")
        if saturation is not None and saturation < 1:
            raise ConfigError("saturation", f"must be >= 1, got {saturation}")
        self.saturation = saturation
        self.probe = LoadProbe(initial=min(4, max_concurrency or 4))
        self._running = 0
        self.model = model
        self.rate_limiter = rate_limiter
        self.max_concurrency = max_concurrency
        fields = getattr(type(model), "model_fields", {})
        self.seed = ("seed" in fields) if seed is None else seed
        self.sampling_kwargs = sampling_kwargs
        self.to_input = to_input or (lambda text: text)
        self.name = name or f"langchain:{type(model).__name__}"
        self.num_calls = 0
        self.num_aborted = 0
        self._tasks: dict[str, set[asyncio.Task[Any]]] = {}
        self._gates: dict[int, _PriorityGate] = {}  # one per event loop

    @property
    def capabilities(self) -> Capabilities:
        saturation = self.saturation or self.probe.estimate()
        if self.max_concurrency is not None:
            saturation = min(saturation, self.max_concurrency)
        return Capabilities(
            name=self.name,
            saturation_batch=saturation,
            max_running_requests=self.max_concurrency or 1024,
        )

    async def measure_saturation(
        self, prompt: str = "Hello", levels: Sequence[int] = (1, 2, 4, 8, 16, 32)
    ) -> int:
        """Send ``level`` concurrent probe calls for each level (``sum(levels)`` model calls
        in all) and return the saturation the probe then estimates."""
        for level in levels:
            requests = [
                GenerateRequest(f"saturation-probe-{level}-{i}", SamplingParams(), prompt=prompt)
                for i in range(level)
            ]
            await asyncio.gather(*(self.generate(r) for r in requests))
        return self.capabilities.saturation_batch

    @property
    def num_inflight(self) -> int:
        return len(self._tasks)

    def inflight_ids(self) -> list[str]:
        return sorted(self._tasks)

    def _gate(self) -> _PriorityGate | None:
        if self.max_concurrency is None:
            return None
        key = id(asyncio.get_running_loop())
        if key not in self._gates:
            self._gates = {key: _PriorityGate(self.max_concurrency)}
        return self._gates[key]

    def _call_kwargs(self, request: GenerateRequest, index: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if request.sampling.stop:
            kwargs["stop"] = list(request.sampling.stop)
        if self.seed:
            base = request.sampling.seed if request.sampling.seed is not None else 0
            kwargs["seed"] = query_seed(base, f"{request.request_id}#{index}")
        if self.sampling_kwargs:
            kwargs["temperature"] = request.sampling.temperature
            kwargs["top_p"] = request.sampling.top_p
            kwargs["max_tokens"] = request.sampling.max_tokens
        return kwargs

    async def _one(self, request: GenerateRequest, index: int) -> Completion:
        gate = self._gate()
        if gate is not None:
            await gate.acquire(int(request.priority))
        try:
            if self.rate_limiter is not None:
                await self.rate_limiter.aacquire(blocking=True)
            self.num_calls += 1
            self._running += 1
            inflight, started = self._running, time.perf_counter()
            try:
                output = await self.model.ainvoke(
                    self.to_input(request.prompt or ""), **self._call_kwargs(request, index)
                )
            finally:
                self._running -= 1
        finally:
            if gate is not None:
                gate.release()
        text = _text(output)
        tokens = _num_tokens(output, text)
        self.probe.record(inflight, time.perf_counter() - started, tokens)
        return Completion(text=text, num_tokens=tokens)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.prompt is None:
            raise BackendError(self.name, "LangChain models take text prompts, not token ids")
        rid = request.request_id
        if rid in self._tasks:
            raise BackendError(self.name, f"duplicate request id {rid!r}")
        tasks = [asyncio.ensure_future(self._one(request, i)) for i in range(request.n)]
        self._tasks[rid] = set(tasks)
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:  # the caller was cancelled: leave nothing in flight
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            self._tasks.pop(rid, None)
        completions = []
        for task in tasks:
            if task.cancelled():
                completions.append(Completion(text="", finish_reason=FinishReason.ABORT))
                continue
            error = task.exception()
            if error is not None:
                raise BackendError(self.name, f"{type(error).__name__}: {error}") from error
            completions.append(task.result())
        return GenerateResult(rid, tuple(completions), prompt_tokens=len(request.prompt) // 4)

    async def abort(self, prefix: str) -> int:
        hits = [rid for rid in self._tasks if matches_prefix(rid, prefix)]
        for rid in hits:
            for task in self._tasks[rid]:
                task.cancel()
        self.num_aborted += len(hits)
        return len(hits)


class RunnableReward(RewardBackend):
    """Any Runnable as a reward: its input per item is ``to_input(item)`` (default: a dict
    with ``question``, ``steps`` and ``text``); its output is one score (repeated per step)
    or one score per step."""

    def __init__(
        self,
        runnable: Runnable[Any, Any],
        *,
        to_input: Callable[[RewardItem], Any] | None = None,
        max_concurrency: int | None = None,
    ) -> None:
        self.runnable = runnable
        self.to_input = to_input or (
            lambda item: {"question": item.question, "steps": list(item.steps), "text": item.text}
        )
        self.max_concurrency = max_concurrency
        self.num_batches = 0

    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        self.num_batches += 1
        config = RunnableConfig(max_concurrency=self.max_concurrency)
        outputs = await self.runnable.abatch([self.to_input(i) for i in items], config)
        out: list[tuple[float, ...]] = []
        for item, value in zip(items, outputs, strict=True):
            steps = max(1, len(item.steps))
            if isinstance(value, int | float):
                out.append((float(value),) * steps)
            elif isinstance(value, Sequence) and len(value) == steps:
                out.append(tuple(float(v) for v in value))
            else:
                raise BackendError("runnable-reward", f"bad score {value!r} for {item.request_id}")
        return out


def tool_node(
    tool: BaseTool,
    *,
    args: Callable[[State], Any],
    result_key: str | None = None,
) -> Callable[[State], Any]:
    """A tool-node function: ``args(state)`` gives the tool input (a dict or a string); the
    output goes to ``state[result_key]`` (default: the tool's name)."""
    if not isinstance(tool, BaseTool):
        raise ConfigError("tool", f"expected a LangChain BaseTool, got {tool!r}")
    key = result_key or tool.name

    async def call(state: State) -> Mapping[str, Any]:
        return {key: await tool.ainvoke(args(state))}

    return call


def add_tool(
    graph: ThoughtGraph,
    name: str,
    tool: BaseTool,
    *,
    args: Callable[[State], Any],
    result_key: str | None = None,
    pure: bool = False,
) -> ThoughtGraph:
    """Add ``tool`` as the tool node ``name``: non-speculable unless ``pure`` (then it may
    also run on speculative branches)."""
    fn = tool_node(tool, args=args, result_key=result_key)
    return graph.add_tool(name, fn, speculable=pure, pure=pure)
