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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spec_tot.adapters._sim_config import PRESETS, SimConfig
from spec_tot.adapters._sim_loop import SimEngine, SimSeq, VirtualTimeLoop, run_virtual
from spec_tot.backends import GenerationBackend, RewardBackend, matches_prefix
from spec_tot.errors import BackendError
from spec_tot.requests import (
    Capabilities,
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RewardItem,
)
from spec_tot.seeds import stable_seed

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


# -- workload and backend -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Sample:
    text: str
    tokens: int
    finish: FinishReason
    shared: int  # CD collision: leading tokens it would share with a sibling's sample


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
        hits = [rid for rid in self._requests if matches_prefix(rid, prefix)]
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
