"""A deterministic scripted backend for tests and CLI dry runs.

It plays both roles: a ``GenerationBackend`` whose samples depend only on (seed, prompt,
sampling seed, sample index) and never on timing, and a ``RewardBackend`` whose step scores
depend only on (seed, question, steps). It can be told to be slow (per-token latency,
long-tailed lengths), to fail, or to hang until aborted, for isolation and cancellation tests.

Prompt convention (see ``spec_tot.graphs.toy``): the first line is the question and each
further line is one step, so the depth of a request is the number of lines minus one.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from spec_tot.backends import GenerationBackend, RewardBackend, matches_prefix
from spec_tot.errors import BackendError, ConfigError
from spec_tot.requests import (
    Capabilities,
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RewardItem,
)
from spec_tot.seeds import stable_seed

__all__ = ["ScriptedBackend", "ScriptedConfig", "create_scripted"]

ANSWER_PREFIX = "answer: "


@dataclass(frozen=True, slots=True)
class ScriptedConfig:
    """``depth``: the step at which a sample is an answer. ``p_correct``: chance that an
    answer sample is ``correct``. Step lengths are lognormal around ``mean_tokens``, with a
    ``straggler_rate`` chance of being ``straggler_factor`` times longer. ``score_levels``
    (0: continuous) rounds every step score to that many evenly spaced levels in [0, 1]
    (3: {0, 0.5, 1}), so that rewards tie often."""

    seed: int = 0
    depth: int = 3
    choices: tuple[str, ...] = ("24", "23", "25", "12")
    correct: str = "24"
    p_correct: float = 0.4
    mean_tokens: int = 12
    straggler_rate: float = 0.0
    straggler_factor: float = 8.0
    token_latency_s: float = 0.0
    reward_latency_s: float = 0.0
    fail_prefixes: tuple[str, ...] = ()
    hang_prefixes: tuple[str, ...] = ()
    fail_reward_questions: tuple[str, ...] = ()
    score_levels: int = 0

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ConfigError("depth", f"must be >= 1, got {self.depth}")
        if not 0.0 <= self.p_correct <= 1.0:
            raise ConfigError("p_correct", f"must be in [0, 1], got {self.p_correct}")
        if self.mean_tokens < 1:
            raise ConfigError("mean_tokens", f"must be >= 1, got {self.mean_tokens}")
        if not 0.0 <= self.straggler_rate <= 1.0:
            raise ConfigError("straggler_rate", f"must be in [0, 1], got {self.straggler_rate}")
        for name in ("token_latency_s", "reward_latency_s"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.correct not in self.choices:
            raise ConfigError("correct", f"{self.correct!r} is not one of choices")
        if self.score_levels == 1 or self.score_levels < 0:
            raise ConfigError("score_levels", f"must be 0 or >= 2, got {self.score_levels}")


@dataclass
class ScriptedBackend(GenerationBackend, RewardBackend):
    config: ScriptedConfig = field(default_factory=ScriptedConfig)
    num_generate_calls: int = 0
    num_aborted: int = 0
    num_score_calls: int = 0
    num_generated_tokens: int = 0
    peak_inflight: int = 0
    _inflight: dict[str, asyncio.Event] = field(default_factory=dict)
    score_range: tuple[float, float] | None = (0.0, 1.0)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="scripted", saturation_batch=64, max_running_requests=4096)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def inflight_ids(self) -> list[str]:
        return sorted(self._inflight)

    def stats(self) -> dict[str, float]:
        return {
            "generate_calls": self.num_generate_calls,
            "aborted": self.num_aborted,
            "score_calls": self.num_score_calls,
            "generated_tokens": self.num_generated_tokens,
            "peak_inflight": self.peak_inflight,
        }

    # -- generation ---------------------------------------------------------------------------
    def sample(self, request: GenerateRequest, index: int) -> tuple[str, int]:
        """The (text, num_tokens) of sample ``index``: a pure function of the request."""
        prompt = request.prompt if request.prompt is not None else repr(request.prompt_ids)
        rng = random.Random(
            stable_seed(self.config.seed, f"{prompt}|{request.sampling.seed}|{index}")
        )
        tokens = max(1, round(rng.lognormvariate(math.log(self.config.mean_tokens), 0.5)))
        if rng.random() < self.config.straggler_rate:
            tokens = round(tokens * self.config.straggler_factor)
        tokens = min(tokens, request.sampling.max_tokens)
        depth = prompt.count("\n")
        if depth + 1 >= self.config.depth:
            if rng.random() < self.config.p_correct:
                choice = self.config.correct
            else:
                wrong = [c for c in self.config.choices if c != self.config.correct]
                choice = rng.choice(wrong) if wrong else self.config.correct
            return f"{ANSWER_PREFIX}{choice}", tokens
        return f"step {rng.randrange(10_000)}", tokens

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.request_id in self._inflight:
            raise BackendError("scripted", f"duplicate request id {request.request_id!r}")
        self.num_generate_calls += 1
        if any(matches_prefix(request.request_id, p) for p in self.config.fail_prefixes):
            raise BackendError("scripted", f"injected failure for {request.request_id!r}")
        samples = [self.sample(request, i) for i in range(request.n)]
        aborted = asyncio.Event()
        self._inflight[request.request_id] = aborted
        self.peak_inflight = max(self.peak_inflight, len(self._inflight))
        try:
            hang = any(matches_prefix(request.request_id, p) for p in self.config.hang_prefixes)
            delay = max(t for _, t in samples) * self.config.token_latency_s
            if hang:
                await aborted.wait()
            elif delay > 0:
                await _wait_or_abort(aborted, delay)
            else:
                await asyncio.sleep(0)
        finally:
            del self._inflight[request.request_id]
        reason = FinishReason.ABORT if aborted.is_set() else FinishReason.STOP
        completions = tuple(
            Completion(text=text, num_tokens=tokens, finish_reason=reason)
            for text, tokens in samples
        )
        self.num_generated_tokens += sum(c.num_tokens for c in completions)
        return GenerateResult(
            request.request_id, completions, prompt_tokens=len(request.prompt or "")
        )

    async def abort(self, prefix: str) -> int:
        hits = [rid for rid in self._inflight if matches_prefix(rid, prefix)]
        for rid in hits:
            self._inflight[rid].set()
        self.num_aborted += len(hits)
        return len(hits)

    # -- reward -------------------------------------------------------------------------------
    def step_score(self, question: str, steps: Sequence[str]) -> float:
        """Deterministic score of the last of ``steps``: correct answers score high, wrong
        answers low, intermediate steps in between."""
        u = random.Random(stable_seed(self.config.seed, question + "|" + "\n".join(steps))).random()
        last = steps[-1] if steps else ""
        if last.startswith(ANSWER_PREFIX):
            right = last[len(ANSWER_PREFIX) :] == self.config.correct
            score = 0.6 + 0.4 * u if right else 0.4 * u
        else:
            score = 0.2 + 0.6 * u
        levels = self.config.score_levels
        return round(score * (levels - 1)) / (levels - 1) if levels else score

    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        self.num_score_calls += 1
        for item in items:
            if item.question in self.config.fail_reward_questions:
                raise BackendError("scripted-prm", f"injected failure for {item.question!r}")
        if self.config.reward_latency_s:
            await asyncio.sleep(self.config.reward_latency_s)
        return [
            tuple(
                self.step_score(item.question, item.steps[: i + 1]) for i in range(len(item.steps))
            )
            for item in items
        ]


async def _wait_or_abort(aborted: asyncio.Event, delay: float) -> None:
    waiter = asyncio.ensure_future(aborted.wait())
    try:
        await asyncio.wait({waiter}, timeout=delay)
    finally:
        waiter.cancel()


def create_scripted(**options: object) -> ScriptedBackend:
    return ScriptedBackend(ScriptedConfig(**options))  # type: ignore[arg-type]
