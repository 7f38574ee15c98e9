"""EndpointPool: bounded retries, failover, circuit breaker, routing, limits (127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator

import pytest
from fake_sglang import FakeSGLang

from spec_tot.adapters._http import CircuitBreaker, EndpointPool, HttpConfig, query_key
from spec_tot.errors import BackendError, BackendTimeoutError


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def dead_url() -> str:
    """A 127.0.0.1 port with nothing listening: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
async def server() -> AsyncIterator[FakeSGLang]:
    srv = await FakeSGLang().start()
    yield srv
    await srv.stop()


def make_pool(urls: list[str], t: FakeTime, **kw: object) -> EndpointPool:
    config = HttpConfig(**{"max_retries": 2, "backoff_base_s": 0.1, **kw})  # type: ignore[arg-type]
    return EndpointPool(urls, config, sleep=t.sleep, clock=t.clock, rng=random.Random(0))


BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "rid": "q/1"}


async def test_retries_are_bounded_and_backoff_grows(server: FakeSGLang) -> None:
    t = FakeTime()
    server.faults = ["503"] * 10
    pool = make_pool([server.url], t, breaker_threshold=100)
    with pytest.raises(BackendError) as err:
        await pool.json("POST", "/generate", BODY, key="q")
    assert server.attempts["/generate"] == 3  # 1 + max_retries, no more
    assert server.url in str(err.value) and err.value.endpoint.startswith(server.url)
    assert len(t.sleeps) == 2 and t.sleeps[1] > t.sleeps[0] * 0.9
    assert all(0.05 <= s <= 0.2 for s in t.sleeps)  # jittered within [0.5, 1] x base * 2^k
    await pool.aclose()


async def test_refused_connection_is_retried_then_named() -> None:
    t = FakeTime()
    url = dead_url()
    pool = make_pool([url], t, breaker_threshold=100)
    with pytest.raises(BackendError) as err:
        await pool.json("GET", "/health")
    assert pool.endpoints[url].attempts == 3
    assert err.value.endpoint.startswith(url) and "cannot connect" in str(err.value)
    await pool.aclose()


async def test_500_is_not_retried(server: FakeSGLang) -> None:
    t = FakeTime()
    server.faults = ["500"]
    pool = make_pool([server.url], t)
    with pytest.raises(BackendError) as err:
        await pool.json("POST", "/generate", BODY)
    assert server.attempts["/generate"] == 1 and "500" in str(err.value)
    await pool.aclose()


async def test_lost_before_any_byte_is_retried(server: FakeSGLang) -> None:
    t = FakeTime()
    server.faults = ["refuse"]
    pool = make_pool([server.url], t)
    _, out = await pool.json("POST", "/generate", BODY)
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert server.attempts["/generate"] == 2 and server.live == {}
    await pool.aclose()


async def test_read_timeout_is_not_retried(server: FakeSGLang) -> None:
    server.faults, server.slow_s = ["slow"], 1.0
    pool = make_pool([server.url], FakeTime(), read_timeout_s=0.1)
    with pytest.raises(BackendTimeoutError) as err:
        await pool.json("POST", "/generate", BODY)
    assert server.attempts["/generate"] == 1 and server.url in err.value.endpoint
    await pool.aclose()


async def test_failover_and_sticky_routing(server: FakeSGLang) -> None:
    t = FakeTime()
    dead = dead_url()
    pool = make_pool([dead, server.url], t, breaker_threshold=1)
    pool._home["q"] = dead  # the query's home is down
    url, _ = await pool.json("POST", "/generate", BODY, key="q")
    assert url == server.url and pool.home_of("q") == server.url
    assert pool.endpoints[dead].breaker.state == "open"
    url2, _ = await pool.json("POST", "/generate", BODY, key="q")
    assert url2 == server.url and pool.endpoints[dead].attempts == 1  # open: skipped
    await pool.aclose()


async def test_routing_keeps_each_query_on_one_worker() -> None:
    a, b = await FakeSGLang().start(), await FakeSGLang().start()
    pool = make_pool([a.url, b.url], FakeTime())
    seen: dict[str, set[str]] = {}
    for i in range(12):
        q = f"q{i % 4}"
        url, _ = await pool.json(
            "POST", "/generate", {**BODY, "rid": f"{q}/{i}"}, key=query_key(f"{q}/n{i}/x")
        )
        seen.setdefault(q, set()).add(url)
    assert all(len(urls) == 1 for urls in seen.values())
    assert {u for urls in seen.values() for u in urls} == {a.url, b.url}  # both used
    await pool.aclose()
    await a.stop()
    await b.stop()


async def test_circuit_breaker_opens_and_recovers(server: FakeSGLang) -> None:
    t = FakeTime()
    pool = make_pool([server.url], t, max_retries=0, breaker_threshold=2, breaker_cooldown_s=10.0)
    server.faults = ["503", "503"]
    for _ in range(2):
        with pytest.raises(BackendError):
            await pool.json("POST", "/generate", BODY)
    assert pool.endpoints[server.url].breaker.state == "open"
    with pytest.raises(BackendError, match="circuit open"):
        await pool.json("POST", "/generate", BODY)
    assert server.attempts["/generate"] == 2  # the open breaker sent nothing
    t.now += 10.0
    assert pool.endpoints[server.url].breaker.state == "half_open"
    await pool.json("POST", "/generate", BODY)  # the probe succeeds
    assert pool.endpoints[server.url].breaker.state == "closed"
    await pool.aclose()


def test_breaker_half_open_allows_one_probe_and_reopens() -> None:
    now = [0.0]
    b = CircuitBreaker(threshold=1, cooldown_s=5.0, clock=lambda: now[0])
    b.failure()
    assert b.state == "open" and not b.acquire()
    now[0] = 5.0
    assert b.acquire() and not b.acquire()  # one probe at a time
    b.failure()
    assert b.state == "open"
    now[0] = 10.0
    assert b.acquire()
    b.success()
    assert b.state == "closed" and b.acquire() and b.acquire()


async def test_concurrency_limit_per_worker(server: FakeSGLang) -> None:
    server.token_delay_s = 0.01
    pool = make_pool([server.url], FakeTime(), max_concurrency=2)
    await asyncio.gather(
        *(pool.json("POST", "/generate", {**BODY, "rid": f"r{i}"}) for i in range(6))
    )
    assert server.max_live == 2 and server.live == {}
    await pool.aclose()


def test_query_key() -> None:
    assert query_key("q7/n1/n3") == "q7" and query_key("solo") == "solo"
