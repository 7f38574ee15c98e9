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
import pytest_asyncio
import torch
from engine_fixtures import step_graph, tiny_llama, tiny_prm
from serve_helpers import served, settle

from spec_tot import ExecutorConfig, SamplingParams, ThoughtGraph
from spec_tot.adapters.local import create_local
from spec_tot.adapters.local.serve import Limits, parse_generate
from spec_tot.adapters.sglang import create_sglang
from spec_tot.errors import ConfigError
from spec_tot.requests import FinishReason, GenerateRequest, RewardItem

__all__ = ["tiny_llama", "tiny_prm"]

torch.set_num_threads(1)


# One engine and server for the module (each costs a start-up); every test still ends with
# nothing running and every KV block free (``clean``).
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served_backend(tiny_llama: Path, tiny_prm: Path) -> AsyncIterator[tuple[Any, str]]:
    backend = create_local(policy_path=str(tiny_llama), prm_path=str(tiny_prm), saturation_batch=8)
    try:
        async with served(backend) as url:
            yield backend, url
    finally:
        await backend.aclose()


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def clean(served_backend: tuple[Any, str]) -> AsyncIterator[None]:
    yield
    await settle(served_backend[0])


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


async def test_a_client_that_goes_away_aborts_its_samples(
    served_backend: tuple[Any, str],
) -> None:
    """A non-streamed /generate or /v1/completions whose client disconnects stops every one
    of its samples in the engine (SGLang aborts on disconnect too)."""
    backend, url = served_backend
    long = {"ignore_eos": True, "temperature": 1.0}
    for path, body, samples in (
        ("/generate", {"text": "1 2 3 4\n", "sampling_params": {**long, "n": 3,
                                                                 "max_new_tokens": 1500}}, 3),
        ("/v1/completions", {"model": "default", "prompt": "1 2 3 4\n", "n": 2,
                             "max_tokens": 1500, "temperature": 1.0}, 2),
    ):  # fmt: skip
        before = backend.stats()["num_generated_tokens"]
        async with httpx.AsyncClient(timeout=60) as client:
            call = asyncio.create_task(client.post(url + path, json=body))
            while backend.num_inflight < samples:
                await asyncio.sleep(0.005)
            call.cancel()  # the connection closes under the running request
            await asyncio.gather(call, return_exceptions=True)
        for _ in range(400):
            if backend.num_inflight == 0:
                break
            await asyncio.sleep(0.01)
        assert backend.num_inflight == 0, path
        assert backend.stats()["num_generated_tokens"] - before < samples * 1500, path


async def test_classify_scores_the_game24_layout_as_the_prm_does(
    served_backend: tuple[Any, str],
) -> None:
    """The SGLang adapter's reward path (``{question}\\n{steps}``, one step a line, no tags):
    /classify gives the logit of exactly the score ``LocalBackend.score`` gives the item,
    for one step and for several, alone and in a batch."""
    backend, url = served_backend
    items = [
        RewardItem("a", "1 2 3 4", ("1+2=3 (left: 3 3 4)",)),
        RewardItem("b", "1 2 3 4", ("1+2=3 (left: 3 3 4)", "3*3=9 (left: 4 9)", "4+9=13")),
        RewardItem("c", "4 4 6 8", ("4+4=8 (left: 6 8 8)", "", "8/8=1 (left: 1 6)")),
    ]
    direct = await backend.score(items)
    texts = [item.question + "\n" + "\n".join(item.steps) for item in items]
    async with httpx.AsyncClient() as client:
        rows = (await client.post(f"{url}/classify", json={"text": texts})).json()
        one = (await client.post(f"{url}/classify", json={"text": texts[1]})).json()
    got = [1 / (1 + math.exp(-row["embedding"][0])) for row in rows]
    assert got == pytest.approx([s[-1] for s in direct], abs=1e-6)
    assert one["embedding"] == pytest.approx(rows[1]["embedding"], abs=1e-6)
    remote = create_sglang(urls=[url], dedup=False)  # the adapter's own reward path
    try:
        assert await remote.score(items) == [pytest.approx((s[-1],) * len(s), abs=1e-6)
                                             for s in direct]  # fmt: skip
    finally:
        await remote.aclose()


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
