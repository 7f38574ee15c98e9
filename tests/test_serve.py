"""``spec-tot serve`` (the embedded engine behind SGLang's native API) driven by the real
SGLang adapter over HTTP on 127.0.0.1: same samples as the direct backend for the same seeds,
prefix aborts reach the engine, the PRM answers /classify, and the full executor gives the
same answers through HTTP as directly."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_fixtures import step_graph, tiny_llama, tiny_prm
from serve_helpers import served

from spec_tot import ExecutorConfig, SamplingParams, ThoughtGraph
from spec_tot.adapters.local import create_local
from spec_tot.adapters.local.serve import Limits, parse_generate
from spec_tot.adapters.sglang import create_sglang
from spec_tot.errors import ConfigError
from spec_tot.requests import FinishReason, GenerateRequest, RewardItem

__all__ = ["tiny_llama", "tiny_prm"]

torch.set_num_threads(1)


@pytest.fixture
async def served_backend(tiny_llama: Path, tiny_prm: Path) -> AsyncIterator[tuple[Any, str]]:
    backend = create_local(policy_path=str(tiny_llama), prm_path=str(tiny_prm), saturation_batch=8)
    try:
        async with served(backend) as url:
            yield backend, url
    finally:
        await backend.aclose()


def _request(rid: str, seed: int, max_tokens: int = 12) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        prompt="1 2 3 4\n",
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed),
    )


async def test_same_samples_over_http_as_direct(served_backend: tuple[Any, str]) -> None:
    backend, url = served_backend
    remote = create_sglang(urls=[url], dedup=False)
    try:
        for seed in (1, 2, 3):
            direct = await backend.generate(_request(f"d{seed}", seed))
            over_http = await remote.generate(_request(f"h{seed}", seed))
            assert over_http.completions[0].text == direct.completions[0].text
            assert over_http.completions[0].token_ids == direct.completions[0].token_ids
    finally:
        await remote.aclose()


async def test_prefix_abort_reaches_the_engine(served_backend: tuple[Any, str]) -> None:
    backend, url = served_backend
    remote = create_sglang(urls=[url], dedup=False)
    try:
        long = [
            asyncio.create_task(remote.generate(_request(f"q7/{i}", i, max_tokens=2000)))
            for i in range(3)
        ]
        while backend.num_inflight < 3:
            await asyncio.sleep(0.01)
        await remote.abort("q7")
        results = await asyncio.gather(*long)
        assert all(r.completions[0].finish_reason is FinishReason.ABORT for r in results)
        assert all(r.completions[0].num_tokens < 2000 for r in results)
        await backend.flush()
        assert backend.num_inflight == 0
    finally:
        await remote.aclose()


async def test_classify_returns_the_prm_score_as_a_logit(served_backend: tuple[Any, str]) -> None:
    backend, url = served_backend
    items = [RewardItem("a", "1 2 3 4", ("1+2=3 (left: 3 3 4)",))]
    direct = await backend.score(items)
    async with httpx.AsyncClient() as client:
        reply = await client.post(
            f"{url}/classify", json={"text": ["1 2 3 4\n1+2=3 (left: 3 3 4)"]}
        )
    logit = reply.json()[0]["embedding"][0]
    assert 1 / (1 + math.exp(-logit)) == pytest.approx(direct[0][-1], abs=1e-5)


async def test_bad_requests_name_the_field(served_backend: tuple[Any, str]) -> None:
    _backend, url = served_backend
    async with httpx.AsyncClient() as client:
        reply = await client.post(f"{url}/generate", json={"sampling_params": {}})
        assert reply.status_code == 400 and "text" in reply.json()["error"]["message"]
        reply = await client.post(
            f"{url}/generate", json={"text": "x", "sampling_params": {"top_p": 2}}
        )
        assert reply.status_code == 400 and "top_p" in reply.json()["error"]["message"]
    with pytest.raises(ConfigError, match="sampling_params"):
        parse_generate({"text": "x", "sampling_params": [1]}, Limits(128, 512, 8192))


def _graph() -> ThoughtGraph:
    return step_graph(max_tokens=8, depth=2)


async def test_full_executor_same_answers_over_http(served_backend: tuple[Any, str]) -> None:
    backend, url = served_backend
    questions = [{"question": f"{i} 2 3 4", "query_id": f"p{i}"} for i in range(3)]
    direct_app = _graph().compile(
        search="beam",
        search_params={"n": 4, "width": 2, "max_depth": 2},
        backend=backend,
        config=ExecutorConfig(mode="full", seed=5),
    )
    remote = create_sglang(urls=[url], dedup=False, reward_per_step=True)
    http_app = _graph().compile(
        search="beam",
        search_params={"n": 4, "width": 2, "max_depth": 2},
        backend=remote,
        reward=remote,
        config=ExecutorConfig(mode="full", seed=5),
    )
    try:
        direct = await direct_app.arun_batch(questions)
        over_http = await http_app.arun_batch(questions)
    finally:
        await remote.aclose()
    assert [r.answer for r in over_http.results] == [r.answer for r in direct.results]
    assert all(r.status == "ok" for r in over_http.results)
