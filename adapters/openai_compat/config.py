"""The OpenAI-compatible backend's settings, and the PRM prompt layout it defaults to."""

from __future__ import annotations

from dataclasses import dataclass, field

from spec_tot.adapters.http import HttpConfig
from spec_tot.errors import ConfigError

__all__ = ["DEFAULT_URLS", "QWEN_PRM_TEMPLATE", "OpenAIConfig"]

DEFAULT_URLS = ("http://127.0.0.1:8000",)

# Qwen2.5-Math-PRM's chat layout; the steps are joined and ended by the step tag.
QWEN_PRM_TEMPLATE = (
    "<|im_start|>system\nPlease reason step by step, and put your final answer within "
    "\\boxed{{}}.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
    "<|im_start|>assistant\n{steps}<|im_end|><|endoftext|>"
)


@dataclass(frozen=True, slots=True)
class OpenAIConfig:
    """``model``: the served model's name as the server knows it (vLLM: ``--served-model-name``
    or the path it was started with; ``GET /v1/models`` lists them). ``forward_seed``: send
    each request's seed (off for a server that cannot take seeded requests, such as vLLM CPU
    0.32.0, whose engine dies on one; sampling is then the server's own, not reproducible).
    ``tokenizer``: a local folder holding the served model's tokenizer, whose chat template
    renders chat prompts (the math program's) and whose ids the self-judge reads; without
    one, the server's own template is learnt from vLLM's /tokenize (``chat.py``)."""

    urls: tuple[str, ...] = DEFAULT_URLS
    model: str = "default"
    forward_seed: bool = True
    tokenizer: str | None = None
    reward_model: str | None = None  # defaults to ``model``
    stream: bool = True
    reward: str = "pooling"
    step_tag: str = "<extra_0>"
    prm_template: str = QWEN_PRM_TEMPLATE
    judge_template: str = "{question}\n{steps}\nIs the last step correct? Answer:"
    good_token: str = " Yes"
    bad_token: str | None = " No"
    max_running_requests: int = 256
    saturation_batch: int = 64
    # What one more speculative row costs the server is unknown here: speculation starts at
    # none and the gain loop raises it where it measures a gain. True: it starts at the
    # dispatcher's capacity, the price alone deciding until a probe finds less better.
    row_cost_known: bool = False
    http: HttpConfig = field(default_factory=HttpConfig)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigError("urls", "give at least one server URL")
        if self.reward not in ("pooling", "generative"):
            raise ConfigError("reward", f"must be 'pooling' or 'generative', not {self.reward!r}")
