"""The SGLang backend's settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from spec_tot.adapters.http import HttpConfig
from spec_tot.errors import ConfigError

__all__ = ["DEFAULT_URLS", "SGLangConfig"]

DEFAULT_URLS = ("http://127.0.0.1:30000",)


@dataclass(frozen=True, slots=True)
class SGLangConfig:
    """``reward``: ``"classify"`` (a reward model served with ``--is-embedding``; its logit
    goes through a sigmoid unless ``reward_sigmoid`` is off) or ``"generative"`` (a policy-
    style judge scored by P(good token) from one greedy token with ``return_logprob``)."""

    urls: tuple[str, ...] = DEFAULT_URLS
    stream: bool = False
    dedup: bool = True
    dedup_window_s: float = 0.0  # 0: merge what arrives in the same event-loop tick
    # SGLang's ``sampling_seed`` (deterministic inference); spec-tot serve honours it.
    forward_seed: bool = True
    reward: str = "classify"
    reward_sigmoid: bool = True
    reward_per_step: bool = False  # classify: score every step prefix, not just the trace
    reward_template: str = "{question}\n{steps}"
    judge_suffix: str = "\nIs the last step correct? Answer:"
    good_token_id: int | None = None
    bad_token_id: int | None = None
    saturation_batch: int | None = None
    # What one more speculative row costs the server is unknown here: speculation starts at
    # none and the gain loop raises it where it measures a gain. True: it starts at the
    # dispatcher's capacity, the price alone deciding until a probe finds less better.
    row_cost_known: bool = False
    http: HttpConfig = field(default_factory=HttpConfig)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigError("urls", "give at least one SGLang URL")
        if self.reward not in ("classify", "generative"):
            raise ConfigError("reward", f"must be 'classify' or 'generative', not {self.reward!r}")
        if self.reward == "generative" and self.good_token_id is None:
            raise ConfigError("good_token_id", "the generative PRM needs the 'good' token id")
