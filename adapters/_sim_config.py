"""The simulated GPU's configuration: hardware, models, engine and workload, and the roofline
cost model (step time, PRM time, reward knee, saturation batch). ``spec_tot.adapters.sim``
re-exports ``SimConfig`` and ``PRESETS``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from spec_tot.errors import ConfigError, UnknownNameError

__all__ = ["PRESETS", "SimConfig"]

# Qwen2.5-7B (config.json of Qwen/Qwen2.5-7B-Instruct): 7.61e9 parameters, 28 layers, GQA with
# 4 KV heads of dim 128; bf16 weights and KV. Qwen2.5-Math-PRM-7B has the same backbone.
# A100 80GB SXM (NVIDIA datasheet): 2.039 TB/s HBM2e, 312 TFLOPs dense bf16.
# H200 SXM (NVIDIA datasheet): 4.8 TB/s HBM3e, 989 TFLOPs dense bf16, 141 GB.
PRESETS: dict[str, dict[str, Any]] = {
    "a100-80gb-7b": {"name": "a100-80gb-7b", "hbm_bandwidth": 2.039e12, "peak_flops": 312e12,
                     "gpu_memory_bytes": 80e9},
    "h200-7b": {"name": "h200-7b", "hbm_bandwidth": 4.8e12, "peak_flops": 989e12,
                "gpu_memory_bytes": 141e9},
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Hardware, model, engine and workload of one simulated GPU. Defaults = "a100-80gb-7b".

    Assumptions (not from a datasheet): achievable fractions of peak bandwidth (0.8) and
    FLOPs (0.6); an 8 ms fixed and 50 us per-sequence cost per decode step (sampling, stop
    checks, scheduling: SGLang-like); a 30 ms PRM call overhead (template, padding, launch)
    that puts the PRM's batch-efficiency knee near 2,048 input tokens, where SpecScale
    measured it; the PRM served with a prefix cache (it computes only the new step of a
    trace whose parent it scored); MATH-like steps (median 48 tokens, sigma 0.6, 5%
    stragglers x4); 90% of siblings share a prefix of mean 32 tokens (SpecScale saw 25-50%
    shared tokens at temperature 0.8).
    Calibrated against SpecScale's profile (Fig. 15: generation 65%, verification 28% of a
    non-speculative beam search): the non-speculative beam-8 run at concurrency 32 splits
    65/35 here. The earlier fit (1 ms per sequence per step, full-context PRM) matched the
    split too but made decode cost linear in the batch, which no batching engine has.
    """

    name: str = "a100-80gb-7b"
    seed: int = 0
    # hardware
    hbm_bandwidth: float = 2.039e12  # bytes/s, peak
    peak_flops: float = 312e12  # dense bf16
    gpu_memory_bytes: float = 80e9
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.6
    memory_fraction: float = 0.9  # SGLang/vLLM default-like share of HBM the engine may use
    activation_reserve_bytes: float = 4e9  # workspace, CUDA graphs, activations
    # models
    params: float = 7.61e9
    bytes_per_param: int = 2
    num_layers: int = 28
    num_kv_heads: int = 4
    head_dim: int = 128
    kv_bytes_per_elem: int = 2
    prm_params: float = 7.61e9
    prm_call_overhead_s: float = 0.03
    prm_prefix_cache: bool = True  # the PRM recomputes only the steps it has not seen
    shared_gpu: bool = True  # the PRM runs on the policy's GPU (SpecScale's single card)
    # engine
    step_overhead_s: float = 8e-3  # see the class docstring
    per_seq_overhead_s: float = 5e-5  # see the class docstring
    max_running: int = 256
    kv_capacity: int | None = None  # tokens; None: what the memory left after weights holds
    prefill_chunk_tokens: int = 8192
    max_macro_tokens: int = 16
    engine_dedup: bool = False  # CD at engine level
    typical_context_tokens: int = 1024  # for saturation_batch
    # workload
    question_tokens: int = 200  # a MATH problem in a chat template
    answer_tokens: int = 40  # tokens of an "answer: X" step when re-read by the PRM
    step_tokens_median: float = 48.0
    step_tokens_sigma: float = 0.6
    straggler_rate: float = 0.05
    straggler_factor: float = 4.0
    answer_min_depth: int = 2
    answer_hazard: float = 0.25  # chance a step at depth >= answer_min_depth answers
    answer_max_depth: int = 16
    depth_decay: float = 0.95  # deeper answers are less often right (SPEX: shallow = reliable)
    quality_drift: float = 0.12
    reward_noise: float = 0.1
    collision_rate: float = 0.9
    collision_mean_tokens: float = 32.0
    choices: tuple[str, ...] = ("24", "23", "25", "12")
    correct: str = "24"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f.name, f"must be finite, got {value}")
        for names, ok, rule in _RULES:
            for name in names:
                if not ok(getattr(self, name)):
                    raise ConfigError(name, f"must be {rule}, got {getattr(self, name)!r}")
        if not self.answer_min_depth <= self.answer_max_depth:
            raise ConfigError("answer_min_depth", "must be <= answer_max_depth")
        if self.correct not in self.choices:
            raise ConfigError("correct", f"{self.correct!r} is not one of choices")
        if self.kv_capacity_tokens < self.typical_context_tokens:
            raise ConfigError("kv_capacity", f"{self.kv_capacity_tokens} tokens is too small")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> SimConfig:
        if name not in PRESETS:
            raise UnknownNameError("sim preset", name, sorted(PRESETS))
        return cls(**{**PRESETS[name], **overrides})

    def with_(self, **overrides: Any) -> SimConfig:
        return replace(self, **overrides)

    # -- the roofline ---------------------------------------------------------------------
    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem

    @property
    def kv_capacity_tokens(self) -> int:
        if self.kv_capacity is not None:
            return self.kv_capacity
        weights = self.weight_bytes + (self.prm_params * self.bytes_per_param) * self.shared_gpu
        free = self.gpu_memory_bytes * self.memory_fraction - weights
        return max(0, int((free - self.activation_reserve_bytes) / self.kv_bytes_per_token))

    def step_time(self, batch: int, kv_read_tokens: int, prefill_tokens: int) -> float:
        """One engine step: ``batch`` decoding sequences reading ``kv_read_tokens`` of KV,
        plus ``prefill_tokens`` prompt tokens (compute-bound; attention FLOPs ignored)."""
        if batch + prefill_tokens <= 0:
            return 0.0
        memory = (self.weight_bytes + kv_read_tokens * self.kv_bytes_per_token) / (
            self.hbm_bandwidth * self.bandwidth_efficiency
        )
        compute = (
            2 * self.params * (batch + prefill_tokens) / (self.peak_flops * self.flops_efficiency)
        )
        return self.step_overhead_s + self.per_seq_overhead_s * batch + max(memory, compute)

    def decode_step_time(self, batch: int, context_tokens: int) -> float:
        return self.step_time(batch, batch * context_tokens, 0)

    def prm_time(self, tokens: int) -> float:
        """One PRM forward pass over ``tokens`` input tokens (a prefill: compute-bound)."""
        memory = (
            self.prm_params
            * self.bytes_per_param
            / (self.hbm_bandwidth * self.bandwidth_efficiency)
        )
        compute = 2 * self.prm_params * tokens / (self.peak_flops * self.flops_efficiency)
        return self.prm_call_overhead_s + max(memory, compute)

    def reward_knee_tokens(self, efficiency: float = 0.85) -> int:
        """Batch size (input tokens) at which a PRM call reaches ``efficiency`` of its
        per-token peak: the call overhead is then mostly paid (LV's token threshold)."""
        per_token = 2 * self.prm_params / (self.peak_flops * self.flops_efficiency)
        weights = (
            self.prm_params
            * self.bytes_per_param
            / (self.hbm_bandwidth * self.bandwidth_efficiency)
        )
        # Compute-bound past the weight-read floor: tokens*c / (overhead + tokens*c).
        knee = efficiency * self.prm_call_overhead_s / ((1 - efficiency) * per_token)
        return max(1, math.ceil(max(knee, weights / per_token)))

    def saturation_batch(self) -> int:
        """The decode batch past which one more sequence stops being nearly free: where the
        per-sequence costs (overhead, KV read at ``typical_context_tokens``, or FLOPs once
        compute-bound) add up to a quarter of the fixed cost of a step (overhead + weight read: the
        step is then 1.25x a lone sequence's), capped by the running limit and the KV
        capacity."""
        bandwidth = self.hbm_bandwidth * self.bandwidth_efficiency
        per_seq_compute = 2 * self.params / (self.peak_flops * self.flops_efficiency)
        per_seq_kv = self.typical_context_tokens * self.kv_bytes_per_token / bandwidth
        fixed = self.step_overhead_s + self.weight_bytes / bandwidth
        marginal = self.per_seq_overhead_s + max(per_seq_kv, per_seq_compute)
        cap = min(self.max_running, self.kv_capacity_tokens // self.typical_context_tokens)
        return max(1, min(math.ceil(0.25 * fixed / marginal), cap))


_RULES: tuple[tuple[tuple[str, ...], Callable[[Any], bool], str], ...] = (
    (("hbm_bandwidth", "peak_flops", "gpu_memory_bytes", "params", "prm_params",
      "step_tokens_median", "straggler_factor", "collision_mean_tokens"), lambda v: v > 0, "> 0"),
    (("bandwidth_efficiency", "flops_efficiency", "memory_fraction"),
     lambda v: 0 < v <= 1, "in (0, 1]"),
    (("straggler_rate", "answer_hazard", "depth_decay", "collision_rate"),
     lambda v: 0 <= v <= 1, "in [0, 1]"),
    (("max_running", "prefill_chunk_tokens", "max_macro_tokens", "num_layers", "num_kv_heads",
      "head_dim", "bytes_per_param", "kv_bytes_per_elem", "question_tokens", "answer_tokens",
      "typical_context_tokens", "answer_min_depth"), lambda v: v >= 1, ">= 1"),
    (("step_overhead_s", "per_seq_overhead_s", "prm_call_overhead_s", "step_tokens_sigma",
      "quality_drift", "reward_noise", "activation_reserve_bytes"), lambda v: v >= 0, ">= 0"),
    (("kv_capacity",), lambda v: v is None or v >= 1, "None or >= 1"),
)  # fmt: skip
