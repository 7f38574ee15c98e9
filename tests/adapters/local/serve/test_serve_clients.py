"""Real third-party clients against ``spec-tot serve`` (a tiny random-weight model: the
protocol is under test, not the answers): SGLang's own frontend (``sglang`` 0.5.10, the last
release whose ``import sglang`` does not load the server runtime; installed with ``--no-deps``
by ``.ci/run``), the ``openai`` SDK and LangChain's ``ChatOpenAI``."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_fixtures import tiny_llama
from serve_helpers import serve_in_thread

from spec_tot.adapters.local import create_local

__all__ = ["tiny_llama"]

torch.set_num_threads(1)


def library(module: str) -> Any:
    """The client library; CI (``SPEC_TOT_REQUIRE_CLIENTS=1``) fails rather than skips."""
    if os.environ.get("SPEC_TOT_REQUIRE_CLIENTS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


@pytest.fixture(scope="module")
def url(tiny_llama: Path) -> Iterator[str]:
    def make() -> object:
        return create_local(policy_path=str(tiny_llama), saturation_batch=8)

    with serve_in_thread(make, model_path=str(tiny_llama), served_model_name="tiny") as base:  # type: ignore[arg-type]
        yield base


# -- SGLang's frontend language -----------------------------------------------------------------
def test_sglang_runtime_endpoint_gen_fork_stream_and_run_batch(url: str) -> None:
    sgl = library("sglang")
    backend = sgl.RuntimeEndpoint(url)  # GET /get_model_info at construction
    assert backend.get_model_name()
    assert backend.get_server_info()["max_running_requests"] >= 1  # GET /server_info

    @sgl.function
    def story(s, start):  # type: ignore[no-untyped-def]
        s += start
        s += sgl.gen("first", max_tokens=6, temperature=0)
        forks = s.fork(2)  # max_new_tokens 0 prefill requests cache the shared prefix
        for i, f in enumerate(forks):
            f += f" {i}" + sgl.gen("branch", max_tokens=4, temperature=0.8)
        forks.join()
        s += sgl.gen("last", max_tokens=3, stop="\n")

    state = story.run(start="1 2 3 4\n", backend=backend)
    assert isinstance(state["first"], str) and isinstance(state["last"], str)
    assert state.text().startswith("1 2 3 4\n" + state["first"])

    streamed = story.run(start="5 6 7 8\n", backend=backend, stream=True)
    chunks = list(streamed.text_iter())
    assert "".join(chunks).startswith("5 6 7 8\n")

    states = story.run_batch(
        [{"start": "1 1 1 1\n"}, {"start": "2 2 2 2\n"}, {"start": "3 3 3 3\n"}],
        backend=backend,
        num_threads=2,
    )
    assert [s.text()[:8] for s in states] == ["1 1 1 1\n", "2 2 2 2\n", "3 3 3 3\n"]

    @sgl.function
    def pick(s):  # type: ignore[no-untyped-def]
        s += "1 2 3 4\n" + sgl.select("op", choices=["1+2=3", "4*3=12", "2-1=1"])

    # select: a max_new_tokens 0 prefill, then batched prompt logprobs from logprob_start_len
    assert pick.run(backend=backend)["op"] in ("1+2=3", "4*3=12", "2-1=1")
    backend.flush_cache()  # POST /flush_cache


# -- the openai SDK ---------------------------------------------------------------------------
def test_openai_sdk_completions_chat_n_and_stream(url: str) -> None:
    openai = library("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]

    done = client.completions.create(model="tiny", prompt="1 2 3 4\n", max_tokens=5, n=3, seed=1)
    assert len(done.choices) == 3 and [c.index for c in done.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in done.choices)
    assert done.usage is not None and done.usage.completion_tokens > 0

    same = client.completions.create(model="tiny", prompt="1 2 3 4\n", max_tokens=5, n=3, seed=1)
    assert [c.text for c in same.choices] == [c.text for c in done.choices]  # seeded

    pieces: dict[int, str] = {}
    for chunk in client.completions.create(
        model="tiny", prompt="1 2 3 4\n", max_tokens=5, n=2, seed=1, stream=True
    ):
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + c.text
    assert [pieces[i] for i in range(2)] == [c.text for c in done.choices[:2]]

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=4,
        n=2,
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.role == "assistant"
    text = ""
    for chunk in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    ):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert isinstance(text, str)

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, frequency_penalty=1.0)
    assert "frequency_penalty" in str(err.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


# -- LangChain's ChatOpenAI ---------------------------------------------------------------------
def test_langchain_chat_openai_invoke_and_stream(url: str) -> None:
    lc = library("langchain_openai")
    model = lc.ChatOpenAI(
        base_url=f"{url}/v1", api_key="unused", model="tiny", max_tokens=5, max_retries=0
    )
    reply = model.invoke("1 2 3 4")
    assert isinstance(reply.content, str)
    streamed = "".join(str(chunk.content) for chunk in model.stream("1 2 3 4"))
    assert isinstance(streamed, str)
