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


@pytest.mark.parametrize("process", [True, False])
async def test_poison_requests_fail_alone(
    make_backend: Any, make_engine: Any, process: bool
) -> None:
    """Refused before anything runs; a huge prompt is never tokenised, in the engine's
    process (``refuse_huge_encode`` makes that an error there) or anywhere else."""
    alone = _alone(make_engine)
    backend = make_backend(
        max_model_len=512, process=process, core_hook="engine_fixtures:refuse_huge_encode"
    )
    await backend.check_health()  # started: the hook has run where the engine runs
    assert backend.stats()["hooked"] == 1.0
    for kind, (make_bad, field) in BAD_KINDS.items():
        tasks = [backend.generate(_good(i)) for i in range(8)]
        tasks.append(backend.generate(make_bad()))
        tasks += [backend.generate(_good(i)) for i in range(8, 16)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        bad = results[8]
        assert isinstance(bad, ConfigError) and bad.field == field, (kind, bad)
        good = [r for i, r in enumerate(results) if i != 8]
        assert {r.request_id: r.completions for r in good} == alone, kind


@pytest.mark.parametrize("process", [True, False])
async def test_a_step_that_raises_fails_only_its_request(
    make_backend: Any, make_engine: Any, monkeypatch: pytest.MonkeyPatch, process: bool
) -> None:
    """A request that slips past validation and breaks the forward: every row is rerun
    alone, the culprit's request fails naming it, the others carry on unchanged."""
    alone = _alone(make_engine)
    backend = make_backend(
        max_model_len=512, process=process, core_hook="engine_fixtures:skip_validation"
    )
    await backend.start()
    monkeypatch.setattr(backend.validator, "check_request", lambda request: None)
    tasks = [backend.generate(_good(i)) for i in range(16)]
    tasks.insert(
        5, backend.generate(GenerateRequest("poison", SamplingParams(), prompt_ids=(5, 999999)))
    )
    results = await asyncio.gather(*tasks, return_exceptions=True)
    error = results.pop(5)
    assert isinstance(error, BackendError) and "poison" in str(error)
    assert {r.request_id: r.completions for r in results} == alone
    assert backend.stats()["num_failed_requests"] == 1


@pytest.mark.parametrize("process", [True, False])
async def test_bookkeeping_that_raises_fails_only_its_request(
    make_backend: Any, make_engine: Any, process: bool
) -> None:
    alone = _alone(make_engine)
    backend = make_backend(
        max_model_len=512, process=process, core_hook="engine_fixtures:break_bookkeeping"
    )
    results = await asyncio.gather(
        *(backend.generate(_good(i)) for i in range(16)), return_exceptions=True
    )
    error = results.pop(3)
    assert isinstance(error, BackendError) and "good/3" in str(error)
    assert {r.request_id: r.completions for r in results} == {
        k: v for k, v in alone.items() if k != "good/3"
    }
