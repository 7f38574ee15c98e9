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


# -- saturation: from config, or measured -------------------------------------------------
class Queueing(FakeListChatModel):
    """A provider that serves ``capacity`` calls at once at full speed and slows down
    beyond it (latency grows with the queue)."""

    capacity: int = 4
    base_s: float = 0.02
    running: int = 0

    async def _agenerate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> Any:
        self.running += 1
        try:
            await asyncio.sleep(self.base_s * max(1.0, self.running / self.capacity))
        finally:
            self.running -= 1
        return await super()._agenerate(messages, stop, run_manager, **kwargs)


async def test_saturation_comes_from_config_or_a_measurement() -> None:
    assert (
        LangChainBackend(Queueing(responses=["x"]), saturation=12).capabilities.saturation_batch
        == 12
    )
    bounded = LangChainBackend(Queueing(responses=["x"]), saturation=12, max_concurrency=6)
    assert bounded.capabilities.saturation_batch == 6
    backend = LangChainBackend(Queueing(responses=["x"]))
    assert backend.capabilities.saturation_batch == 4  # nothing measured yet
    measured = await backend.measure_saturation(levels=(1, 1, 1, 2, 2, 4, 8, 16, 16))
    assert 4 <= measured <= 8, measured  # the provider's knee, from latencies alone
    with pytest.raises(ConfigError, match="saturation"):
        LangChainBackend(Queueing(responses=["x"]), saturation=0)


def test_the_probe_learns_from_traffic() -> None:
    from spec_tot.adapters._saturation import LoadProbe

    probe = LoadProbe()
    for inflight in (1, 2, 4, 8, 16, 32):
        for _ in range(4):
            probe.record(inflight, 0.01 * max(1, inflight / 16), tokens=10)
    assert probe.estimate() == 16
    flat = LoadProbe(ceiling=100)
    for inflight in (1, 2, 4):
        for _ in range(4):
            flat.record(inflight, 0.01, tokens=1)
    assert flat.estimate() == 8  # still flat at 4 in flight: may probe up to 8


# -- a LangChain model as backend, registries ----------------------------------------------
def test_compile_wraps_a_chat_model_and_refuses_other_objects() -> None:
    app = compile_toy(
        backend=FakeListChatModel(responses=["answer: 24"]),
        backend_options={"max_concurrency": 2},
        reward=RunnableReward(RunnableLambda(lambda x: 0.5)),
        search="beam",
        search_params={"n": 2, "width": 2, "max_depth": 2},
    )
    assert isinstance(app.backend, LangChainBackend) and app.backend.max_concurrency == 2
    assert app.invoke("toy puzzle 0").answer == "24"
    scorer = RunnableReward(RunnableLambda(lambda x: 0.5))
    with pytest.raises(ConfigError, match="backend: expected a GenerationBackend"):
        compile_toy(backend=object(), reward=scorer, search="beam")
    from spec_tot.errors import UnknownNameError

    with pytest.raises(UnknownNameError, match="nope"):
        compile_toy(backend="nope", reward=scorer, search="beam")


PLUGIN = """
from spec_tot.adapters.scripted import ScriptedBackend
from spec_tot.policies.beam import BeamSearch


def make_backend(**options):
    backend = ScriptedBackend()
    backend.plugin_options = options
    return backend


class WideBeam(BeamSearch):
    def __init__(self, width: int = 3, **params):
        super().__init__(width=width, **params)
"""


@pytest.fixture
def plugin(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed distribution declaring a backend and a policy as entry points."""
    (tmp_path / "my_plugin.py").write_text(PLUGIN)
    info = tmp_path / "my_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[spec_tot.backends]\nmine = my_plugin:make_backend\nlocal = my_plugin:make_backend\n\n"
        "[spec_tot.policies]\nwide_beam = my_plugin:WideBeam\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.usefixtures("plugin")
def test_plugins_are_seen_by_compile_and_the_cli() -> None:
    from spec_tot import default_registry, policy_names
    from spec_tot.cli._checks import backend_registry, policy_schema

    with pytest.warns(UserWarning, match="may not replace the built-in 'local'"):
        names = default_registry().names()
    assert "mine" in names and "mine" in backend_registry().names()
    assert "wide_beam" in policy_names()
    assert policy_schema("wide_beam")  # the CLI reads the plug-in policy's parameters
    app = compile_toy(backend="mine", backend_options={"flavour": 1}, search="wide_beam")
    assert app.backend.plugin_options == {"flavour": 1}  # type: ignore[attr-defined]
    assert app.invoke("toy puzzle 1").status == "ok"
