"""SGLangBackend against the fake SGLang server (127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from fake_sglang import FakeSGLang

from spec_tot.adapters.sglang import SGLangBackend, create_sglang
from spec_tot.backends import default_registry
from spec_tot.errors import BackendError, ConfigError
from spec_tot.requests import FinishReason, GenerateRequest, Priority, RewardItem, SamplingParams


def req(
    rid: str, prompt: str = "hi", n: int = 1, seed: int | None = None, **kw: object
) -> GenerateRequest:
    return GenerateRequest(rid, SamplingParams(seed=seed, max_tokens=8), prompt=prompt, n=n, **kw)  # type: ignore[arg-type]


async def until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def server() -> AsyncIterator[FakeSGLang]:
    srv = await FakeSGLang().start()
    yield srv
    await srv.stop()


def backend(urls: list[str], **kw: object) -> SGLangBackend:
    kw.setdefault("backoff_base_s", 0.001)
    return create_sglang(urls=urls, **kw)


@pytest.mark.parametrize("stream", [False, True])
async def test_generate_wire_format_and_results(server: FakeSGLang, stream: bool) -> None:
    b = backend([server.url], stream=stream)
    one = await b.generate(req("q1/a", n=1))
    many = await b.generate(
        GenerateRequest(
            "q1/b",
            SamplingParams(stop=("\n",), top_k=5),
            prompt_ids=(1, 2, 3),
            n=3,
            priority=Priority.SPECULATIVE,
        )
    )
    assert len(one.completions) == 1 and one.completions[0].text.startswith("t0.0")
    assert [c.text.split(" ")[0] for c in many.completions] == ["t0.0", "t1.0", "t2.0"]
    assert all(c.finish_reason is FinishReason.STOP and c.num_tokens == 4 for c in many.completions)
    body = server.generate_bodies[-1]
    # Never n > 1 on the wire: one prompt per sample, each with its own rid.
    assert body["input_ids"] == [[1, 2, 3]] * 3 and "text" not in body
    assert (
        body["sampling_params"]
        == [{"temperature": 0.8, "top_p": 1.0, "top_k": 5, "max_new_tokens": 64, "stop": ["\n"]}]
        * 3
    )
    assert len(set(body["rid"])) == 3
    assert all(r.startswith("q1/b#") and r.endswith("#") for r in body["rid"])  # prefix-free
    first = server.generate_bodies[0]
    assert first["text"] == "hi" and isinstance(first["rid"], str)  # a lone sample: single
    assert body["priority"] == 0 and first["priority"] == 1
    assert body["stream"] is stream
    assert b.num_inflight == 0 and server.live == {}
    # Streamed or not, the pool learned the worker's speed (per-request deadlines use it).
    learned = b.pool.endpoints[server.url.rstrip("/")].s_per_token
    assert learned is not None and learned > 0
    await b.aclose()


async def test_capabilities_sized_from_server_info(server: FakeSGLang) -> None:
    b = backend([server.url, dead_url()])
    await b.server_info()
    caps = b.capabilities
    assert caps.max_running_requests == 96 and caps.saturation_batch == 96
    assert caps.name == "sglang" and caps.prefix_cache and caps.extra["workers"] == 2.0
    await b.aclose()
    cold = backend([server.url], queue_poll_s=0)
    before = server.attempts["/get_server_info"]
    await asyncio.gather(*(cold.generate(req(f"q{i}/a", n=1)) for i in range(8)))
    assert server.attempts["/get_server_info"] - before == 1  # a burst shares one fetch
    await cold.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_subtree_abort_reaches_server(server: FakeSGLang, stream: bool) -> None:
    server.hang = True
    b = backend([server.url], stream=stream, dedup=False)
    ids = ["q/n1", "q/n1/n2", "q/n10", "other/n1"]
    tasks = {
        i: asyncio.create_task(b.generate(req(i, prompt=i, n=2 if i == "q/n1" else 1))) for i in ids
    }
    await until(lambda: len(server.live) == 5)
    assert b.num_inflight == 4
    assert await b.abort("q/n1") == 2
    for i in ("q/n1", "q/n1/n2"):
        result = await tasks[i]
        assert all(c.finish_reason is FinishReason.ABORT for c in result.completions)
    assert {r.split("#")[0] for r in server.aborted} == {"q/n1", "q/n1/n2"}
    assert len(server.aborted) == 3  # n>1: each sample's exact server rid
    assert len(server.live) == 2 and not tasks["q/n10"].done()  # the sibling q/n10 lives
    assert await b.abort("q") == 1 and await b.abort("other") == 1
    await asyncio.gather(*tasks.values())
    await until(lambda: server.live == {})
    assert b.num_inflight == 0
    await b.aclose()


async def test_cancelling_the_caller_aborts_on_server(server: FakeSGLang) -> None:
    server.hang = True
    b = backend([server.url])
    task = asyncio.create_task(b.generate(req("q/x")))
    await until(lambda: len(server.live) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: server.live == {} and bool(server.abort_calls))
    assert any(r.startswith("q/x#") for r in server.abort_calls)
    assert b.num_inflight == 0
    await b.aclose()


async def test_dedup_merges_identical_requests_and_splits_results(server: FakeSGLang) -> None:
    b = backend([server.url])
    results = await asyncio.gather(
        b.generate(req("q/a", n=2, seed=1)),
        b.generate(req("q/b", n=1, seed=2)),
        b.generate(req("q/c", n=3, seed=3)),
        b.generate(req("q/d", prompt="other")),
    )
    assert len(server.generate_bodies) == 2
    merged = next(x for x in server.generate_bodies if x["text"] != "other")
    assert merged["text"] == ["hi"] * 6
    seeds = [p["sampling_seed"] for p in merged["sampling_params"]]
    assert seeds[0] == 1 and seeds[2] == 2 and seeds[3] == 3  # each request keeps its seed
    assert len(set(seeds)) == 6  # and its other samples get their own
    assert [r.request_id for r in results] == ["q/a", "q/b", "q/c", "q/d"]
    assert [len(r.completions) for r in results] == [2, 1, 3, 1]
    texts = [c.text.split(" ")[0] for r in results[:3] for c in r.completions]
    assert texts == [f"t{i}.0" for i in range(6)]  # every sample used once, in order
    assert b.stats()["merged"] == 2.0
    await b.aclose()


async def test_aborting_one_merged_caller_keeps_the_others(server: FakeSGLang) -> None:
    server.token_delay_s = 0.02
    b = backend([server.url])
    ta = asyncio.create_task(b.generate(req("q/a", n=2)))
    tb = asyncio.create_task(b.generate(req("r/b", n=2)))  # another query: not merged
    tc = asyncio.create_task(b.generate(req("q/c", n=2)))
    await until(lambda: len(server.live) == 6)
    assert await b.abort("q/a") == 1
    a = await ta
    assert all(c.finish_reason is FinishReason.ABORT for c in a.completions)
    b_res, c_res = await tb, await tc
    assert all(c.finish_reason is FinishReason.STOP for c in c_res.completions)
    assert [c.text.split(" ")[0] for c in c_res.completions] == ["t2.0", "t3.0"]
    assert len(b_res.completions) == 2
    assert len(server.abort_calls) == 2  # only q/a's two samples stopped on the server
    assert all(r in server.aborted for r in server.abort_calls)
    await until(lambda: server.live == {})
    await b.aclose()


async def test_failover_to_a_healthy_worker(server: FakeSGLang) -> None:
    dead = dead_url()
    b = backend([dead, server.url], breaker_threshold=1)
    results = [await b.generate(req(f"q{i}/n", prompt=f"p{i}")) for i in range(4)]
    assert all(r.completions[0].finish_reason is FinishReason.STOP for r in results)
    assert server.attempts["/generate"] == 4 and b.pool.endpoints[dead].attempts == 1
    await b.aclose()


async def test_all_workers_down_names_the_endpoints() -> None:
    dead = dead_url()
    b = backend([dead], max_retries=2, breaker_threshold=10)
    with pytest.raises(BackendError) as err:
        await b.generate(req("q/n"))
    assert dead in str(err.value) and "3 attempt" in str(err.value)
    assert b.num_inflight == 0
    await b.aclose()


async def test_dropped_stream_is_an_error_and_not_retried(server: FakeSGLang) -> None:
    server.faults, server.token_delay_s = ["drop"], 0.0
    b = backend([server.url], stream=True)
    with pytest.raises(BackendError) as err:
        await b.generate(req("q/n"))
    assert server.url in str(err.value) and server.attempts["/generate"] == 1
    await until(lambda: server.live == {})
    await b.aclose()


async def test_queries_stick_to_one_worker() -> None:
    a, c = await FakeSGLang().start(), await FakeSGLang().start()
    b = backend([a.url, c.url], dedup=False)
    for q in ("q1", "q2", "q3", "q4"):
        await asyncio.gather(*(b.generate(req(f"{q}/n{i}", prompt=f"{q}{i}")) for i in range(3)))
    where = {}
    for srv in (a, c):
        for body in srv.generate_bodies:
            where.setdefault(body["rid"].split("/")[0], set()).add(srv.url)
    assert all(len(s) == 1 for s in where.values()) and len(where) == 4
    assert a.generate_bodies and c.generate_bodies
    await b.aclose()
    await a.stop()
    await c.stop()


async def test_classify_and_generative_rewards(server: FakeSGLang) -> None:
    items = [
        RewardItem("q/1", "question", ("good step", "bad step")),
        RewardItem("q/2", "question", ("bad step",)),
    ]
    b = backend([server.url])
    scores = await b.score(items)
    assert len(scores[0]) == 2 and len(scores[1]) == 1 and scores[0][0] == scores[0][1]
    assert scores[0][0] > 0.8 and scores[1][0] < 0.2  # sigmoid(+-2)
    per_step = backend([server.url], reward_per_step=True)
    assert (await per_step.score(items))[0][0] > 0.8
    judge = backend(
        [server.url],
        reward="generative",
        good_token_id=7,
        bad_token_id=8,
        reward_template="{steps}",
    )
    got = await judge.score(items)
    assert got[0][0] == pytest.approx(0.9) and got[0][1] == pytest.approx(0.2)
    assert got[1] == (pytest.approx(0.2),)
    for x in (b, per_step, judge):
        await x.aclose()


def test_config_validation_and_registry() -> None:
    with pytest.raises(ConfigError):
        create_sglang(urls=["http://127.0.0.1:1"], reward="generative")
    with pytest.raises(ConfigError):
        create_sglang(urls=["http://127.0.0.1:1"], router_url="http://127.0.0.1:2")
    made = default_registry().create("sglang", router_url="http://127.0.0.1:3")
    assert isinstance(made, SGLangBackend) and made.pool.urls == ["http://127.0.0.1:3"]


async def test_fake_is_0_5_23_parallel_samples_cannot_be_aborted_by_rid(
    server: FakeSGLang,
) -> None:
    """The fake's SGLang 0.5.23 semantics: n > 1 samples get fresh rids, so aborting the
    request's own rid is silently ignored (what the adapter must never rely on)."""
    server.hang = True
    async with httpx.AsyncClient() as client:
        body = {"text": "hi", "rid": "job2", "sampling_params": {"n": 3}}
        task = asyncio.create_task(client.post(f"{server.url}/generate", json=body))
        await until(lambda: len(server.live) == 3)
        assert "job2" not in server.live
        await client.post(f"{server.url}/abort_request", json={"rid": "job2"})
        await asyncio.sleep(0.05)
        assert len(server.live) == 3  # nothing aborted
        await client.post(f"{server.url}/abort_request", json={"abort_all": True})
        reply = await task
    assert [o["meta_info"]["finish_reason"]["type"] for o in reply.json()] == ["abort"] * 3


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dedup", [False, True])
async def test_cancelling_a_speculative_subtree_aborts_every_sample(
    server: FakeSGLang, stream: bool, dedup: bool
) -> None:
    """n = 1 and n > 1, merged or not: after abort(subtree) none of its samples is live on a
    server with SGLang 0.5.23's abort rules, and the rest of the query runs on."""
    server.hang = True
    b = backend([server.url], stream=stream, dedup=dedup)
    spec = {"priority": Priority.SPECULATIVE, "speculative": True}
    shapes = {"q/s": 1, "q/s/a": 3, "q/s/b": 1, "q/s/c": 3, "q/t": 2}
    tasks = {
        rid: asyncio.create_task(b.generate(req(rid, prompt="p", n=n, seed=7, **spec)))
        for rid, n in shapes.items()
    }
    await until(lambda: len(server.live) == sum(shapes.values()))
    assert await b.abort("q/s") == 4
    for rid in ("q/s", "q/s/a", "q/s/b", "q/s/c"):
        result = await tasks[rid]
        assert len(result.completions) == shapes[rid]
        assert all(c.finish_reason is FinishReason.ABORT for c in result.completions)
    await until(lambda: len(server.live) == 2)  # only q/t's two samples
    assert set(server.live) == set(_sample_rids(b, "q/t"))
    assert await b.abort("q") == 1
    await tasks["q/t"]
    await until(lambda: server.live == {})
    assert b.num_inflight == 0
    await b.aclose()


def _sample_rids(b: SGLangBackend, request_id: str) -> list[str]:
    member = b._members[request_id]
    group = next(g for g in b._groups.values() if member in g.members)
    return group.sample_rids([member])


async def test_reported_load_reads_v1_loads_where_no_metrics_page(server: FakeSGLang) -> None:
    server.hang, server.waiting = True, 3
    b = backend([server.url], queue_poll_s=0.01)
    assert b.reported_load() is None
    task = asyncio.create_task(b.generate(req("q/a", n=2)))
    await until(lambda: b.reported_load() == 5.0)  # 2 running + 3 waiting
    await b.abort("q")
    await task
    await until(lambda: b.reported_load() == 3.0)
    await b.aclose()
    assert any(p.startswith("/v1/loads") for p in server.attempts)


@pytest.mark.parametrize("stream", [False, True])
async def test_speculative_decoding_figures_pass_through(server: FakeSGLang, stream: bool) -> None:
    """What SGLang's meta_info says about speculative decoding lands in stats(), summed
    over outputs, under the embedded engine's keys; nothing when the server sends none."""
    b = backend([server.url], stream=stream)
    await b.generate(req("q/none"))
    assert "num_draft_tokens" not in b.stats()
    server.spec_meta = {
        "spec_verify_ct": 2,
        "spec_accept_token_num": 3,
        "spec_draft_token_num": 6,
        "spec_accept_rate": 0.5,
        "spec_accept_length": 2.0,
    }
    await b.generate(req("q/a", n=2))
    st = b.stats()
    assert st["num_verify_rows"] == st["num_decode_rows"] == 4
    assert st["num_draft_tokens"] == 12 and st["num_accepted_tokens"] == 6
    assert st["num_decode_tokens"] == 8  # completion_tokens of the two outputs
    server.spec_meta = {"spec_verify_ct": 1}  # an older server: verify passes only
    await b.generate(req("q/b"))
    assert b.stats()["num_verify_rows"] == 5 and b.stats()["num_draft_tokens"] == 12
    await b.aclose()


async def test_a_request_given_up_at_its_deadline_is_aborted_on_the_server(
    server: FakeSGLang,
) -> None:
    """A request the client stops waiting for must not run on in the server (issue 46)."""
    server.hang = True
    b = backend([server.url], deadline_floor_s=0.2, deadline_slack=1.0,
                assumed_s_per_token=0.001, max_retries=0)  # fmt: skip
    with pytest.raises(BackendError, match="deadline"):
        await b.generate(req("q/late"))
    await until(lambda: server.live == {} and bool(server.abort_calls))
    assert any(r.startswith("q/late#") for r in server.abort_calls)
    assert b.pool.endpoints[server.url.rstrip("/")].breaker.state == "closed"  # /health answers
    await b.aclose()
