"""SamplingParams / GenerateRequest fields the serving API needs: full type validation
(``ConfigError`` naming the field, bools are not ints), and the new result types."""

from __future__ import annotations

from typing import Any

import pytest

from spec_tot.errors import ConfigError
from spec_tot.requests import (
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Priority,
    SamplingParams,
    StreamUpdate,
    TokenLogprob,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2.0}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": ("a",)}, "stop_token_ids"),
        ({"stop_token_ids": (True,)}, "stop_token_ids"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": False}, "seed"),
        ({"stop": (1,)}, "stop"),
        ({"stop": ("a", None)}, "stop"),
        ({"stop": 7}, "stop"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": "0.5"}, "top_p"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprob_token_ids": (1, "2")}, "logprob_token_ids"),
    ],
)
def test_sampling_types_are_checked(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_sampling_new_fields_and_normalised_lists() -> None:
    params = SamplingParams(
        max_tokens=0,
        stop=["\n"],  # type: ignore[arg-type]
        stop_token_ids=[3],  # type: ignore[arg-type]
        logprobs=0,
        logprob_token_ids=[4, 5],  # type: ignore[arg-type]
        ignore_eos=True,
    )
    assert params.stop == ("\n",) and params.stop_token_ids == (3,)
    assert params.logprob_token_ids == (4, 5) and params.wants_logprobs
    assert hash(params)  # frozen and hashable: engine-level dedup keys on it
    assert not SamplingParams().wants_logprobs
    assert SamplingParams(min_tokens=3, max_tokens=3).min_tokens == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt_ids": ()}, "prompt_ids"),
        ({"prompt_ids": (1, "2")}, "prompt_ids"),
        ({"prompt_ids": (1, -2)}, "prompt_ids"),
        ({"prompt": b"bytes"}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 2.0}, "n"),
        ({"prompt": "x", "priority": 5}, "priority"),
        ({"prompt": "x", "priority": True}, "priority"),
        ({"prompt": "x", "dedup": "yes"}, "dedup"),
        ({"prompt": "x", "prompt_logprobs_from": -1}, "prompt_logprobs_from"),
        ({"prompt": "x", "sampling": {"temperature": 1}}, "sampling"),
    ],
)
def test_request_types_are_checked(kwargs: dict[str, Any], field: str) -> None:
    kwargs = {"sampling": SamplingParams(), **kwargs}
    with pytest.raises(ConfigError) as info:
        GenerateRequest("r", **kwargs)
    assert info.value.field == field


def test_request_normalises_ids_and_priority() -> None:
    req = GenerateRequest("r", SamplingParams(), prompt_ids=[1, 2], priority=1)  # type: ignore[arg-type]
    assert req.prompt_ids == (1, 2) and req.priority is Priority.SPECULATIVE


def test_result_types_default_empty() -> None:
    lp = TokenLogprob(3, -0.5, top=((3, -0.5),), given=((4, -2.0),))
    done = Completion("t", (3,), 1, FinishReason.STOP, (lp,), "\n")
    assert Completion("t").logprobs == () and Completion("t").matched_stop is None
    assert GenerateResult("r", (done,)).prompt_logprobs == ()
    update = StreamUpdate("r", 0, (3,), "t", done)
    assert update.finished and not StreamUpdate("r", 0, (3,), "t").finished
