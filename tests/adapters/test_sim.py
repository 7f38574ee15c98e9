"""The virtual-time simulator backend: clock, determinism, aborts, roofline, scheduling, CD,
and every executor mode running to completion on it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from spec_tot.adapters._sim_loop import VirtualDeadlockError, VirtualTimeLoop
from spec_tot.adapters.sim import ANSWER_PREFIX, SimBackend, SimConfig, create_sim, run_virtual
from spec_tot.backends import default_registry
from spec_tot.config import MODES, ExecutorConfig
from spec_tot.errors import ConfigError, UnknownNameError
from spec_tot.graphs import toy
from spec_tot.requests import FinishReason, GenerateRequest, Priority, RewardItem, SamplingParams

FAST = {"per_seq_overhead_s": 0.0, "step_overhead_s": 0.0}


def request(rid: str, prompt: str = "q", *, priority: Priority = Priority.COMMITTED,
            max_tokens: int = 512, seed: int | None = None) -> GenerateRequest:  # fmt: skip
    spec = priority is Priority.SPECULATIVE
    sampling = SamplingParams(max_tokens=max_tokens, stop=("\n",), seed=seed)
    return GenerateRequest(rid, sampling, prompt=prompt, priority=priority, speculative=spec)


def run_toy(mode: str = "baseline", *, queries: int = 6, conc: int = 3, **sim: Any) -> Any:
    backend = SimBackend(SimConfig(**sim))
    app = toy.compile_toy(
        backend=backend, search="beam", search_params={"n": 4, "width": 2},
        config=ExecutorConfig(mode=mode, max_concurrency=conc),
    )  # fmt: skip

    async def go() -> Any:
        batch = await app.arun_batch(toy.toy_questions(queries))
        await backend.aclose()
        return batch

    return run_virtual(go()), backend


# -- the virtual clock --------------------------------------------------------------------------
def test_virtual_clock_jumps_without_sleeping() -> None:
    async def long() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.gather(*(asyncio.sleep(1000.0 * i / 10) for i in range(11)))
        async with asyncio.timeout(5000):
            await asyncio.sleep(1.5)
        return loop.time() - start

    started = time.perf_counter()
    assert run_virtual(long()) == pytest.approx(1001.5)
    assert time.perf_counter() - started < 2.0


def test_timers_fire_in_order_and_loop_is_virtual() -> None:
    order: list[int] = []

    async def main() -> None:
        assert isinstance(asyncio.get_running_loop(), VirtualTimeLoop)
        loop = asyncio.get_running_loop()
        for i, delay in enumerate((3.0, 1.0, 2.0, 1.0)):
            loop.call_later(delay, order.append, i)
        await asyncio.sleep(4)

    run_virtual(main())
    assert order == [1, 3, 2, 0]


def test_deadlock_raises_instead_of_hanging() -> None:
    async def stuck() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(VirtualDeadlockError):
        run_virtual(stuck())


def test_threads_take_zero_virtual_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, time.sleep, 0.05)
        return loop.time()

    assert run_virtual(main()) == 0.0


# -- determinism and the toy program ------------------------------------------------------------
def test_same_seed_same_metrics_and_trees() -> None:
    (a, _), (b, _) = run_toy("full", engine_dedup=True), run_toy("full", engine_dedup=True)
    # CPU time and peak RSS are the real process's, not the simulation's
    virtual = [k for k in a.metrics.to_dict() if "cpu" not in k and "rss" not in k]
    assert [a.metrics.to_dict()[k] for k in virtual] == [b.metrics.to_dict()[k] for k in virtual]
    for ra, rb in zip(a.results, b.results, strict=True):
        na = [(n.id, n.text, n.status, n.reward) for n in ra.tree.nodes()]
        assert na == [(n.id, n.text, n.status, n.reward) for n in rb.tree.nodes()]
    (c, _) = run_toy("full", engine_dedup=True, seed=1)
    assert c.metrics.to_dict() != a.metrics.to_dict()


def test_toy_answers_and_scores_follow_the_toy_convention() -> None:
    assert ANSWER_PREFIX == toy.ANSWER_PREFIX
    batch, backend = run_toy()
    assert all(r.status == "ok" and r.answer in backend.config.choices for r in batch.results)
    assert batch.metrics.wall_s > 0 and batch.metrics.solved > 0
    scores = [backend.step_score("q", ["step 1.0 [9t q=0.900]", "answer: 24"]) for _ in "ab"]
    assert scores[0] == scores[1] and 0.0 <= scores[0] <= 1.0


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_completes_with_nothing_left(mode: str) -> None:
    batch, backend = run_toy(mode, engine_dedup=mode in ("specscale", "full"))
    assert [r.status for r in batch.results] == ["ok"] * 6
    assert backend.num_inflight == 0
    assert backend.engine.running == [] and backend.engine.waiting == []
    assert backend.engine.kv_used == 0


# -- backend contract ---------------------------------------------------------------------------
def test_prefix_abort_frees_at_once_and_returns_partial() -> None:
    backend = SimBackend(SimConfig(step_tokens_median=400, straggler_rate=0.0))

    async def main() -> None:
        tasks = [asyncio.create_task(backend.generate(request(f"q0/{i}"))) for i in range(3)]
        other = asyncio.create_task(backend.generate(request("q1/0")))
        await asyncio.sleep(0.5)
        assert backend.num_inflight == 4 and backend.engine.kv_used > 0
        assert await backend.abort("q0") == 3
        assert backend.num_inflight == 1
        results = await asyncio.gather(*tasks)
        for res in results:
            assert res.completions[0].finish_reason is FinishReason.ABORT
            assert 0 < res.completions[0].num_tokens < 400
        assert (await other).completions[0].finish_reason is not FinishReason.ABORT
        assert backend.engine.kv_used == 0 and backend.num_inflight == 0
        await backend.aclose()

    run_virtual(main())


def test_cancelled_caller_leaves_no_request() -> None:
    backend = SimBackend()

    async def main() -> None:
        task = asyncio.create_task(backend.generate(request("q/0")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.num_inflight == 0 and backend.engine.running == []
        await backend.aclose()

    run_virtual(main())


def test_committed_runs_before_speculative() -> None:
    backend = SimBackend(SimConfig(max_running=1, **FAST))
    done: list[str] = []

    async def one(req: GenerateRequest) -> None:
        await backend.generate(req)
        done.append(req.request_id)

    async def main() -> None:
        spec = [one(request(f"s/{i}", priority=Priority.SPECULATIVE)) for i in range(2)]
        await asyncio.gather(*spec, one(request("c/0")), one(request("c/1")))
        await backend.aclose()

    run_virtual(main())
    assert done[:2] == ["c/0", "c/1"]


def test_speculative_is_preempted_for_committed_work() -> None:
    backend = SimBackend(SimConfig(max_running=1, step_tokens_median=300, straggler_rate=0))

    async def main() -> None:
        spec = asyncio.create_task(backend.generate(request("s/0", priority=Priority.SPECULATIVE)))
        await asyncio.sleep(0.2)
        await backend.generate(request("c/0"))
        assert not spec.done()  # committed finished first although it came later
        await spec
        await backend.aclose()

    run_virtual(main())
    assert backend.stats()["preemptions"] >= 1


def test_dedup_shares_sibling_decode_work() -> None:
    def busy(dedup: bool) -> tuple[float, list[str], float]:
        backend = SimBackend(SimConfig(engine_dedup=dedup, collision_rate=1.0))

        async def main() -> list[str]:
            reqs = [request(f"p/{i}", "question\nstep 1.0 [10t q=0.500]") for i in range(4)]
            results = await asyncio.gather(*(backend.generate(r) for r in reqs))
            await backend.aclose()
            return [r.completions[0].text for r in results]

        texts = run_virtual(main())
        st = backend.stats()
        return st["decode_busy_s"], texts, st["dedup_saved_tokens"]

    on, off = busy(True), busy(False)
    assert on[1] == off[1]  # same samples: CD shares computation, never the draws
    assert on[2] > 0 and off[2] == 0
    assert on[0] < off[0]


def test_roofline_flat_below_saturation_and_growing_beyond() -> None:
    cfg = SimConfig(**FAST)
    sat = cfg.saturation_batch()
    assert 8 < sat <= cfg.max_running
    t = cfg.decode_step_time
    assert t(max(1, sat // 8), 128) / t(1, 128) < 1.25  # memory-bound: weights dominate
    assert t(sat, 128) / t(1, 128) <= 1.25  # "nearly free" up to the saturation batch
    assert t(16 * sat, 128) / t(4 * sat, 128) > 2.5  # compute-bound: linear in the batch
    assert cfg.prm_time(4096) > cfg.prm_time(256) > cfg.prm_call_overhead_s
    assert SimConfig.preset("h200-7b", **FAST).decode_step_time(1, 128) < t(1, 128)


def test_reward_scores_are_per_step_and_in_range() -> None:
    backend = create_sim(seed=3)
    item = RewardItem("q/0/1", "q", ("step 1.0 [10t q=0.700]", "answer: 23"))

    async def main() -> list[tuple[float, ...]]:
        out = await backend.score([item, item])
        await backend.aclose()
        return out

    scores = run_virtual(main())
    assert len(scores) == 2 and len(scores[0]) == 2
    assert all(0.0 <= s <= 1.0 for s in scores[0])
    assert backend.stats()["prm_calls"] == 1


# -- configuration ------------------------------------------------------------------------------
def test_config_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="collision_rate"):
        SimConfig(collision_rate=1.5)
    with pytest.raises(ConfigError, match="max_running"):
        SimConfig(max_running=0)
    with pytest.raises(UnknownNameError):
        SimConfig.preset("tpu")
    backend = default_registry().create("sim", preset="h200-7b", engine_dedup=True)
    assert isinstance(backend, SimBackend) and backend.capabilities.engine_dedup
    assert backend.capabilities.saturation_batch == backend.config.saturation_batch()


def test_cli_bench_runs_the_sim_on_virtual_time() -> None:
    from spec_tot.cli._execute import bench_rows as _bench

    started = time.perf_counter()
    rows = _bench(
        program="toy", backend="sim", search="beam", modes=["baseline", "full"],
        concurrency=[2], queries=2, seed=0, search_params={"n": 4, "width": 2},
        backend_options={},
    )  # fmt: skip
    assert [r["mode"] for r in rows] == ["baseline", "full"]
    assert all(r["metrics"]["wall_s"] > 0.1 for r in rows)  # virtual GPU seconds
    assert time.perf_counter() - started < 10
