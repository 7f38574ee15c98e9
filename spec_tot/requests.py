"""Request and result dataclasses shared by the executor and every backend.

Small frozen dataclasses, validated at construction: a bad value raises ``ConfigError``
naming the field, before anything reaches a backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

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
]


class Priority(IntEnum):
    """Scheduling class. Lower value runs first: committed work before speculative work."""

    COMMITTED = 0
    SPECULATIVE = 1


class FinishReason(IntEnum):
    STOP = 0  # a stop string or stop token was produced
    LENGTH = 1  # max_tokens reached
    ABORT = 2  # aborted by id or prefix


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. ``seed`` makes a request reproducible across runs and modes."""

    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ConfigError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            raise ConfigError("stop", "must be a tuple of strings, not one string")
        if any(not s for s in self.stop):
            raise ConfigError("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation call: ``n`` independent samples continuing one prompt.

    ``request_id`` is hierarchical (``query/node/...``) so ``abort(prefix)`` cancels a subtree.
    Exactly one of ``prompt`` (text) and ``prompt_ids`` (token ids) is set.
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

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ConfigError("request_id", "must be a non-empty string")
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ConfigError("prompt", "set exactly one of prompt and prompt_ids")
        if self.n < 1:
            raise ConfigError("n", f"must be >= 1, got {self.n}")


@dataclass(frozen=True, slots=True)
class Completion:
    """One sample. ``num_tokens`` counts generated tokens (what the engine paid for)."""

    text: str
    token_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    finish_reason: FinishReason = FinishReason.STOP


@dataclass(frozen=True, slots=True)
class GenerateResult:
    request_id: str
    completions: tuple[Completion, ...]
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RewardItem:
    """One trace to score: the question and the steps so far. The scorer returns one score
    per step (a PRM) or one score for the last step (an outcome verifier)."""

    request_id: str
    question: str
    steps: tuple[str, ...]

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
