"""One bad request fails alone: 16 good requests beside one bad one of each kind get the
outputs they get alone; the bad one gets a clear error naming the field (or the request)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from engine_fixtures import make_backend, make_engine, run_all, tiny_llama

from spec_tot.errors import BackendError, ConfigError
from spec_tot.requests import GenerateRequest, SamplingParams

__all__ = ["make_backend", "make_engine", "tiny_llama"]

torch.set_num_threads(1)


def _good(i: int) -> GenerateRequest:
    params = SamplingParams(temperature=0.9, seed=i, max_tokens=12, stop=("\n",))
    return GenerateRequest(f"good/{i}", params, prompt=f"prompt {i}: ", n=1 + i % 3)


def _alone(make_engine: Any) -> dict[str, Any]:
    engine = make_engine(max_model_len=512)
    out = {}
    for i in range(16):
        engine.add_request(_good(i))
        out.update({k: v.completions for k, v in run_all(engine).items()})
    return out


BAD_KINDS = {
    "ids outside the vocabulary": (
        lambda: GenerateRequest("bad", SamplingParams(), prompt_ids=(5, 999999)),
        "prompt_ids",
    ),
    "stop id outside the vocabulary": (
        lambda: GenerateRequest("bad", SamplingParams(stop_token_ids=(10**6,)), prompt="x"),
        "sampling.stop_token_ids",
    ),
    "1 MB prompt": (lambda: GenerateRequest("bad", SamplingParams(), prompt="x" * 2**20), "prompt"),
    "prompt over max_model_len": (
        lambda: GenerateRequest("bad", SamplingParams(), prompt_ids=(5,) * 600),
        "prompt_ids",
    ),
    "n over max_num_seqs": (
        lambda: GenerateRequest("bad", SamplingParams(), prompt="x", n=999),
        "n",
    ),
    "logprobs over the vocabulary": (
        lambda: GenerateRequest("bad", SamplingParams(logprobs=10**6), prompt="x"),
        "sampling.logprobs",
    ),
}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stop": (1,)},
        {"max_tokens": float("1e999")},
        {"max_tokens": "10"},
        {"stop_token_ids": ("a",)},
        {"seed": "x"},
    ],
)
def test_bad_sampling_never_reaches_the_engine(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)
    with pytest.raises(ConfigError, match="prompt_ids"):
        GenerateRequest("bad", SamplingParams(), prompt_ids=())


async def test_poison_requests_fail_alone(make_backend: Any, make_engine: Any) -> None:
    alone = _alone(make_engine)
    backend = make_backend(max_model_len=512)
    encode_calls = 0
    tokenizer = backend.engine.tokenizer
    real_encode = tokenizer.encode

    def counting_encode(text: str, *args: Any, **kw: Any) -> Any:
        nonlocal encode_calls
        encode_calls += len(text) > 10_000  # a huge prompt must never be tokenised
        return real_encode(text, *args, **kw)

    tokenizer.encode = counting_encode
    for kind, (make_bad, field) in BAD_KINDS.items():
        tasks = [backend.generate(_good(i)) for i in range(8)]
        tasks.append(backend.generate(make_bad()))
        tasks += [backend.generate(_good(i)) for i in range(8, 16)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        bad = results[8]
        assert isinstance(bad, ConfigError) and bad.field == field, (kind, bad)
        good = [r for i, r in enumerate(results) if i != 8]
        assert {r.request_id: r.completions for r in good} == alone, kind
    assert encode_calls == 0


async def test_a_step_that_raises_fails_only_its_request(
    make_backend: Any, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that slips past validation and breaks the forward: every row is rerun
    alone, the culprit's request fails naming it, the others carry on unchanged."""
    alone = _alone(make_engine)
    backend = make_backend(max_model_len=512)
    validator = backend.engine.validator
    monkeypatch.setattr(validator, "check_request", lambda request: None)
    monkeypatch.setattr(validator, "check_ids", lambda ids, field: None)
    tasks = [backend.generate(_good(i)) for i in range(16)]
    tasks.insert(
        5, backend.generate(GenerateRequest("poison", SamplingParams(), prompt_ids=(5, 999999)))
    )
    results = await asyncio.gather(*tasks, return_exceptions=True)
    error = results.pop(5)
    assert isinstance(error, BackendError) and "poison" in str(error)
    assert {r.request_id: r.completions for r in results} == alone
    assert backend.stats()["num_failed_requests"] == 1


async def test_bookkeeping_that_raises_fails_only_its_request(
    make_backend: Any, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = _alone(make_engine)
    backend = make_backend(max_model_len=512)
    post = backend.engine.post
    real_append = post.append

    def append(seq: Any, *args: Any) -> None:
        if any(m.request.request_id == "good/3" for m in seq.members) and seq.num_output_tokens > 2:
            raise RuntimeError("bookkeeping broke")
        real_append(seq, *args)

    monkeypatch.setattr(post, "append", append)
    results = await asyncio.gather(
        *(backend.generate(_good(i)) for i in range(16)), return_exceptions=True
    )
    error = results.pop(3)
    assert isinstance(error, BackendError) and "good/3" in str(error)
    assert {r.request_id: r.completions for r in results} == {
        k: v for k, v in alone.items() if k != "good/3"
    }
