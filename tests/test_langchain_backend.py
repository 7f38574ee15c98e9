"""LangChain models as spec-tot backends: samples and seeds, rate limits, concurrency,
cancellation (nothing left in flight), Runnables as rewards."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from langchain_core.language_models.fake import FakeListLLM
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import BaseMessage
from langchain_core.rate_limiters import InMemoryRateLimiter
from langchain_core.runnables import RunnableLambda
from pydantic import Field

from spec_tot.adapters.langchain import LangChainBackend, RunnableReward
from spec_tot.config import ExecutorConfig
from spec_tot.errors import BackendError, ConfigError
from spec_tot.graphs.toy import compile_toy
from spec_tot.requests import FinishReason, GenerateRequest, Priority, RewardItem, SamplingParams


class SlowChat(FakeListChatModel):
    """A fake chat model that records call kwargs, concurrency and cancellations."""

    delay: float = 0.0
    calls: list[dict[str, Any]] = Field(default_factory=list)
    running: int = 0
    peak: int = 0
    cancelled: int = 0
    order: list[str] = Field(default_factory=list)

    async def _agenerate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> Any:
        self.calls.append({"stop": stop, **kwargs})
        self.order.append(str(messages[-1].content))
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        return await super()._agenerate(messages, stop, run_manager, **kwargs)


def _request(rid: str, n: int = 1, *, prompt: str = "q", spec: bool = False) -> GenerateRequest:
    return GenerateRequest(
        rid,
        SamplingParams(stop=("\n",), seed=5),
        prompt=prompt,
        n=n,
        priority=Priority.SPECULATIVE if spec else Priority.COMMITTED,
        speculative=spec,
    )


async def test_n_samples_are_n_calls_with_distinct_seeds() -> None:
    model = SlowChat(responses=["a", "b", "c"])
    backend = LangChainBackend(model, seed=True)
    result = await backend.generate(_request("q0/1", n=3))
    assert sorted(c.text for c in result.completions) == ["a", "b", "c"]
    seeds = [c["seed"] for c in model.calls]
    assert len(set(seeds)) == 3 and all(c["stop"] == ["\n"] for c in model.calls)
    again = SlowChat(responses=["a"])
    await LangChainBackend(again, seed=True).generate(_request("q0/1", n=3))
    assert [c["seed"] for c in again.calls] == seeds  # seeds depend on the request only
    plain = SlowChat(responses=["a"])
    await LangChainBackend(plain).generate(_request("x"))
    assert "seed" not in plain.calls[0]  # FakeListChatModel has no seed field


@pytest.mark.parametrize("kind", ["chat", "llm"])
def test_a_tot_app_runs_on_a_langchain_model(kind: str) -> None:
    answers = ["step 1", "answer: 24", "answer: 23"]
    model = (
        FakeListChatModel(responses=answers) if kind == "chat" else FakeListLLM(responses=answers)
    )
    backend = LangChainBackend(model, max_concurrency=3)
    scorer = RunnableReward(RunnableLambda(lambda x: 0.9 if x["steps"][-1].endswith("24") else 0.3))
    app = compile_toy(
        backend=backend,
        reward=scorer,
        search="beam",
        search_params={"n": 4, "width": 2, "max_depth": 3},
        config=ExecutorConfig(mode="full"),
    )
    result = app.invoke("toy puzzle 0")
    assert result.status == "ok" and result.answer == "24"
    assert backend.num_inflight == 0 and scorer.num_batches >= 1


async def test_rate_limiter_paces_calls() -> None:
    limiter = InMemoryRateLimiter(
        requests_per_second=40, check_every_n_seconds=0.002, max_bucket_size=1
    )
    backend = LangChainBackend(FakeListChatModel(responses=["x"]), rate_limiter=limiter)
    started = time.perf_counter()
    await asyncio.gather(*(backend.generate(_request(f"r{i}")) for i in range(5)))
    assert time.perf_counter() - started >= 4 / 40 * 0.8


async def test_concurrency_limit_serves_committed_first() -> None:
    model = SlowChat(responses=["x"], delay=0.02)
    backend = LangChainBackend(model, max_concurrency=1)
    first = asyncio.ensure_future(backend.generate(_request("a", prompt="first")))
    await asyncio.sleep(0.005)
    spec = asyncio.ensure_future(backend.generate(_request("b", prompt="spec", spec=True)))
    await asyncio.sleep(0)
    committed = asyncio.ensure_future(backend.generate(_request("c", prompt="committed")))
    await asyncio.gather(first, spec, committed)
    assert model.peak == 1 and model.order == ["first", "committed", "spec"]


async def test_abort_and_caller_cancellation_leave_nothing_in_flight() -> None:
    model = SlowChat(responses=["x"], delay=5.0)
    backend = LangChainBackend(model)
    running = asyncio.ensure_future(backend.generate(_request("q1/0", n=2)))
    other = asyncio.ensure_future(backend.generate(_request("q2/0")))
    await asyncio.sleep(0.01)
    assert backend.inflight_ids() == ["q1/0", "q2/0"]
    assert await backend.abort("q1") == 1
    result = await running
    assert [c.finish_reason for c in result.completions] == [FinishReason.ABORT] * 2
    other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other
    assert backend.num_inflight == 0 and model.running == 0 and model.cancelled == 3


async def test_errors_are_backend_errors() -> None:
    with pytest.raises(ConfigError):
        LangChainBackend(RunnableLambda(lambda x: x))  # type: ignore[arg-type]
    backend = LangChainBackend(FakeListChatModel(responses=["x"]))
    with pytest.raises(BackendError, match="token ids"):
        await backend.generate(GenerateRequest("t", SamplingParams(), prompt_ids=(1, 2)))
    bad = RunnableReward(RunnableLambda(lambda x: "high"))
    with pytest.raises(BackendError, match="bad score"):
        await bad.score([RewardItem("r", "q", ("a",))])
    steps = RunnableReward(RunnableLambda(lambda x: [0.1] * len(x["steps"])))
    assert await steps.score([RewardItem("r", "q", ("a", "b"))]) == [(0.1, 0.1)]
