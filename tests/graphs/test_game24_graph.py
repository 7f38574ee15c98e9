"""The Game-of-24 program on the shipped models and the embedded engine, with every policy:
each search ends with an answer built only from terminal nodes, the checker agrees with the
exact solver, and the engine is left with nothing in flight."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fixtures import assert_backend_free

from spec_tot.adapters.local import create_local
from spec_tot.config import ExecutorConfig
from spec_tot.graphs import game24_task as task
from spec_tot.graphs.game24 import DEFAULT_SEARCH_PARAMS, PROGRAM, compile_game24, game24_inputs
from spec_tot.policies import POLICY_NAMES

torch.set_num_threads(1)


@pytest.fixture
async def backend() -> Any:
    local = create_local(**PROGRAM.backend_options("local"), saturation_batch=16)
    yield local
    await local.flush()
    assert local.num_inflight == 0
    await assert_backend_free(local)
    await local.aclose()


def test_every_policy_has_game24_defaults() -> None:
    assert set(DEFAULT_SEARCH_PARAMS) == set(POLICY_NAMES)


@pytest.mark.parametrize("search", POLICY_NAMES)
async def test_every_policy_runs_game24(backend: Any, search: str) -> None:
    app = compile_game24(search=search, backend=backend, config=ExecutorConfig(mode="full"))
    batch = await app.arun_batch(game24_inputs(2))
    for result in batch.results:
        assert result.status == "ok", result.errors
        assert result.answer is not None
        steps = result.answer.split("\n")
        assert result.solved == task.check_answer(result.tree.question, steps)
        node = next(n for n in result.tree.nodes() if n.answer == result.answer)
        assert node.terminal


async def test_inputs_cover_only_the_test_range() -> None:
    inputs = game24_inputs(100)
    assert [i["rank"] for i in inputs] == list(range(901, 1001))
    with pytest.raises(ValueError, match="queries"):
        game24_inputs(101)
