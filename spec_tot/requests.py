"""Request and result dataclasses shared by the executor and every backend.

Small frozen dataclasses, validated at construction: a bad value raises ``ConfigError``
naming the field, before anything reaches a backend.

Text follows one rule everywhere (``check_text``; the HTTP server applies the same function
to every text field of every route): it must encode as UTF-8, so a lone surrogate (Python
text can hold one, from a JSON ``"\\udcff"`` escape or an ``errors="surrogateescape"``
decode) is refused naming the field, never handed to a tokenizer. A prompt must also hold at
least one character: ``prompt=""`` is refused as ``prompt_ids=()`` is.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from spec_tot.errors import ConfigError

__all__ = [
    "Capabilities",
    "Completion",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "Priority",
    "RewardItem",
    "SamplingParams",
    "StreamUpdate",
    "TokenLogprob",
    "check_text",
]

# Python text may hold code points UTF-8 cannot encode: the surrogates, alone or "paired"
# (a str never pairs them; json.loads joins an escaped pair into one code point first).
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(value: str, field: str, *, allow_empty: bool = True) -> None:
    """Refuse text a tokenizer cannot take: a ``ConfigError`` naming ``field`` when ``value``
    holds a surrogate (it cannot encode as UTF-8), or is empty where ``allow_empty`` is
    False (a prompt: empty text is refused as empty token ids are)."""
    if not value:
        if not allow_empty:
            raise ConfigError(field, "is empty (a prompt needs at least one character or token)")
        return
    if value.isascii():
        return
    bad = _SURROGATE.search(value)
    if bad is not None:
        raise ConfigError(
            field,
            f"holds the lone surrogate U+{ord(bad.group()):04X} at character {bad.start()}: "
            "text must be valid Unicode (encodable as UTF-8)",
        )


class Priority(IntEnum):
    """Scheduling class. Lower value runs first: committed work before speculative work."""

    COMMITTED = 0
    SPECULATIVE = 1


class FinishReason(IntEnum):
    STOP = 0  # a stop string or stop token was produced
    LENGTH = 1  # max_tokens reached
    ABORT = 2  # aborted by id or prefix

    @classmethod
    def from_wire(cls, name: object) -> FinishReason:
        """A server's ``finish_reason`` (``"stop"``, ``"length"``, ``"abort"``: SGLang's and
        OpenAI's spelling); anything else (``"tool_calls"``, a matched stop string's type,
        None) is a stop."""
        return _WIRE_REASONS.get(str(name), cls.STOP)


_WIRE_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not _is_int(value):
        raise ConfigError(name, f"must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")


def _int_tuple(owner: Any, name: str) -> None:
    """Normalise a list to a tuple (frozen, hashable) and check every item is an int >= 0."""
    value = getattr(owner, name)
    if isinstance(value, list):
        value = tuple(value)
        object.__setattr__(owner, name, value)
    if not isinstance(value, tuple):
        raise ConfigError(name, f"must be a tuple of ints, got {type(value).__name__}")
    for item in value:
        if not _is_int(item) or item < 0:
            raise ConfigError(name, f"must hold ints >= 0, got {item!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. ``seed`` makes a request reproducible across runs and modes.

    - ``max_tokens`` may be 0: the prompt is processed (prompt logprobs, prefix cache) and no
      token is generated (finish reason ``LENGTH``).
    - ``min_tokens``: before that many tokens are generated, EOS and ``stop_token_ids`` cannot
      be sampled (their logits are masked) and stop strings are not checked (SGLang's
      ``min_new_tokens``, vLLM's ``min_tokens``).
    - ``ignore_eos``: EOS is not a stop (it may still be sampled, and generation goes on).
    - ``logprobs``: ``None`` returns none; ``0`` the sampled token's logprob at each output
      position; ``k >= 1`` also the ``k`` most likely tokens. ``logprob_token_ids``: also the
      logprobs of these ids at each position. Logprobs are of the distribution the token was
      drawn from as SGLang reports them by default: ``log_softmax(logits / temperature)``
      (temperature 1 for greedy), after the ``min_tokens`` mask, before top-k/top-p truncation.
    """

    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    logprob_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_real(self.temperature):
            raise ConfigError("temperature", f"must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k):
            raise ConfigError("top_k", f"must be an int, got {self.top_k!r}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        _check_int("max_tokens", self.max_tokens, 0)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ConfigError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if isinstance(self.stop, str):
            raise ConfigError("stop", "must be a tuple of strings, not one string")
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop, tuple):
            raise ConfigError("stop", f"must be a tuple of strings, got {type(self.stop).__name__}")
        for stop in self.stop:
            if not isinstance(stop, str):
                raise ConfigError("stop", f"stop strings must be str, got {stop!r}")
            if not stop:
                raise ConfigError("stop", "stop strings must be non-empty")
            check_text(stop, "stop")
        _int_tuple(self, "stop_token_ids")
        _int_tuple(self, "logprob_token_ids")
        if self.seed is not None and not _is_int(self.seed):
            raise ConfigError("seed", f"must be an int or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or bool(self.logprob_token_ids)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation call: ``n`` independent samples continuing one prompt.

    ``request_id`` is hierarchical (``query/node/...``) so ``abort(prefix)`` cancels a subtree.
    Exactly one of ``prompt`` (text) and ``prompt_ids`` (token ids) is set.
    ``prompt_logprobs_from`` (SGLang's ``logprob_start_len``): also return the logprobs of the
    prompt tokens from that position on (top-k and given ids as set in ``sampling``).
    """

    request_id: str
    sampling: SamplingParams
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    n: int = 1
    priority: Priority = Priority.COMMITTED
    speculative: bool = False
    # CD: the backend may run this request in one physical sequence with identical pending
    # requests (same prompt and sampling but the seed), drawing each one's own samples.
    dedup: bool = True
    prompt_logprobs_from: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ConfigError("request_id", "must be a non-empty string")
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError("sampling", f"must be SamplingParams, got {self.sampling!r}")
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ConfigError("prompt", "set exactly one of prompt and prompt_ids")
        if self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise ConfigError("prompt", f"must be a string, got {type(self.prompt).__name__}")
            check_text(self.prompt, "prompt", allow_empty=False)
        if self.prompt_ids is not None:
            _int_tuple(self, "prompt_ids")
            if not self.prompt_ids:
                raise ConfigError("prompt_ids", "must hold at least one token id")
        _check_int("n", self.n, 1)
        if not isinstance(self.priority, Priority):
            if isinstance(self.priority, bool) or self.priority not in tuple(Priority):
                raise ConfigError("priority", f"must be a Priority, got {self.priority!r}")
            object.__setattr__(self, "priority", Priority(self.priority))
        for name in ("speculative", "dedup"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be a bool, got {getattr(self, name)!r}")
        if self.prompt_logprobs_from is not None:
            _check_int("prompt_logprobs_from", self.prompt_logprobs_from, 0)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob of ``token_id`` at one position; ``top``: the most likely ``(id,
    logprob)`` pairs there, best first; ``given``: the logprobs of the ids the request
    named, in its order."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    given: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Completion:
    """One sample. ``num_tokens`` counts generated tokens (what the engine paid for).

    ``matched_stop``: the stop string, stop token id or EOS id that ended the sample (None
    when it ended on length or abort). ``logprobs``: one entry per generated token when the
    request asked for them.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    finish_reason: FinishReason = FinishReason.STOP
    logprobs: tuple[TokenLogprob, ...] = ()
    matched_stop: str | int | None = None


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """``prompt_logprobs``: with ``prompt_logprobs_from = k``, one entry per prompt position
    from ``k`` on; the first prompt token has none (``None``)."""

    request_id: str
    completions: tuple[Completion, ...]
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()


@dataclass(frozen=True, slots=True)
class StreamUpdate:
    """One streamed step of sample ``index`` of ``request_id``: every token id so far and the
    text so far. While a sample runs, text that could still become the start of a stop
    string is held back, so the text only grows; the last update of a sample carries its
    final (stop-trimmed) ``completion``."""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    completion: Completion | None = None

    @property
    def finished(self) -> bool:
        return self.completion is not None


@dataclass(frozen=True, slots=True)
class RewardItem:
    """One trace to score: the question and the steps so far. The scorer returns one score
    per step (a PRM) or one score for the last step (an outcome verifier)."""

    request_id: str
    question: str
    steps: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.question, str):
            raise ConfigError("question", f"must be a string, got {type(self.question).__name__}")
        check_text(self.question, "question")
        if isinstance(self.steps, list):
            object.__setattr__(self, "steps", tuple(self.steps))
        if not isinstance(self.steps, tuple):
            kind = type(self.steps).__name__
            raise ConfigError("steps", f"must be a tuple of strings, got {kind}")
        for i, step in enumerate(self.steps):
            if not isinstance(step, str):
                raise ConfigError(f"steps[{i}]", f"must be a string, got {type(step).__name__}")
            check_text(step, f"steps[{i}]")

    @property
    def text(self) -> str:
        return "\n".join(self.steps)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do, and the roofline figures the speculative budget is sized from.

    ``saturation_batch`` is the decode batch size past which a step turns compute-bound (or
    the server's running-request limit): speculation is free below it and costs above it.
    """

    abort: bool = True
    prefix_abort: bool = True
    prefix_cache: bool = False
    engine_dedup: bool = False
    streaming: bool = False
    saturation_batch: int = 32
    max_running_requests: int = 256
    # Reward batch size (input tokens) past which a bigger batch no longer gets cheaper per
    # item: lazy verification's token threshold on this backend. None: not measured.
    reward_batch_tokens: int | None = None
    # About one reward batch's latency at that size: lazy verification's wall-clock bound on
    # this backend (waiting longer than a batch takes cannot pay off). None: not measured.
    reward_batch_s: float | None = None
    name: str = "backend"
    extra: dict[str, float] = field(default_factory=dict)
    # Whether the client knows what one more speculative row costs the server: the embedded
    # engine measures its step curve; a remote server's cost is a guess from the client
    # (False), so the dispatcher's gain loop starts speculation there at none and raises it
    # only where it measures a gain (``GainLoopConfig.start``).
    row_cost_known: bool = True

    def __post_init__(self) -> None:
        if self.saturation_batch < 1:
            raise ConfigError("saturation_batch", f"must be >= 1, got {self.saturation_batch}")
        if self.reward_batch_s is not None and not (
            math.isfinite(self.reward_batch_s) and self.reward_batch_s > 0
        ):
            raise ConfigError("reward_batch_s", f"must be > 0, got {self.reward_batch_s}")
        if self.max_running_requests < 1:
            raise ConfigError(
                "max_running_requests", f"must be >= 1, got {self.max_running_requests}"
            )
