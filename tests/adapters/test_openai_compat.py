"""OpenAICompatBackend against the fake OpenAI-compatible server (127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import ClassVar

import pytest
from fake_openai import FakeOpenAI

from spec_tot.adapters.openai_compat import OpenAICompatBackend, create_openai
from spec_tot.backends import default_registry
from spec_tot.errors import BackendError
from spec_tot.requests import FinishReason, GenerateRequest, RewardItem, SamplingParams


def req(rid: str, n: int = 1, **kw: object) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=8, stop=("\n",), seed=3, **kw)  # type: ignore[arg-type]
    return GenerateRequest(rid, sampling, prompt="hi", n=n)


async def until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


@pytest.fixture
async def server() -> AsyncIterator[FakeOpenAI]:
    srv = await FakeOpenAI().start()
    yield srv
    await srv.stop()


def backend(urls: list[str], **kw: object) -> OpenAICompatBackend:
    kw.setdefault("backoff_base_s", 0.001)
    return create_openai(urls=urls, model="m", **kw)


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_stream_and_plain(server: FakeOpenAI, stream: bool) -> None:
    b = backend([server.url], stream=stream)
    result = await b.generate(req("q/a", n=2, top_k=4))
    assert [c.text for c in result.completions] == ["t0.0 t0.1 t0.2 t0.3 ", "t1.0 t1.1 t1.2 t1.3 "]
    assert all(c.finish_reason is FinishReason.STOP for c in result.completions)
    body = server.bodies[-1]
    assert body["n"] == 2 and body["stop"] == ["\n"] and body["stream"] is stream
    assert body["top_k"] == 4 and body["seed"] == 3 and body["model"] == "m"
    assert b.num_inflight == 0 and server.live == set()
    # Streamed or not, the pool learned the worker's speed (per-request deadlines use it).
    learned = b.pool.endpoints[server.url.rstrip("/")].s_per_token
    assert learned is not None and learned > 0
    await b.aclose()


async def test_abort_closes_the_stream_and_returns_partial(server: FakeOpenAI) -> None:
    server.hang = True
    b = backend([server.url])
    tasks = [asyncio.create_task(b.generate(req(rid))) for rid in ("q/n1", "q/n1/x", "q/n10")]
    await until(lambda: len(server.live) == 3 and b.num_inflight == 3)
    await asyncio.sleep(0.05)  # let the first chunk arrive
    assert await b.abort("q/n1") == 2
    for t in tasks[:2]:
        result = await t
        assert result.completions[0].finish_reason is FinishReason.ABORT
        assert result.completions[0].text == "t0.0 "  # what had streamed so far
    await until(lambda: len(server.live) == 1)  # the server saw the disconnects
    assert not tasks[2].done()
    tasks[2].cancel()  # a cancelled caller closes its connection too
    with pytest.raises(asyncio.CancelledError):
        await tasks[2]
    await until(lambda: server.live == set())
    assert server.aborted == 3 and b.num_inflight == 0
    await b.aclose()


async def test_failover_and_error_naming(server: FakeOpenAI) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    b = backend([dead, server.url])
    assert (await b.generate(req("q/a"))).completions[0].text
    await b.aclose()
    only_dead = backend([dead], max_retries=1)
    with pytest.raises(BackendError) as err:
        await only_dead.generate(req("q/a"))
    assert dead in str(err.value) and only_dead.pool.endpoints[dead].attempts == 2
    await only_dead.aclose()


async def test_pooling_prm_scores_each_step(server: FakeOpenAI) -> None:
    b = backend([server.url])
    items = [
        RewardItem("q/1", "Q", ("good a", "bad b", "good c")),
        RewardItem("q/2", "Q", ("bad",)),
    ]
    scores = await b.score(items)
    assert scores == [(0.9, 0.3, 0.9), (0.3,)]
    sent = server.attempts["/pooling"]
    assert sent == 1  # one batch, one forward pass
    await b.aclose()


async def test_generative_prm(server: FakeOpenAI) -> None:
    b = backend([server.url], reward="generative")
    scores = await b.score([RewardItem("q/1", "Q", ("good a", "bad b"))])
    assert scores[0] == (pytest.approx(0.8), pytest.approx(0.25))
    await b.aclose()


def test_registry_creates_openai() -> None:
    made = default_registry().create("openai", urls=["http://127.0.0.1:9"], model="x")
    assert isinstance(made, OpenAICompatBackend) and made.capabilities.name == "openai"


async def test_vllm_speculation_counters_from_metrics(server: FakeOpenAI) -> None:
    """The completions protocol carries no speculative-decoding figure; vLLM's Prometheus
    counters do, summed over labels and workers."""
    from spec_tot.adapters.openai_compat import parse_vllm_speculation

    server.metrics = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0',
            "vllm:num_requests_running 1.0",
        ]
    )
    b = backend([server.url])
    got = await b.server_speculation()
    assert got == {"num_verify_rows": 10.0, "num_draft_tokens": 40.0, "num_accepted_tokens": 25.0}
    assert parse_vllm_speculation("vllm:spec_decode_num_drafts 3\n") == {"num_verify_rows": 3.0}
    server.metrics = "vllm:num_requests_running 0.0\n"
    assert await b.server_speculation() == {}
    await b.aclose()


async def test_forward_seed_off_sends_no_seed(server: FakeOpenAI) -> None:
    """vLLM CPU 0.32.0's engine dies on a seeded request whose sampled token a chunked
    prefill discards: ``forward_seed=False`` leaves seeds out (issue 46)."""
    b = backend([server.url], forward_seed=False)
    await b.generate(req("q/a"))
    assert "seed" not in server.bodies[-1] and server.bodies[-1]["model"] == "m"
    await b.aclose()


def test_the_cli_names_the_served_model_and_leaves_seeds_out(server: FakeOpenAI) -> None:
    """``--backend-opt model=NAME`` was refused as "not a known option", so every request
    went out as model ``default`` (vLLM: 404)."""
    from spec_tot.cli._checks import parse_backend_options

    options = parse_backend_options(["model=smollm2", "forward_seed=false"], "openai")
    assert options == {"model": "smollm2", "forward_seed": False}


async def test_the_tokenizer_folder_renders_the_chat_template(tmp_path: object) -> None:
    from pathlib import Path

    from spec_tot.graphs.math import chat_for, plain_chat

    folder = Path(str(tmp_path))
    no_folder = create_openai(urls=["http://127.0.0.1:9"], model="m")
    assert no_folder.tokenizer is None and chat_for(no_folder) is not plain_chat
    one = [{"role": "user", "content": "hi"}]
    assert no_folder.render_chat(one) == "user: hi\nassistant:"  # no template known
    no_folder.chat.frame = ("<u>", "</u><a>")  # as learnt from the server's /tokenize
    assert no_folder.render_chat(one) == "<u>hi</u><a>"
    with pytest.raises(Exception, match="tokenizer"):
        _ = create_openai(urls=["http://127.0.0.1:9"], tokenizer=str(folder)).tokenizer


async def test_a_reply_cut_by_the_connection_is_sent_once_more(server: FakeOpenAI) -> None:
    """A worker that dies under a stream (behind a router too) cuts the reply: a second
    send is a fresh sample (the cut text dropped); a second cut is the error."""
    b = backend([server.url])
    server.faults = ["cut"]
    result = await b.generate(req("q/a"))
    assert result.completions[0].text == "t0.0 t0.1 t0.2 t0.3 " and len(server.bodies) == 2
    server.faults = ["cut", "cut"]
    with pytest.raises(BackendError, match="stream broken"):
        await b.generate(req("q/b"))
    assert b.num_inflight == 0
    await b.aclose()


def test_logprobs_over_the_protocol_read_ids_through_the_tokenizer() -> None:
    """The completions protocol names tokens by text; the judge names ids (issue 46)."""
    import math

    from spec_tot.adapters.openai_compat.logprobs import logprobs_asked, parse_logprobs
    from spec_tot.errors import ConfigError

    class Tokenizer:
        vocab: ClassVar[dict[str, int]] = {"Yes": 7, "No": 9, "Maybe": 11}

        def decode(self, ids: list[int]) -> str:
            return {v: k for k, v in self.vocab.items()}[ids[0]]

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [self.vocab[text]] if text in self.vocab else [1, 2]

    sampling = SamplingParams(temperature=1.0, max_tokens=1, logprob_token_ids=(7, 9))
    assert logprobs_asked(sampling, Tokenizer()) == 20
    with pytest.raises(ConfigError, match="tokenizer"):
        logprobs_asked(sampling, None)
    block = {"tokens": ["Yes"], "token_logprobs": [-0.1],
             "top_logprobs": [{"Yes": -0.1, "Maybe": -2.5}]}  # fmt: skip
    (entry,) = parse_logprobs(block, sampling, Tokenizer())
    assert entry.token_id == 7 and entry.logprob == -0.1
    assert dict(entry.given)[7] == -0.1 and dict(entry.given)[9] == -math.inf  # not in the top
    plain = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    assert logprobs_asked(plain, None) == 0
    (only,) = parse_logprobs(block, plain, None)
    assert only.token_id == -1 and only.top == () and only.given == ()


def test_llama_servers_logprobs_in_the_chat_shape_are_read_with_their_ids() -> None:
    """llama.cpp's ``llama-server`` answers ``/v1/completions`` ``logprobs`` in the chat
    completions' shape (as it replied live: ``content`` entries with ``id``, ``token``,
    ``logprob`` and ``top_logprobs``); its ids are taken as given, with no tokenizer."""
    import math

    from spec_tot.adapters.openai_compat.logprobs import parse_logprobs

    top = [{"id": 33, "token": "1", "logprob": -1.47}, {"id": 36, "token": "4", "logprob": -1.80},
           {"id": 34, "token": "2", "logprob": -2.06}]  # fmt: skip
    block = {"content": [{"id": 33, "token": "1", "bytes": [49], "logprob": -1.47,
                          "top_logprobs": top}]}  # fmt: skip
    judge = SamplingParams(temperature=1.0, max_tokens=1, logprobs=2, logprob_token_ids=(36, 5))
    (entry,) = parse_logprobs(block, judge, None)
    assert entry.token_id == 33 and entry.logprob == -1.47
    assert entry.top == ((33, -1.47), (36, -1.80))
    assert entry.given == ((36, -1.80), (5, -math.inf))


async def test_an_unknown_chat_template_is_said_not_hidden(
    server: FakeOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    """A server without vLLM's /tokenize: chat prompts fall back to a plain layout, and the
    backend says so (the model was not trained on it)."""
    b = backend([server.url])
    with caplog.at_level("WARNING", logger="spec_tot.backends"):
        await b.start()
    assert b.chat.frame is None
    assert any("tokenizer=DIR" in r.getMessage() for r in caplog.records)
    assert b.render_chat([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    await b.aclose()


async def test_the_servers_queue_is_the_dispatchers_load(server: FakeOpenAI) -> None:
    """Issue 53: an OpenAI-compatible server's published queue (vLLM's /metrics, every
    client's requests) reaches the dispatcher as ``reported_load``, read by the pool's one
    reader, and stays read while this client is idle (other clients' load still counts)."""
    server.metrics = "vllm:num_requests_running 2.0\nvllm:num_requests_waiting 5.0\n"
    b = backend([server.url], queue_poll_s=0.01, stream=True)
    assert b.reported_load() is None
    await b.generate(req("q/a"))
    await until(lambda: b.reported_load() == 7.0)
    server.metrics = "vllm:num_requests_running 1.0\nvllm:num_requests_waiting 0.0\n"
    await until(lambda: b.reported_load() == 1.0)  # idle here, still followed
    await b.aclose()
