"""The speculative executor on the real embedded engine (a tiny random Llama): every mode
finishes with nothing in flight and every KV block free, also when random queries are
cancelled mid-search; the other queries still answer."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_fixtures import assert_backend_free, step_graph, tiny_llama, tiny_prm

from spec_tot import ExecutorConfig, ThoughtGraph
from spec_tot.adapters.local import create_local

__all__ = ["tiny_llama", "tiny_prm"]

torch.set_num_threads(1)


def _graph() -> ThoughtGraph:
    return step_graph(max_tokens=12, depth=3)


@pytest.fixture
async def backend(tiny_llama: Path, tiny_prm: Path) -> Any:
    local = create_local(
        policy_path=str(tiny_llama),
        prm_path=str(tiny_prm),
        saturation_batch=16,
        num_kv_blocks=256,
    )
    yield local
    await local.flush()
    assert local.num_inflight == 0
    await assert_backend_free(local)
    await local.aclose()


@pytest.mark.parametrize("mode", ["baseline", "dedup", "naive", "spex", "specscale", "full"])
@pytest.mark.parametrize("search", ["beam", "rstar"])
async def test_modes_leave_no_request_and_no_kv_block(backend: Any, mode: str, search: str) -> None:
    params = {"n": 4, "width": 2, "max_depth": 3} if search == "beam" else {"width": 2}
    app = _graph().compile(
        search=search,
        search_params=params,
        backend=backend,
        config=ExecutorConfig(mode=mode, seed=3),
    )
    batch = await app.arun_batch([{"question": f"{i} 5 6 7"} for i in range(4)])
    assert all(r.status == "ok" and r.answer is not None for r in batch.results)
    await backend.flush()
    assert backend.num_inflight == 0
    await assert_backend_free(backend)


@pytest.mark.parametrize(
    ("seed", "search"), [(0, "beam"), (1, "beam"), (2, "rstar"), (3, "rest_mcts")]
)
async def test_random_cancellation_frees_every_block(backend: Any, seed: int, search: str) -> None:
    """Deep speculative chains (MCTS rollouts several levels below the committed frontier)
    included: cancelled queries free every block at once."""
    rng = random.Random(seed)
    params = {"n": 4, "width": 2, "max_depth": 3} if search == "beam" else {"width": 2}
    app = _graph().compile(
        search=search,
        search_params=params,
        backend=backend,
        config=ExecutorConfig(mode="full", seed=seed),
    )
    tasks = [asyncio.create_task(app.ainvoke(f"{i} 1 2 3")) for i in range(6)]
    victims = rng.sample(range(6), 3)
    for index in victims:
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        tasks[index].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for index, result in enumerate(results):
        if index in victims:
            continue
        assert not isinstance(result, BaseException), result
        assert result.answer is not None
    await backend.flush()
    assert backend.num_inflight == 0
    await assert_backend_free(backend)
