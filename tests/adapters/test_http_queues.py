"""A busy server is not a dead one (issue 46): deadlines count the work ahead of a request
(our requests in flight on the worker at its learned throughput, and the queue the server
publishes for every client), and a missed deadline opens no breaker while the worker's
health check answers. A worker that answers nothing, /health included, still trips its
breaker (``test_http.py``)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
from fake_sglang import FakeSGLang

from spec_tot.adapters.http import Endpoint, EndpointPool, HttpConfig
from spec_tot.adapters.http.queues import QueueReports, parse_queue
from spec_tot.adapters.openai_compat.protocol import OPENAI_WIRE
from spec_tot.adapters.sglang.protocol import SGLANG_WIRE
from spec_tot.errors import BackendTimeoutError, ConfigError

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 44.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 20.0
vllm:num_requests_swapped{engine="0",model_name="smollm2"} 3.0
"""
SGLANG_METRICS = (
    'sglang:num_running_reqs{model_name="m",dp="0"} 5\nsglang:num_queue_reqs{x="1"} 7\n'
)


@pytest.fixture
async def server() -> AsyncIterator[FakeSGLang]:
    srv = await FakeSGLang().start()
    yield srv
    await srv.stop()


def test_the_published_queue_is_read_from_vllm_and_sglang_pages() -> None:
    assert parse_queue(VLLM_METRICS) == 64.0  # running + waiting, swapped is neither
    assert parse_queue(SGLANG_METRICS) == 12.0
    assert parse_queue("other_metric 3\n") is None and parse_queue("") is None


def _pool(**kw: object) -> EndpointPool:
    config = HttpConfig(**{"health_path": None, **kw})  # type: ignore[arg-type]
    return EndpointPool(["http://w"], config, protocol=OPENAI_WIRE, rng=random.Random(0))


def test_the_deadline_counts_the_work_ahead_on_the_worker() -> None:
    """The math program at 8 in flight on one vLLM CPU server: requests priced as if each
    ran alone missed their 68 s deadlines while the server worked through its queue."""
    pool = _pool(deadline_floor_s=30.0, deadline_slack=4.0, deadline_cap_s=10_000.0)
    w = pool.endpoints["http://w"]
    pool.observe("http://w", tokens=96, seconds=96 / 18)  # alone: 18 tokens/s
    alone = pool.deadline_s(w, 96)
    assert alone == pytest.approx(30 + 4 * 96 / 18)
    for _ in range(63):  # 63 requests of 96 tokens in flight ahead of it
        w.hold(object(), 96)
    queued = pool.deadline_s(w, 96)
    assert queued == pytest.approx(30 + 4 * 64 * 96 / 18)  # the queue at the learned rate
    w.inflight = 32  # a batch of 32 finishing 96 tokens in 20 s: ~150 tokens/s together
    pool.observe("http://w", tokens=96, seconds=20.0)
    assert w.tokens_per_s is not None and w.tokens_per_s > 18
    assert alone < pool.deadline_s(w, 96) < queued  # a faster worker: a shorter wait
    for key in list(w.budgets):
        w.drop(key)
    assert w.queued_tokens == 0 and pool.deadline_s(w, 96) < queued


def test_the_published_queue_of_every_client_counts_too() -> None:
    pool = _pool(deadline_floor_s=1.0, deadline_slack=1.0, deadline_cap_s=10_000.0)
    w = pool.endpoints["http://w"]
    pool.observe("http://w", tokens=100, seconds=1.0)  # 100 tokens/s
    assert pool.deadline_s(w, 100) == pytest.approx(2.0)
    w.reported_queue = 50.0  # other clients' requests: 50 at this one's budget
    assert pool.deadline_s(w, 100) == pytest.approx(1.0 + (50 * 100 + 100) / 100)


def test_the_queue_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="queue_poll_s"):
        HttpConfig(queue_poll_s=-1)
    with pytest.raises(ConfigError, match="metrics_path"):
        HttpConfig(metrics_path="metrics")
    assert HttpConfig(queue_poll_s=0).queue_poll_s == 0  # 0: never read


async def test_a_missed_deadline_opens_no_breaker_while_health_answers(
    server: FakeSGLang,
) -> None:
    """Slow answers from a live server: each request gives up after its deadline, but the
    worker's breaker stays closed (its /health answered), so the next requests are sent."""
    server.faults = ["slow"] * 6
    server.slow_s = 1.0
    config = HttpConfig(
        deadline_floor_s=0.2, deadline_slack=1.0, assumed_s_per_token=0.001,
        breaker_threshold=2, max_retries=0, probe_timeout_s=1.0, queue_poll_s=0,
    )  # fmt: skip
    pool = EndpointPool([server.url], config, protocol=SGLANG_WIRE)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    for i in range(3):
        with pytest.raises(BackendTimeoutError):
            await pool.json("POST", "/generate", {**body, "rid": f"q{i}"}, key=f"q{i}")
        await asyncio.sleep(0.1)  # the miss's health check
    w = pool.endpoints[server.url]
    assert w.timeouts == 3 and w.busy_misses == 3 and w.breaker.state == "closed"
    await pool.aclose()


async def test_the_queue_is_read_only_while_requests_wait() -> None:
    class Client:
        def __init__(self) -> None:
            self.gets: list[str] = []

        async def get(self, url: str, **_: object) -> object:
            self.gets.append(url)

            class Reply:
                status_code = 200
                text = VLLM_METRICS

            return Reply()

    w = Endpoint("http://w", None, asyncio.Semaphore(1))  # type: ignore[arg-type]
    client = Client()
    reports = QueueReports({"http://w": w}, client, ("/metrics", None), 0.01)  # type: ignore[arg-type]
    w.inflight = 1
    reports.watch()
    await asyncio.sleep(0.05)
    assert client.gets and client.gets[0] == "http://w/metrics" and w.reported_queue == 64.0
    w.inflight = 0  # idle: reading stops and the figure is forgotten
    await asyncio.sleep(0.05)
    read = len(client.gets)
    await asyncio.sleep(0.05)
    assert len(client.gets) == read and w.reported_queue is None
    await reports.aclose()
