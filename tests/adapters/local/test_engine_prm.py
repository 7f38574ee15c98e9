"""PRM scoring with prefix reuse (same scores, only new tokens computed), classify of raw
text with length checks, and start-up calibration cached per model and machine."""

from __future__ import annotations

import json
import time as time_module
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_fixtures import make_backend, make_engine, tiny_llama, tiny_prm

from spec_tot.adapters.local.engine.calibrate import (
    CalibrationCache,
    disturbed,
    fit_line,
    saturation_from_curve,
    step_cost_curve,
)
from spec_tot.adapters.local.engine.prm import PrmScorer
from spec_tot.errors import ConfigError
from spec_tot.requests import RewardItem

__all__ = ["make_backend", "make_engine", "tiny_llama", "tiny_prm"]

torch.set_num_threads(1)

TRACES = [
    RewardItem("a", "4 4 6 8", ("4+4=8 (left: 6 8 8)", "8/8=1 (left: 1 6)", "6-1=5 (left: 5)")),
    RewardItem("b", "1 2 3 4", ("1*2=2 (left: 2 3 4)", "2*3=6 (left: 4 6)")),
    RewardItem("c", "1 2 3 4", ("1*2=2 (left: 2 3 4)", "3+4=7 (left: 2 7)")),
]


def _prefixes(item: RewardItem) -> list[RewardItem]:
    return [
        RewardItem(item.request_id, item.question, item.steps[:k])
        for k in range(1, len(item.steps) + 1)
    ]


def test_prefix_reuse_gives_the_same_scores(tiny_prm: Path) -> None:
    fresh = PrmScorer(tiny_prm, "cpu", torch.float32)
    whole = fresh.score(TRACES)
    cost_whole = fresh.num_computed_tokens
    stepwise = PrmScorer(tiny_prm, "cpu", torch.float32, block_size=4)
    for k in range(1, 4):  # as a search scores them: step by step
        batch = [p for t in TRACES for p in _prefixes(t)[k - 1 : k]]
        got = stepwise.score(batch)
        for item, scores in zip(batch, got, strict=True):
            want = next(
                w for t, w in zip(TRACES, whole, strict=True) if t.request_id == item.request_id
            )
            assert scores == pytest.approx(want[: len(item.steps)], abs=1e-5)
    # every token computed once, but for a partial block per item and step
    slack = 3 * len(TRACES) * stepwise.block_manager.block_size
    assert stepwise.num_computed_tokens <= cost_whole + slack
    before = stepwise.num_computed_tokens
    again = stepwise.score(TRACES)
    assert [x for s in again for x in s] == pytest.approx([x for s in whole for x in s], abs=1e-5)
    assert stepwise.num_computed_tokens == before  # all from the score cache


def test_next_step_costs_only_its_tokens(tiny_prm: Path) -> None:
    prm = PrmScorer(tiny_prm, "cpu", torch.float32, block_size=4)
    item = TRACES[0]
    prm.score([RewardItem("p", item.question, item.steps[:2])])
    before = prm.num_computed_tokens
    prm.score([item])
    new_tokens = prm.num_computed_tokens - before
    step = len(item.steps[2]) + len(prm.step_tag)  # char tokenizer: a token a character
    assert new_tokens <= step + prm.block_manager.block_size  # its step (and a partial block)


def test_flush_forgets_scores_and_prefixes(tiny_prm: Path) -> None:
    """A flushed PRM computes a trace again as a cold one would (a benchmark's fresh run)."""
    prm = PrmScorer(tiny_prm, "cpu", torch.float32, block_size=4)
    cold = prm.score(TRACES)
    computed = prm.num_computed_tokens
    prm.score(TRACES)
    assert prm.num_computed_tokens == computed  # warm: every score from the cache
    assert prm.flush()
    again = prm.score(TRACES)
    assert prm.num_computed_tokens == 2 * computed  # cold again: every token computed
    assert [x for s in again for x in s] == pytest.approx([x for s in cold for x in s], abs=1e-5)


async def test_backend_flush_reaches_the_prm_core(make_backend: Any, tiny_prm: Path) -> None:
    backend = make_backend(policy_path=None, prm_path=str(tiny_prm))
    item = TRACES[0]
    first = await backend.score([item])
    assert await backend.flush_prefix_cache()  # a PRM-only backend has caches too
    (again,) = await backend.score([item])
    assert again == pytest.approx(first[0], abs=1e-5)


def test_classify_raw_text_and_limits(tiny_prm: Path) -> None:
    prm = PrmScorer(tiny_prm, "cpu", torch.float32)
    item = TRACES[1]
    text = item.question + "\n" + "".join(s + "#\n" for s in item.steps).rstrip("\n")
    (reward,) = prm.classify([text])
    scores = prm.score([item])[0]
    assert 1.0 / (1.0 + torch.exp(torch.tensor(-reward)).item()) == pytest.approx(
        scores[-1], abs=1e-5
    )
    assert prm.classify([text[:-1]]) == pytest.approx([reward], abs=1e-5)  # tag appended
    with pytest.raises(ConfigError) as info:
        prm.classify(["ok", "x" * 2**20])
    assert info.value.field == "text[1]"
    with pytest.raises(ConfigError) as info:
        prm.classify(["y" * (prm.max_len + 5)])  # fits the character cap, not the model
    assert info.value.field == "text[0]"
    with pytest.raises(ConfigError):
        prm.classify([7])  # type: ignore[list-item]


async def test_backend_classify_and_reward_calibration(
    make_backend: Any, tiny_prm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPEC_TOT_CACHE_DIR", str(tmp_path))
    backend = make_backend(policy_path=None, prm_path=str(tiny_prm))
    caps = backend.capabilities
    assert caps.reward_batch_tokens is not None and caps.reward_batch_tokens >= 1
    assert caps.reward_batch_s is not None and caps.reward_batch_s > 0
    files = list((tmp_path / "calibration").glob("reward-*.json"))
    assert len(files) == 1
    # a second start reads the cache: the same figures, no measurement
    again = make_backend(policy_path=None, prm_path=str(tiny_prm))
    assert (again.capabilities.reward_batch_tokens, again.capabilities.reward_batch_s) == (
        caps.reward_batch_tokens,
        caps.reward_batch_s,
    )
    assert len(await backend.classify(["1 2 3 4\n1+2=3"])) == 1


async def test_step_cost_calibration_is_cached(
    make_backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPEC_TOT_CACHE_DIR", str(tmp_path))
    backend = make_backend(saturation_batch=None, max_num_seqs=8)
    caps = backend.capabilities
    assert 1 <= caps.saturation_batch <= 8
    assert {"step_s_b1", "step_s_b8"} <= caps.extra.keys()
    assert backend.stats()["num_steps"] == 0  # calibration steps are not the caller's
    (file,) = (tmp_path / "calibration").glob("steps-*.json")
    curve = json.loads(file.read_text())["curve"]
    assert sorted(int(b) for b in curve) == [1, 2, 4, 8]
    # a changed curve in the cache is what the next start reports
    file.write_text(json.dumps({"curve": {"1": 1.0, "2": 1.0, "4": 1.0, "8": 9.0}}))
    assert make_backend(saturation_batch=None, max_num_seqs=8).capabilities.saturation_batch == 5
    # a curve measured on a busy machine (batch 2 cheaper than batch 1) is measured again
    file.write_text(json.dumps({"curve": {"1": 9.0, "2": 4.5, "4": 9.0, "8": 9.5}}))
    extra = make_backend(saturation_batch=None, max_num_seqs=8).capabilities.extra
    assert extra["step_s_b1"] < 1.0 and extra["step_s_b2"] != 4.5


def test_step_cost_curve_times_only_decode_steps_of_the_whole_batch(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 rows x 64 prompt tokens = 512 tokens against a 128-token step budget: four prompt
    # steps per batch. A timed step that still prefilled once made a 256-row step of the
    # shipped policy cost 6x a 128-row one (its median mixed prompt steps in).
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=512)
    timed: list[tuple[int, bool]] = []  # (rows, decode-only) of each timed step
    clock_last = {"value": False}  # the last thing before this step was the curve's clock
    plain_step, plain_add, plain_abort = engine.step, engine.add_request, engine.abort
    clock = time_module.thread_time

    def step() -> Any:
        before, rows = engine.counters.num_decode_steps, len(engine.scheduler.running)
        out = plain_step()
        if clock_last["value"]:
            timed.append((rows, engine.counters.num_decode_steps > before))
        clock_last["value"] = False
        return out

    def untimed(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            clock_last["value"] = False
            return fn(*args, **kwargs)

        return call

    def thread_time() -> float:
        clock_last["value"] = True
        return clock()

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(engine, "add_request", untimed(plain_add))
    monkeypatch.setattr(engine, "abort", untimed(plain_abort))
    monkeypatch.setattr("spec_tot.adapters.local.engine.calibrate.time.thread_time", thread_time)
    curve = step_cost_curve(engine, context=64, steps=3, repeats=1)
    assert sorted(curve) == [1, 2, 4, 8]
    # every timed step decoded only, with every row of its batch (none finished early);
    # two rounds (the first warms up) of three steps per batch size
    assert timed == [(b, True) for _ in range(2) for b in (1, 2, 4, 8) for _ in range(3)]


def test_a_disturbed_step_curve_is_recognised() -> None:
    assert disturbed({1: 6.9e-3, 2: 3.5e-3, 4: 6.4e-3})  # measured while the machine was busy
    assert disturbed({1: 2.0, 64: 1.4})
    assert not disturbed({1: 2.2e-3, 2: 2.1e-3, 8: 3.6e-3, 64: 9.2e-3})  # noise, not a drop
    assert not disturbed({1: 1.0})


def test_saturation_fit_and_cache_keys(tmp_path: Path) -> None:
    assert fit_line({1: 2.0, 2: 3.0, 4: 5.0}) == pytest.approx((1.0, 1.0))
    # cost(b) = 1 + b: 3 x cost(1) = 6 at b = 5
    assert saturation_from_curve({1: 2.0, 2: 3.0, 4: 5.0, 8: 9.0}, 64) == 5
    assert saturation_from_curve({1: 1.0, 8: 1.0}, 64) == 64  # flat: never saturates
    # convex (no fixed cost in a line fit): where the measured curve crosses 3 x cost(1)
    assert saturation_from_curve({1: 1.0, 2: 1.0, 4: 1.0, 8: 9.0}, 64) == 5
    cache = CalibrationCache(tmp_path)
    key = cache.key("steps", {"model": "a"})
    assert key != cache.key("steps", {"model": "b"}) and key == cache.key("steps", {"model": "a"})
    assert cache.get(key) is None
    cache.put(key, {"x": 1})
    assert cache.get(key) == {"x": 1}
