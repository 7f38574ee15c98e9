"""A virtual-time simulator backend: the real executor code on a modelled GPU, fast and
deterministic.

``SimBackend`` is a ``GenerationBackend`` and a ``RewardBackend`` whose work costs *virtual*
time (``await asyncio.sleep(dt)`` on ``VirtualTimeLoop``; run it with ``run_virtual``):
- engine: continuous batching (``SimEngine``), committed before speculative, a running limit,
  KV capacity in tokens with preemption, a radix-like prefix cache, abort that frees at once,
  and CD (engine-level dedup: siblings with one prompt decode their first k tokens once);
- cost: a roofline. Decode step = overhead + max((weights + KV read) / bandwidth,
  2 * params * tokens / FLOPs); prefill tokens join the step's compute term; a PRM batch =
  call overhead + its own roofline, on the same GPU by default (it stalls decoding);
- workload (a pure function of seed, prompt and sampling seed, so every mode sees the
  same tree): lognormal step lengths with stragglers, a latent quality per branch that the
  PRM sees through noise, answer depth skew, a token-collision model for CD.

Prompt convention = ``spec_tot.graphs.toy``: the question line, then one line per step; an
answer step is ``"answer: X"``. A step's text carries its token count and latent quality
(``step 3.1a2b3c [57t q=0.612]``) so prompt lengths and PRM scores need no hidden state.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from spec_tot._private.compiled import stable_seed
from spec_tot.adapters._sim_loop import SimEngine, SimSeq, VirtualTimeLoop, run_virtual
from spec_tot.backends import GenerationBackend, RewardBackend
from spec_tot.errors import BackendError, ConfigError, UnknownNameError
from spec_tot.requests import (
    Capabilities,
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RewardItem,
)

__all__ = [
    "ANSWER_PREFIX",
    "PRESETS",
    "SimBackend",
    "SimConfig",
    "VirtualTimeLoop",
    "create_sim",
    "run_virtual",
]

ANSWER_PREFIX = "answer: "  # same as spec_tot.graphs.toy.ANSWER_PREFIX
_STEP = re.compile(r"\[(\d+)t q=([0-9.]+)\]$")

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


# -- workload and backend -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Sample:
    text: str
    tokens: int
    finish: FinishReason
    shared: int  # CD collision: leading tokens it would share with a sibling's sample


def _matches(request_id: str, prefix: str) -> bool:
    return request_id == prefix or request_id.startswith(prefix + "/")


class SimBackend(GenerationBackend, RewardBackend):
    """The simulated engine and PRM (see the module docstring). Run it on a
    ``VirtualTimeLoop`` (``run_virtual``); on a normal loop it sleeps in real time."""

    score_range = (0.0, 1.0)

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.engine = SimEngine(self.config)
        self._requests: dict[str, list[SimSeq]] = {}
        self._prm_cache: OrderedDict[str, None] = OrderedDict()  # traces the PRM has seen
        self.counters: dict[str, float] = dict.fromkeys(
            ("generate_calls", "aborted", "score_calls", "generated_tokens", "peak_inflight"), 0
        )
        cfg = self.config
        self._capabilities = Capabilities(
            prefix_cache=True,
            engine_dedup=cfg.engine_dedup,
            saturation_batch=cfg.saturation_batch(),
            max_running_requests=cfg.max_running,
            reward_batch_tokens=cfg.reward_knee_tokens(),
            reward_batch_s=cfg.prm_time(cfg.reward_knee_tokens()),
            name=f"sim:{cfg.name}",
            extra={
                "decode_step_s_batch1": cfg.decode_step_time(1, cfg.typical_context_tokens),
                "kv_capacity_tokens": float(cfg.kv_capacity_tokens),
                "hbm_bandwidth": cfg.hbm_bandwidth,
                "peak_flops": cfg.peak_flops,
            },
        )

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    # -- workload model (pure functions of the text and the seeds) ------------------------
    def line_tokens(self, line: str) -> int:
        match = _STEP.search(line)
        if match:
            return int(match.group(1))
        if line.startswith(ANSWER_PREFIX):
            return self.config.answer_tokens
        return max(1, len(line) // 4)

    def prompt_tokens(self, question: str, steps: Sequence[str]) -> int:
        return self.config.question_tokens + sum(self.line_tokens(s) for s in steps)

    def quality(self, question: str, steps: Sequence[str]) -> float:
        """Latent quality of the branch ending with ``steps`` (its last sim step's ``q``)."""
        for line in reversed(steps):
            match = _STEP.search(line)
            if match:
                return float(match.group(2))
        return random.Random(stable_seed(self.config.seed, "root|" + question)).uniform(0.3, 0.8)

    def sample(self, request: GenerateRequest, index: int) -> _Sample:
        """Sample ``index`` of ``request``: a function of (seed, prompt, sampling seed, index);
        never of timing, mode, request ids or the engine switches."""
        cfg, sampling = self.config, request.sampling
        prompt = request.prompt if request.prompt is not None else repr(request.prompt_ids)
        question, *steps = prompt.split("\n")
        # The prompt and the sampling seed, not the request id: ids may be auto-assigned.
        key = f"greedy|{prompt}" if sampling.greedy else f"{prompt}|{sampling.seed}|{index}"
        rng = random.Random(stable_seed(cfg.seed, key))
        tokens = max(1, round(rng.lognormvariate(math.log(cfg.step_tokens_median),
                                                 cfg.step_tokens_sigma)))  # fmt: skip
        if rng.random() < cfg.straggler_rate:
            tokens = round(tokens * cfg.straggler_factor)
        finish = FinishReason.LENGTH if tokens > sampling.max_tokens else FinishReason.STOP
        tokens = min(tokens, sampling.max_tokens)
        depth = len(steps) + 1
        parent_q = self.quality(question, steps)
        hazard = depth >= cfg.answer_min_depth and rng.random() < cfg.answer_hazard
        if hazard or depth >= cfg.answer_max_depth:
            p_right = min(1.0, 0.15 + 0.8 * parent_q) * cfg.depth_decay ** (
                depth - cfg.answer_min_depth
            )
            wrong = [c for c in cfg.choices if c != cfg.correct] or [cfg.correct]
            choice = cfg.correct if rng.random() < p_right else rng.choice(wrong)
            text = ANSWER_PREFIX + choice
        else:
            q = min(0.99, max(0.01, parent_q + rng.gauss(0.0, cfg.quality_drift)))
            text = f"step {depth}.{rng.getrandbits(24):06x} [{tokens}t q={q:.3f}]"
        collide = rng.random() < cfg.collision_rate  # drawn last: the text never depends on it
        shared = 1 + int(rng.expovariate(1.0 / cfg.collision_mean_tokens)) if collide else 0
        return _Sample(text, tokens, finish, tokens if sampling.greedy else min(shared, tokens))

    def step_score(self, question: str, steps: Sequence[str]) -> float:
        """PRM score of the last of ``steps``: latent quality + noise, in [0, 1]."""
        cfg = self.config
        last = steps[-1] if steps else ""
        rng = random.Random(stable_seed(cfg.seed, "prm|" + question + "\n" + "\n".join(steps)))
        match = _STEP.search(last)
        if match:
            base = float(match.group(2))
        elif last.startswith(ANSWER_PREFIX):
            parent_q = self.quality(question, steps[:-1])
            right = last[len(ANSWER_PREFIX) :] == cfg.correct
            base = (0.35 if right else 0.2) + 0.6 * parent_q
        else:
            base = 0.5
        return min(1.0, max(0.0, base + rng.gauss(0.0, cfg.reward_noise)))

    def count_tokens(self, text: str) -> int:
        return sum(self.line_tokens(line) for line in text.split("\n"))

    def count_item_tokens(self, item: RewardItem) -> int:
        """What the PRM would compute for ``item`` now (its prefix cache left untouched)."""
        return self._prm_new_tokens(item, remember=False)

    # -- GenerationBackend ----------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.request_id in self._requests:
            raise BackendError("sim", f"duplicate request id {request.request_id!r}")
        cfg, sp = self.config, request.sampling
        samples = [self.sample(request, i) for i in range(request.n)]
        prompt = request.prompt if request.prompt is not None else repr(request.prompt_ids)
        question, *steps = prompt.split("\n")
        prompt_tokens = self.prompt_tokens(question, steps)
        prefixes = [(prompt, prompt_tokens)]
        if steps:  # the parent's prompt: cached when the grandparent finished
            prefixes.append(
                (prompt.rsplit("\n", 1)[0], prompt_tokens - self.line_tokens(steps[-1]))
            )
        group = f"{prompt}|{sp.temperature}|{sp.top_p}|{sp.top_k}|{sp.max_tokens}|{sp.stop}"
        loop = asyncio.get_running_loop()
        seqs = [
            SimSeq(
                request_id=request.request_id,
                priority=int(request.priority),
                prompt_key=prompt,
                prompt_tokens=prompt_tokens,
                target_tokens=s.tokens,
                done=loop.create_future(),
                group_key=group if cfg.engine_dedup and request.dedup else None,
                shared_tokens=s.shared if cfg.engine_dedup and request.dedup else 0,
                prefixes=tuple(prefixes),
                finish_key=f"{prompt}\n{s.text}",
            )
            for s in samples
        ]
        self._requests[request.request_id] = seqs
        self.counters["generate_calls"] += 1
        self.counters["peak_inflight"] = max(self.counters["peak_inflight"], len(self._requests))
        self.engine.submit(seqs)
        try:
            for seq in seqs:
                await seq.done
        except asyncio.CancelledError:
            for seq in seqs:  # a cancelled caller leaves nothing running
                self.engine.remove(seq)
            raise
        finally:
            if self._requests.get(request.request_id) is seqs:
                del self._requests[request.request_id]
        completions = []
        for s, seq in zip(samples, seqs, strict=True):
            aborted = seq.generated < s.tokens
            self.counters["generated_tokens"] += seq.generated
            completions.append(
                Completion(
                    text="" if aborted else s.text,
                    num_tokens=seq.generated,
                    finish_reason=FinishReason.ABORT if aborted else s.finish,
                )
            )
        return GenerateResult(request.request_id, tuple(completions), prompt_tokens=prompt_tokens)

    async def abort(self, prefix: str) -> int:
        hits = [rid for rid in self._requests if _matches(rid, prefix)]
        for rid in hits:
            for seq in self._requests.pop(rid):  # frees KV now; the caller resumes next tick
                self.engine.remove(seq)
        self.counters["aborted"] += len(hits)
        return len(hits)

    # -- RewardBackend --------------------------------------------------------------------
    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        self.counters["score_calls"] += 1
        scores = [
            tuple(self.step_score(it.question, it.steps[: i + 1]) for i in range(len(it.steps)))
            for it in items
        ]
        await self.engine.run_prm(sum(self._prm_new_tokens(it, remember=True) for it in items))
        return scores

    def _prm_new_tokens(self, item: RewardItem, *, remember: bool) -> int:
        """Input tokens the PRM computes: with its prefix cache, only the last step when the
        parent trace was scored before (siblings and children reuse it)."""
        total = self.prompt_tokens(item.question, item.steps)
        key = item.question + "\n" + "\n".join(item.steps)
        parent = key.rsplit("\n", 1)[0]
        hit = self.config.prm_prefix_cache and parent in self._prm_cache and item.steps
        if remember:
            self._prm_cache[key] = None
            if len(self._prm_cache) > 100_000:
                self._prm_cache.popitem(last=False)
        return self.line_tokens(item.steps[-1]) if hit else total

    def stats(self) -> dict[str, float]:
        st = {**self.engine.stats, **self.counters}
        steps = max(st["steps"], 1.0)
        st["busy_s"] = st["decode_busy_s"] + st["prm_busy_s"]
        st["mean_batch"] = st["physical_batch_sum"] / steps
        st["mean_logical_batch"] = st["logical_batch_sum"] / steps
        st["peak_kv_blocks"] = math.ceil(st["peak_kv_tokens"] / 16)  # 16-token pages
        st["kv_capacity_tokens"] = self.config.kv_capacity_tokens
        return st

    async def aclose(self) -> None:
        await self.engine.aclose()


def create_sim(preset: str = "a100-80gb-7b", seed: int = 0, **overrides: Any) -> SimBackend:
    """Registered as ``"sim"``: ``create_sim("h200-7b", seed=1, engine_dedup=True)``."""
    return SimBackend(SimConfig.preset(preset, seed=seed, **overrides))
