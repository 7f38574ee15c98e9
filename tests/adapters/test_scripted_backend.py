"""ScriptedBackend: deterministic samples and scores, prefix abort, hang, failures, config."""

from __future__ import annotations

import asyncio

import pytest

from spec_tot.adapters.scripted import (
    ANSWER_PREFIX,
    ScriptedBackend,
    ScriptedConfig,
    create_scripted,
)
from spec_tot.backends import GenerationBackend, RewardBackend, default_registry
from spec_tot.errors import BackendError, ConfigError
from spec_tot.requests import FinishReason, GenerateRequest, RewardItem, SamplingParams


def req(rid: str, prompt: str = "question", *, n: int = 1, seed: int | None = 1, **s: object):
    return GenerateRequest(
        request_id=rid, prompt=prompt, n=n, sampling=SamplingParams(seed=seed, **s)
    )


async def _wait_inflight(backend: ScriptedBackend, count: int) -> None:
    for _ in range(200):
        if backend.num_inflight >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"only {backend.inflight_ids()} in flight")


def test_is_both_backend_kinds() -> None:
    backend = ScriptedBackend()
    assert isinstance(backend, GenerationBackend)
    assert isinstance(backend, RewardBackend)
    assert backend.capabilities.name == "scripted"
    assert backend.num_inflight == 0


async def test_same_request_same_samples() -> None:
    a, b = ScriptedBackend(), ScriptedBackend()
    first = await a.generate(req("q0/0", n=4))
    again = await a.generate(req("q0/0", n=4))  # same id is fine once the first finished
    other = await b.generate(req("zzz", n=4))  # the id is not part of the sample
    texts = [c.text for c in first.completions]
    assert texts == [c.text for c in again.completions] == [c.text for c in other.completions]
    assert [c.num_tokens for c in first.completions] == [c.num_tokens for c in other.completions]
    assert len(first.completions) == 4
    assert len(set(texts)) > 1  # the n samples are independent draws
    assert all(c.finish_reason is FinishReason.STOP for c in first.completions)
    assert first.request_id == "q0/0"
    assert first.prompt_tokens == len("question")


async def test_samples_depend_on_seed_prompt_and_backend_seed() -> None:
    backend = ScriptedBackend()
    base = [(await backend.generate(req("a", seed=s, n=3))).completions for s in range(6)]
    texts = {tuple(c.text for c in comps) for comps in base}
    assert len(texts) > 1  # the sampling seed matters
    p1 = await backend.generate(req("a", "question one", n=3))
    p2 = await backend.generate(req("a", "question two", n=3))
    assert [c.text for c in p1.completions] != [c.text for c in p2.completions]
    other = ScriptedBackend(ScriptedConfig(seed=99))
    q1 = await other.generate(req("a", "question one", n=3))
    assert [c.text for c in p1.completions] != [c.text for c in q1.completions]


def test_sample_is_pure_and_respects_depth_and_max_tokens() -> None:
    backend = ScriptedBackend(ScriptedConfig(depth=3, mean_tokens=50))
    shallow = req("x", "question\nstep 1")  # depth 1: 1 + 1 < 3 -> a step
    deep = req("x", "question\nstep 1\nstep 2")  # depth 2: an answer
    assert backend.sample(shallow, 0) == backend.sample(shallow, 0)
    for i in range(20):
        assert backend.sample(shallow, i)[0].startswith("step ")
        assert backend.sample(deep, i)[0].startswith(ANSWER_PREFIX)
    capped = req("x", "question", max_tokens=3)
    assert all(1 <= backend.sample(capped, i)[1] <= 3 for i in range(20))


def test_p_correct_extremes() -> None:
    always = ScriptedBackend(ScriptedConfig(depth=1, p_correct=1.0))
    never = ScriptedBackend(ScriptedConfig(depth=1, p_correct=0.0))
    request = req("x", "question")
    assert {always.sample(request, i)[0] for i in range(30)} == {ANSWER_PREFIX + "24"}
    wrong = {never.sample(request, i)[0] for i in range(60)}
    assert ANSWER_PREFIX + "24" not in wrong
    assert wrong <= {ANSWER_PREFIX + c for c in ("23", "25", "12")}


async def test_abort_prefix_semantics() -> None:
    backend = ScriptedBackend(ScriptedConfig(hang_prefixes=("q1", "q10")))
    tasks = {
        rid: asyncio.create_task(backend.generate(req(rid)))
        for rid in ("q1", "q1/0/2", "q10/0", "q10")
    }
    await _wait_inflight(backend, 4)
    assert backend.inflight_ids() == ["q1", "q1/0/2", "q10", "q10/0"]
    assert await backend.abort("q1") == 2
    assert backend.num_aborted == 2
    for rid in ("q1", "q1/0/2"):
        result = await asyncio.wait_for(tasks[rid], 2)
        assert all(c.finish_reason is FinishReason.ABORT for c in result.completions)
    assert backend.inflight_ids() == ["q10", "q10/0"]  # "q1" is not a prefix of "q10"
    assert not tasks["q10/0"].done()
    assert await backend.abort("q10/0") == 1  # exact id
    assert (await asyncio.wait_for(tasks["q10/0"], 2)).completions[0].finish_reason is (
        FinishReason.ABORT
    )
    assert backend.inflight_ids() == ["q10"]
    assert await backend.abort("q1") == 0  # nothing left under q1
    assert await backend.abort("q") == 0  # a bare string prefix is not a path prefix
    assert await backend.abort("q10") == 1
    await asyncio.wait_for(tasks["q10"], 2)
    assert backend.num_inflight == 0
    assert backend.num_aborted == 4


async def test_hang_until_abort() -> None:
    backend = ScriptedBackend(ScriptedConfig(hang_prefixes=("q1",)))
    task = asyncio.create_task(backend.generate(req("q1/0", n=2)))
    await _wait_inflight(backend, 1)
    await asyncio.sleep(0.02)
    assert not task.done()
    assert await backend.abort("q1") == 1
    result = await asyncio.wait_for(task, 2)
    assert [c.finish_reason for c in result.completions] == [FinishReason.ABORT] * 2
    assert backend.num_inflight == 0


async def test_cancelling_the_caller_leaves_nothing_in_flight() -> None:
    backend = ScriptedBackend(ScriptedConfig(hang_prefixes=("q1",)))
    task = asyncio.create_task(backend.generate(req("q1/0")))
    await _wait_inflight(backend, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.num_inflight == 0


async def test_slow_request_can_be_aborted_early() -> None:
    backend = ScriptedBackend(ScriptedConfig(token_latency_s=1.0, mean_tokens=20))
    task = asyncio.create_task(backend.generate(req("q2/0")))
    await _wait_inflight(backend, 1)
    assert await backend.abort("q2") == 1
    result = await asyncio.wait_for(task, 1.0)  # well before its ~20 s of latency
    assert result.completions[0].finish_reason is FinishReason.ABORT


async def test_token_latency_delays_the_result() -> None:
    backend = ScriptedBackend(ScriptedConfig(token_latency_s=0.004, mean_tokens=10))
    request = req("q0/0", max_tokens=10)
    tokens = backend.sample(request, 0)[1]
    loop = asyncio.get_running_loop()
    start = loop.time()
    await backend.generate(request)
    assert loop.time() - start >= tokens * 0.004 * 0.9


async def test_duplicate_inflight_id_rejected() -> None:
    backend = ScriptedBackend(ScriptedConfig(hang_prefixes=("q1",)))
    task = asyncio.create_task(backend.generate(req("q1/0")))
    await _wait_inflight(backend, 1)
    with pytest.raises(BackendError, match="duplicate") as info:
        await backend.generate(req("q1/0"))
    assert info.value.endpoint == "scripted"
    assert backend.inflight_ids() == ["q1/0"]  # the first one is untouched
    await backend.abort("q1/0")
    await asyncio.wait_for(task, 2)


async def test_fail_prefixes() -> None:
    backend = ScriptedBackend(ScriptedConfig(fail_prefixes=("q1",)))
    with pytest.raises(BackendError, match="q1/0/3"):
        await backend.generate(req("q1/0/3"))
    with pytest.raises(BackendError):
        await backend.generate(req("q1"))
    ok = await backend.generate(req("q10/0"))
    assert ok.completions[0].finish_reason is FinishReason.STOP
    assert backend.num_inflight == 0


async def test_counters() -> None:
    backend = ScriptedBackend()
    result = await backend.generate(req("q0/0", n=3))
    stats = backend.stats()
    assert stats["generate_calls"] == 1
    assert stats["generated_tokens"] == sum(c.num_tokens for c in result.completions) > 0
    assert stats["peak_inflight"] == 1
    await backend.score([RewardItem("q0/0", "q", ("a",))])
    assert backend.stats()["score_calls"] == 1


async def test_scores_are_deterministic_per_step() -> None:
    backend = ScriptedBackend()
    items = [
        RewardItem("a", "q", ("step 1", "step 2", ANSWER_PREFIX + "24")),
        RewardItem("b", "q", ("step 1", ANSWER_PREFIX + "23")),
        RewardItem("c", "q", ()),
    ]
    scores = await backend.score(items)
    assert [len(s) for s in scores] == [3, 2, 0]
    assert scores == await ScriptedBackend().score(items)
    assert scores[0][-1] >= 0.6  # a correct answer
    assert scores[1][-1] < 0.4  # a wrong one
    assert 0.2 <= scores[0][0] <= 0.8  # an intermediate step
    # A prefix scores the same whatever follows it (a step's score depends on its path only).
    assert scores[0][0] == scores[1][0]
    assert scores[0][0] == backend.step_score("q", ["step 1"])


async def test_fail_reward_questions() -> None:
    backend = ScriptedBackend(ScriptedConfig(fail_reward_questions=("bad",)))
    with pytest.raises(BackendError, match="bad"):
        await backend.score([RewardItem("a", "good", ("x",)), RewardItem("b", "bad", ("x",))])
    assert len(await backend.score([RewardItem("a", "good", ("x",))])) == 1


async def test_reward_latency() -> None:
    backend = ScriptedBackend(ScriptedConfig(reward_latency_s=0.02))
    loop = asyncio.get_running_loop()
    start = loop.time()
    await backend.score([RewardItem("a", "q", ("x",))])
    assert loop.time() - start >= 0.018


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"depth": 0}, "depth"),
        ({"p_correct": -0.1}, "p_correct"),
        ({"p_correct": 1.5}, "p_correct"),
        ({"mean_tokens": 0}, "mean_tokens"),
        ({"straggler_rate": 2.0}, "straggler_rate"),
        ({"straggler_rate": -0.5}, "straggler_rate"),
        ({"token_latency_s": -1.0}, "token_latency_s"),
        pytest.param(
            {"reward_latency_s": -1.0},
            "reward_latency_s",
        ),
        ({"correct": "7"}, "correct"),
    ],
)
def test_config_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        ScriptedConfig(**kwargs)
    assert info.value.field == field


def test_create_scripted_and_registry() -> None:
    backend = create_scripted(depth=2, seed=5)
    assert isinstance(backend, ScriptedBackend)
    assert backend.config.depth == 2 and backend.config.seed == 5
    via_registry = default_registry().create("scripted", depth=4)
    assert isinstance(via_registry, ScriptedBackend)
    assert via_registry.config.depth == 4
    with pytest.raises(ConfigError):
        create_scripted(depth=0)
