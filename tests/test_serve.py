"""``spec-tot serve`` (the embedded engine behind SGLang's native API) driven by the real
SGLang adapter over HTTP on 127.0.0.1: same samples as the direct backend for the same seeds,
prefix aborts reach the engine, the PRM answers /classify, and the full executor gives the
same answers through HTTP as directly."""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from engine_fixtures import assert_pool_free, step_graph, tiny_llama, tiny_prm

from spec_tot import ExecutorConfig, SamplingParams, ThoughtGraph
from spec_tot.adapters.local import create_local
from spec_tot.adapters.local.serve import create_server_app, parse_generate
from spec_tot.adapters.sglang import create_sglang
from spec_tot.errors import ConfigError
from spec_tot.requests import FinishReason, GenerateRequest, RewardItem

__all__ = ["tiny_llama", "tiny_prm"]

torch.set_num_threads(1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def served(tiny_llama: Path, tiny_prm: Path) -> AsyncIterator[tuple[Any, str]]:
    backend = create_local(policy_path=str(tiny_llama), prm_path=str(tiny_prm), saturation_batch=8)
    port = _free_port()
    config = uvicorn.Config(
        create_server_app(backend), host="127.0.0.1", port=port, log_level="error", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield backend, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        await backend.flush()
        assert backend.num_inflight == 0
        assert_pool_free(backend.engine)
        await backend.aclose()


def _request(rid: str, seed: int, max_tokens: int = 12) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        prompt="1 2 3 4\n",
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed),
    )


async def test_same_samples_over_http_as_direct(served: tuple[Any, str]) -> None:
    backend, url = served
    remote = create_sglang(urls=[url], dedup=False)
    try:
        for seed in (1, 2, 3):
            direct = await backend.generate(_request(f"d{seed}", seed))
            over_http = await remote.generate(_request(f"h{seed}", seed))
            assert over_http.completions[0].text == direct.completions[0].text
            assert over_http.completions[0].token_ids == direct.completions[0].token_ids
    finally:
        await remote.aclose()


async def test_prefix_abort_reaches_the_engine(served: tuple[Any, str]) -> None:
    backend, url = served
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


async def test_classify_returns_the_prm_score_as_a_logit(served: tuple[Any, str]) -> None:
    backend, url = served
    items = [RewardItem("a", "1 2 3 4", ("1+2=3 (left: 3 3 4)",))]
    direct = await backend.score(items)
    async with httpx.AsyncClient() as client:
        reply = await client.post(
            f"{url}/classify", json={"text": ["1 2 3 4\n1+2=3 (left: 3 3 4)"]}
        )
    logit = reply.json()[0]["embedding"][0]
    assert 1 / (1 + math.exp(-logit)) == pytest.approx(direct[0][-1], abs=1e-5)


async def test_bad_requests_name_the_field(served: tuple[Any, str]) -> None:
    _backend, url = served
    async with httpx.AsyncClient() as client:
        reply = await client.post(f"{url}/generate", json={"sampling_params": {}})
        assert reply.status_code == 400 and "text" in reply.json()["error"]["message"]
        reply = await client.post(
            f"{url}/generate", json={"text": "x", "sampling_params": {"top_p": 2}}
        )
        assert reply.status_code == 400 and "top_p" in reply.json()["error"]["message"]
    with pytest.raises(ConfigError, match="sampling_params"):
        parse_generate({"text": "x", "sampling_params": [1]})


def _graph() -> ThoughtGraph:
    return step_graph(max_tokens=8, depth=2)


async def test_full_executor_same_answers_over_http(served: tuple[Any, str]) -> None:
    backend, url = served
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
