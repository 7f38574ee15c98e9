"""Game of 24 end to end over HTTP with the shipped models (issue 14's acceptance): the same
puzzles, seed and mode through ``create_sglang`` against ``spec-tot serve`` (generation on
``/generate``, the PRM on ``/classify``) and through ``create_openai`` against its ``/v1``
routes give the embedded backend's answers. ``benchmarks/serve_e2e.py`` runs more puzzles,
with the server in its own process."""

from __future__ import annotations

from typing import Any

import torch
from serve_helpers import served

from spec_tot.adapters.local import create_local
from spec_tot.adapters.openai_compat import create_openai
from spec_tot.adapters.sglang import create_sglang
from spec_tot.config import ExecutorConfig
from spec_tot.graphs import game24_task as task
from spec_tot.graphs.game24 import compile_game24, game24_inputs

torch.set_num_threads(1)

PUZZLES = 3


async def test_game24_answers_equal_through_both_http_adapters() -> None:
    folder = task.asset_dir()
    backend = create_local(
        policy_path=str(folder / "policy"), prm_path=str(folder / "prm"), saturation_batch=16
    )
    config = ExecutorConfig(mode="baseline", seed=0, max_concurrency=PUZZLES)
    inputs = game24_inputs(PUZZLES)

    async def run(gen: Any, reward: Any) -> list[Any]:
        assert await backend.flush_prefix_cache()  # every path starts from the same state
        app = compile_game24(search="rebase", backend=gen, reward=reward, config=config)
        batch = await app.arun_batch(inputs)
        assert all(r.status == "ok" and not r.errors for r in batch.results), batch.results
        return [r.answer for r in batch.results]

    try:
        direct = await run(backend, backend)
        async with served(backend) as url:
            rewards = create_sglang(urls=[url], dedup=False, reward_per_step=True)
            openai = create_openai(urls=[url], model="default", stream=True)
            try:
                over_sglang = await run(rewards, rewards)
                over_openai = await run(openai, rewards)
                assert rewards.counters["wire_requests"] > 0  # it did go over HTTP
            finally:
                await openai.aclose()
                await rewards.aclose()
    finally:
        await backend.aclose()
    assert any(a is not None for a in direct)
    assert over_sglang == direct
    assert over_openai == direct
