"""Request, sampling and capability dataclasses: validated at construction, naming the field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from spec_tot.errors import ConfigError, SpecTotError
from spec_tot.requests import (
    Capabilities,
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Priority,
    RewardItem,
    SamplingParams,
)


def test_sampling_defaults_are_valid_and_frozen() -> None:
    params = SamplingParams()
    assert params.temperature == 0.8
    assert params.top_p == 1.0
    assert params.top_k == -1
    assert params.max_tokens == 64
    assert not params.greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.0  # type: ignore[misc]


def test_greedy_only_at_zero_temperature() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-6).greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.0001}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"stop": "\n"}, "stop"),
        ({"stop": ("\n", "")}, "stop"),
    ],
)
def test_sampling_rejects_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:")
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, SpecTotError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 1},
        {"max_tokens": 1},
        {"stop": ("\n\n", "###")},
        {"seed": 7},
    ],
)
def test_sampling_accepts_boundary_values(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_sampling_unknown_key_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="bogus"):
        SamplingParams(bogus=1)  # type: ignore[call-arg]


def _req(**kwargs: object) -> GenerateRequest:
    base: dict[str, object] = {"request_id": "q0/1", "sampling": SamplingParams()}
    base.update(kwargs)
    return GenerateRequest(**base)  # type: ignore[arg-type]


def test_generate_request_with_text_or_ids() -> None:
    text = _req(prompt="hello")
    assert text.prompt == "hello" and text.prompt_ids is None
    assert text.n == 1
    assert text.priority is Priority.COMMITTED and not text.speculative
    ids = _req(prompt_ids=(1, 2, 3), n=4, priority=Priority.SPECULATIVE, speculative=True)
    assert ids.prompt_ids == (1, 2, 3) and ids.n == 4


def test_generate_request_text_follows_the_one_text_rule() -> None:
    # "" is set (not None), and refused as an empty prompt_ids is: one rule for both.
    with pytest.raises(ConfigError, match="prompt: is empty") as info:
        _req(prompt="")
    assert info.value.field == "prompt"
    with pytest.raises(ConfigError, match="prompt_ids"):
        _req(prompt_ids=())
    # A lone surrogate (a JSON "\\udcff" escape) cannot be encoded: refused naming the field.
    with pytest.raises(ConfigError, match="U\\+DCFF at character 2") as info:
        _req(prompt="ab\udcff")
    assert info.value.field == "prompt"
    assert _req(prompt="\U0001f600 \x00 \ufffe").prompt  # any real code point is text
    with pytest.raises(ConfigError, match="stop"):
        SamplingParams(stop=("\ud800",))
    with pytest.raises(ConfigError, match=r"steps\[1\]"):
        RewardItem("r", "q", ("ok", "\udfff"))
    with pytest.raises(ConfigError, match="question"):
        RewardItem("r", "\ud83d\ude00", ())  # an unjoined pair is two lone surrogates


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": "a", "prompt_ids": (1,)}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "n": -1}, "n"),
        ({"prompt": "a", "request_id": ""}, "request_id"),
    ],
)
def test_generate_request_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        _req(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)


def test_priority_orders_committed_first() -> None:
    assert Priority.COMMITTED < Priority.SPECULATIVE
    assert sorted([Priority.SPECULATIVE, Priority.COMMITTED])[0] is Priority.COMMITTED


def test_completion_and_result_defaults() -> None:
    completion = Completion("x")
    assert completion.finish_reason is FinishReason.STOP
    assert completion.num_tokens == 0 and completion.token_ids == ()
    result = GenerateResult("q0", (completion,))
    assert result.prompt_tokens == 0 and result.cached_prompt_tokens == 0


def test_reward_item_text_joins_steps() -> None:
    item = RewardItem("q0/1", "question", ("a", "b", "c"))
    assert item.text == "a\nb\nc"
    assert RewardItem("q0/2", "question", ()).text == ""


def test_capabilities_defaults_and_independent_extra() -> None:
    caps = Capabilities()
    assert caps.abort and caps.prefix_abort
    assert not caps.prefix_cache and not caps.engine_dedup and not caps.streaming
    assert caps.saturation_batch == 32
    assert caps.max_running_requests == 256
    assert caps.name == "backend"
    other = Capabilities()
    caps.extra["x"] = 1.0
    assert other.extra == {}  # default_factory, not a shared dict
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.abort = False  # type: ignore[misc]


def test_capabilities_custom_values() -> None:
    caps = Capabilities(abort=False, saturation_batch=8, name="x", extra={"bw": 2.0})
    assert not caps.abort
    assert caps.saturation_batch == 8
    assert caps.extra == {"bw": 2.0}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"saturation_batch": 0}, "saturation_batch"),
        ({"max_running_requests": -1}, "max_running_requests"),
    ],
)
def test_capabilities_rejects_non_positive_limits(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        Capabilities(**kwargs)
    assert info.value.field == field


def test_a_servers_finish_reason_maps_to_ours() -> None:
    from spec_tot.requests import FinishReason

    assert FinishReason.from_wire("stop") is FinishReason.STOP
    assert FinishReason.from_wire("length") is FinishReason.LENGTH
    assert FinishReason.from_wire("abort") is FinishReason.ABORT
    assert FinishReason.from_wire("tool_calls") is FinishReason.STOP
    assert FinishReason.from_wire(None) is FinishReason.STOP
