"""Engine configuration: frozen, validated at construction (``ConfigError`` names the field)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from spec_tot.errors import ConfigError

__all__ = ["DTYPES", "EngineConfig", "SyntheticWorkload", "resolve_device", "resolve_dtype"]

# Names accepted for ``EngineConfig.dtype``; "auto" picks bfloat16 on CUDA, float32 on CPU.
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    """Workload model for throughput studies with random-weight models of real size.

    Forward passes are real; only *what* is generated is synthetic. Each logical sample stops
    after a lognormal number of tokens (``exp(N(step_len_mu, step_len_sigma))``, capped by
    ``max_tokens``), drawn from a generator seeded by (``seed``, request id, member index) so a
    run is reproducible. Text prompts without a tokenizer are mapped to ids by a pseudo
    tokenizer (4 characters a token) that keeps shared text prefixes shared in id space.
    ``prompt_len_mu``/``prompt_len_sigma`` size prompts made by ``sample_prompt``.
    """

    seed: int = 0
    step_len_mu: float = 4.0
    step_len_sigma: float = 0.6
    prompt_len_mu: float = 5.0
    prompt_len_sigma: float = 0.5
    min_step_len: int = 1

    def __post_init__(self) -> None:
        for name in ("step_len_mu", "step_len_sigma", "prompt_len_mu", "prompt_len_sigma"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ConfigError(f"synthetic.{name}", f"must be finite, got {value}")
        if self.step_len_sigma < 0 or self.prompt_len_sigma < 0:
            raise ConfigError("synthetic.step_len_sigma", "sigmas must be >= 0")
        if self.min_step_len < 1:
            raise ConfigError("synthetic.min_step_len", f"must be >= 1, got {self.min_step_len}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs. Exactly one of ``model`` (a local Hugging Face folder) and
    ``model_config`` (a config dict: random weights, no file) is set.

    ``num_kv_blocks`` sizes the paged KV pool (``block_size`` tokens a block).
    ``saturation_batch``: ``None`` measures it at start-up (the engine's full step cost vs
    batch size, cached per model and machine), an int is taken as given.
    ``mixed_steps``: decode rows and prompt chunks share a step under a budget of
    ``max_num_batched_tokens`` tokens (False: the older all-prefill / all-decode steps, whole
    prompts, kept for comparison). ``attention``: ``"sparse"`` reads the KV pool in place for
    decode rows, ``"gather"`` gathers contexts for SDPA; ``"auto"`` picks sparse on CPU
    (float32), gather elsewhere.

    Token-level speculative decoding (``tokenspec.py``): ``token_speculation`` is the one
    switch; drafts of up to ``max_draft_tokens`` tokens come from the program's ``drafter``
    (a ``"module:attr"`` factory of a ``drafter.Drafter``, given the tokenizer), a
    ``draft_model`` folder (the draft-model seam), and prompt lookup over the sequence and
    its tree (n-grams of ``ngram_min`` .. ``ngram_max`` tokens; ``ngram_max=0`` turns it off).
    """

    model: str | None = None
    model_config: dict[str, Any] | None = None
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    enable_dedup: bool = True
    seed: int = 0
    saturation_batch: int | None = None
    mixed_steps: bool = True
    attention: str = "auto"
    synthetic: SyntheticWorkload | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    token_speculation: bool = True
    max_draft_tokens: int = 16
    drafter: str | None = None
    draft_model: str | None = None
    ngram_max: int = 4
    ngram_min: int = 2

    def __post_init__(self) -> None:
        if (self.model is None) == (self.model_config is None):
            raise ConfigError("model", "set exactly one of model (a folder) and model_config")
        if self.model is not None and not self.model:
            raise ConfigError("model", "must be a non-empty path")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError("device", f"must be 'auto', 'cpu' or 'cuda[:i]', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        for name in (
            "block_size",
            "num_kv_blocks",
            "max_num_seqs",
            "max_model_len",
            "max_num_batched_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(name, f"must be an int, got {value!r}")
            if value < 1:
                raise ConfigError(name, f"must be >= 1, got {value}")
        for name in ("enable_prefix_caching", "enable_dedup", "mixed_steps"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError("seed", f"must be an int, got {self.seed!r}")
        if not self.mixed_steps and self.max_num_batched_tokens < self.max_model_len:
            # Legacy steps prefill whole prompts: the longest prompt must fit in one step.
            raise ConfigError(
                "max_num_batched_tokens",
                f"must be >= max_model_len ({self.max_model_len}), got "
                f"{self.max_num_batched_tokens}",
            )
        if self.attention not in ("auto", "sparse", "gather"):
            raise ConfigError(
                "attention", f"must be 'auto', 'sparse' or 'gather', got {self.attention!r}"
            )
        sat = self.saturation_batch
        if sat is not None and (not isinstance(sat, int) or isinstance(sat, bool) or sat < 1):
            raise ConfigError("saturation_batch", f"must be an int >= 1, got {sat!r}")
        self._check_token_speculation()

    def _check_token_speculation(self) -> None:
        if not isinstance(self.token_speculation, bool):
            raise ConfigError(
                "token_speculation", f"must be a bool, got {self.token_speculation!r}"
            )
        for name, low in (("max_draft_tokens", 1), ("ngram_max", 0), ("ngram_min", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(name, f"must be an int >= {low}, got {value!r}")
        if self.ngram_max and self.ngram_min > self.ngram_max:
            raise ConfigError(
                "ngram_min", f"must be <= ngram_max ({self.ngram_max}), got {self.ngram_min}"
            )
        for name in ("drafter", "draft_model"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(name, f"must be a non-empty string or None, got {value!r}")
        if self.drafter is not None and ":" not in self.drafter:
            raise ConfigError(
                "drafter", f"must name a factory as 'module:attr', got {self.drafter!r}"
            )


def resolve_device(name: str) -> str:
    """``"auto"`` -> ``"cuda"`` when available, else ``"cpu"``."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", f"{name!r} requested but CUDA is not available")
    return name


def resolve_dtype(name: str, device: str) -> Any:
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
