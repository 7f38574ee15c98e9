"""LLMEngine: add requests, abort by prefix, and ``step()`` = schedule -> run -> postprocess.

Not thread-safe: ``LocalBackend`` drives it from one worker thread. A step is one packed
forward over every scheduled row (decode rows and prompt chunks together, see
``scheduler.py``), one vectorised draw for every member, then per-row bookkeeping
(``postprocess.py``). With token speculation on (``tokenspec.py``), decode rows may carry
drafted tokens and verify them in the same forward pass.

Failures stay with the request that caused them. Requests are validated where they enter
(``validate.py``). If a forward still raises, every row of the step is run again alone: the
rows that fail alone fail their requests (``take_failures``), the rest run on as if nothing
happened (a failed step writes nothing any other row reads). A row whose bookkeeping raises
fails its own requests only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from spec_tot.drafting import Drafter
from spec_tot.requests import FinishReason, GenerateRequest, GenerateResult, StreamUpdate

from ..config import EngineConfig, resolve_device, resolve_dtype
from ..model.loader import LoadedModel, build_random_model, load_model_folder
from ..model.model import KVCache
from ..model.runner import ModelRunner
from ..stage_clock import StageClock
from .block_manager import BlockManager
from .detokenizer import StopChecker
from .drafter import HFDraftModel, NgramDrafter, load_drafter
from .intake import Intake
from .postprocess import LogitPlan, Postprocessor, plan_logits, record_prompt_logprobs
from .request_table import RequestTable
from .sampler import Sampler
from .scheduler import Scheduler, StepPlan
from .sequence import (
    ScheduledRow,
    Sequence,
    SequenceStatus,
    finish_member,
)
from .synthetic import PseudoTokenizer
from .tokenspec import SpecCounters, TokenSpeculator
from .validate import RequestValidator

__all__ = ["MAX_GRAPH_TOKENS", "LLMEngine"]

# The largest step (in tokens) replayed from a CUDA graph: 64 rows with a few drafted tokens
# each; larger steps are compute-bound and lose little by launching eagerly.
MAX_GRAPH_TOKENS = 512

_COUNTERS = (
    "num_steps",
    "num_prefill_steps",
    "num_decode_steps",
    "num_mixed_steps",
    "num_aborted_requests",
    "num_failed_requests",
    "num_computed_prompt_tokens",
    "num_forward_rows",
    "peak_kv_blocks_used",
    "step_seconds",
    "peak_running_seqs",
)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        if loaded is None:
            if config.model is not None:
                loaded = load_model_folder(config.model, self.device, dtype)
            else:
                loaded = build_random_model(
                    config.model_config or {}, self.device, dtype, config.seed
                )
        self.loaded = loaded
        args = loaded.args
        self.tokenizer: Any = loaded.tokenizer or PseudoTokenizer(args.vocab_size)
        eos = set(args.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(int(self.tokenizer.eos_token_id or 0))
        self.eos_ids = frozenset(eos)
        bs = config.block_size
        self.max_len = min(
            config.max_model_len, args.max_position_embeddings, config.num_kv_blocks * bs
        )
        self.validator = RequestValidator(
            self.tokenizer, args.vocab_size, self.max_len, config.max_num_seqs
        )
        self.block_manager = BlockManager(config.num_kv_blocks, bs, config.enable_prefix_caching)
        cache = KVCache.allocate(args, config.num_kv_blocks, bs, self.device, dtype)
        self.scheduler = Scheduler(config, self.block_manager)
        # where a step's time goes (stats(): stage_<name>_s); the runner laps inputs/forward
        self.clock = StageClock(
            "schedule", "draft", "inputs", "capture", "forward", "sample", "postprocess"
        )
        self.runner = ModelRunner(
            loaded.model,
            cache,
            self.device,
            config.attention,
            cuda_graphs=config.cuda_graphs,
            max_len=self.max_len,
            max_graph_tokens=min(config.max_num_batched_tokens, MAX_GRAPH_TOKENS),
            clock=self.clock,
        )
        self.sampler = Sampler(self.eos_ids)
        graphs = self.runner.graphs
        self.graph_capture_seconds = graphs.capture_all() if graphs is not None else 0.0
        self.requests = RequestTable(self.scheduler, self.block_manager)
        self.intake = Intake(config, self.validator, self.scheduler, self.requests)
        self._failures: list[tuple[str, BaseException]] = []
        self.post = Postprocessor(
            self.tokenizer,
            self.eos_ids,
            self.max_len,
            config.synthetic,
            self.block_manager,
            self.scheduler,
            self.requests,
            StopChecker(self.tokenizer, args.vocab_size),
        )
        self.speculator = self._speculator() if config.token_speculation else None
        # counters (names listed in _COUNTERS; exported by ``stats()``)
        self.num_steps = self.num_prefill_steps = self.num_decode_steps = 0
        self.num_mixed_steps = self.num_failed_requests = self.num_aborted_requests = 0
        self.num_computed_prompt_tokens = 0
        self.num_forward_rows = 0
        self.peak_kv_blocks_used = self.peak_running_seqs = 0
        self.step_seconds = 0.0  # wall time inside step(): scheduling, forward, sampling

    def _speculator(self) -> TokenSpeculator:
        cfg = self.config
        drafters: list[Drafter] = []
        if cfg.drafter is not None:
            drafters.append(load_drafter(cfg.drafter, self.tokenizer))
        if cfg.draft_model is not None:
            drafters.append(HFDraftModel(cfg.draft_model, self.device))
        if cfg.ngram_max:
            drafters.append(NgramDrafter(cfg.ngram_max, cfg.ngram_min))
        limit = cfg.max_draft_tokens
        return TokenSpeculator(
            drafters, self.block_manager, max_draft_tokens=limit, max_len=self.max_len
        )

    @contextlib.contextmanager
    def plain_decoding(self) -> Iterator[None]:
        """No token speculation inside (start-up calibration measures plain decode steps)."""
        spec, self.speculator = self.speculator, None
        try:
            yield
        finally:
            self.speculator = spec

    def use_step_costs(self, curve: dict[int, float]) -> None:
        """The calibrated step-cost curve (decode batch -> seconds): token speculation's prior
        for what a verified token costs."""
        if self.speculator is not None and curve:
            self.speculator.cost.set_curve(curve)

    # -- requests ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def add_request(self, request: GenerateRequest, stream: bool = False) -> None:
        """Accept ``request`` (``ConfigError`` naming the field if it cannot run here);
        ``stream``: emit a ``StreamUpdate`` per token (``take_stream_updates``)."""
        self.intake.add(request, stream)

    def abort(self, prefix: str) -> list[GenerateResult]:
        """Abort requests whose id is ``prefix`` or starts with ``prefix + "/"``; their blocks
        are freed now. Returns their (partial) results."""
        ids = self.requests.under(prefix)
        return self._abort_ids(ids)

    def abort_all(self) -> list[GenerateResult]:
        return self._abort_ids(set(self.requests))

    def abort_request(self, request_id: str) -> list[GenerateResult]:
        return self._abort_ids(self.requests.present([request_id]))

    def _abort_ids(self, ids: set[str]) -> list[GenerateResult]:
        if not ids:
            return []
        seqs = [*self.scheduler.running, *(s for q in self.scheduler.waiting.values() for s in q)]
        for seq in seqs:
            gone = [m for m in seq.members if m.request.request_id in ids]
            if not gone:
                continue
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            for member in gone:
                finish_member(member, text, seq, FinishReason.ABORT)
            seq.members = [m for m in seq.members if m.request.request_id not in ids]
            if not seq.members:
                self.requests.release(seq, SequenceStatus.ABORTED)
        self.num_aborted_requests += len(ids)
        return [self.requests.pop(rid).result() for rid in sorted(ids)]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def take_failures(self) -> list[tuple[str, BaseException]]:
        """Requests that failed inside a step since the last call, with the cause."""
        failures, self._failures = self._failures, []
        return failures

    def take_stream_updates(self) -> list[StreamUpdate]:
        return self.post.take_stream_updates()

    # -- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[GenerateResult]:
        """One engine iteration; returns the requests that finished in it."""
        started = time.perf_counter()
        clock = self.clock
        clock.start()
        spec = self.speculator
        if spec is not None:
            spec.begin()
        plan = self.scheduler.schedule()
        if not plan.rows:
            return []
        clock.lap("schedule")
        if spec is not None:
            spec.extend(plan, self._draft_budget(plan))
            clock.lap("draft")
        for row in plan.rows:  # the blocks filled in this step (a draft's only once kept)
            self.block_manager.publish(row.seq, row.start + 1 if row.draft else row.end)
        cow = self.block_manager.take_cow_pairs()
        logit_plan = plan_logits(plan)
        clock.lap("schedule")
        try:
            logits = self.runner.run(plan.rows, plan.num_decode, logit_plan.tokens, cow)
        except Exception:
            plan = self._isolate(plan, cow)
            logit_plan = plan_logits(plan)
            logits = self.runner.run(plan.rows, plan.num_decode, logit_plan.tokens, cow)
        finished = self._postprocess(plan, logit_plan, logits)
        clock.lap("postprocess")
        if spec is not None:
            spec.end()
            clock.lap("draft")
        self.step_seconds += time.perf_counter() - started
        return finished

    def _draft_budget(self, plan: StepPlan) -> int:
        """Tokens drafts may add to ``plan``. A step that replays from a CUDA graph stays
        within the largest graph: past it the step runs eagerly, a cliff in its cost (on
        an H200 the engine alone's steps took 3.3x as long eagerly as replayed,
        ``benchmarks/results/h200/cuda_graphs.json``) that the speculator's step-cost curve,
        measured on plain decode steps, does not show."""
        budget = self.config.max_num_batched_tokens - plan.num_tokens
        limit = self.runner.graph_token_limit
        if limit is not None and plan.num_tokens <= limit:
            budget = min(budget, limit - plan.num_tokens)
        return budget

    def _isolate(self, plan: StepPlan, cow: list[tuple[int, int]]) -> StepPlan:
        """The step's forward raised: run each row alone; fail the requests of the rows that
        still fail, and return the plan without them."""
        bad: list[tuple[ScheduledRow, BaseException]] = []
        for i, row in enumerate(plan.rows):
            try:
                self.runner.run([row], 1 if i < plan.num_decode else 0, [row.num_tokens - 1], cow)
            except Exception as exc:
                bad.append((row, exc))
        if not bad:
            raise RuntimeError("the step failed as a whole but every row runs alone")
        for row, error in bad:
            self.block_manager.forget(row.seq, row.start)
            self._fail(row.seq, error)
        keep = [i for i, row in enumerate(plan.rows) if row.seq.status == SequenceStatus.RUNNING]
        num_decode = sum(1 for i in keep if i < plan.num_decode)
        return StepPlan([plan.rows[i] for i in keep], num_decode)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """Fail every request with a member in ``seq`` (its content caused ``exc``)."""
        ids = self.requests.present(m.request.request_id for m in seq.members)
        self._failures.extend((rid, exc) for rid in sorted(ids))
        self.num_failed_requests += len(ids)
        self._abort_ids(ids)
        self.num_aborted_requests -= len(ids)

    def _postprocess(
        self, plan: StepPlan, logit_plan: LogitPlan, logits: torch.Tensor
    ) -> list[GenerateResult]:
        bm = self.block_manager
        self.num_steps += 1
        decode_only = plan.num_decode == len(plan.rows)
        self.num_decode_steps += decode_only
        self.num_prefill_steps += plan.num_decode == 0
        self.num_mixed_steps += not decode_only and plan.num_decode > 0
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, bm.num_used_blocks)
        self.peak_running_seqs = max(self.peak_running_seqs, len(self.scheduler.running))
        for row in plan.rows[: plan.num_decode]:
            if not row.draft:  # a verify row's count is settled once its drafts are judged
                row.seq.num_computed_tokens += 1
        for row in plan.rows[plan.num_decode :]:
            seq = row.seq
            self.num_computed_prompt_tokens += row.num_tokens
            for m in seq.members:
                req = m.request
                req.cached_prompt_tokens = max(req.cached_prompt_tokens, seq.num_cached_tokens)
            seq.num_computed_tokens = row.end
        finished: list[GenerateResult] = []
        n = logit_plan.num_sample_rows
        if logit_plan.prompt:
            try:
                record_prompt_logprobs(logit_plan.prompt, logits[n:])
            except Exception as exc:  # only the sequences that asked for them fail
                for seq in {id(s): s for s, _ in logit_plan.prompt}.values():
                    self._fail(seq, exc)
        for seq in logit_plan.finish_empty:
            self.post.finish(seq, seq.members, FinishReason.LENGTH, "", None, finished)
            self.requests.release(seq, SequenceStatus.FINISHED)
        if not n:
            return finished
        draws = self._sample(logits[:n], logit_plan)
        self.clock.lap("sample")
        spec, pos = self.speculator, 0
        for i, row in enumerate(logit_plan.rows):
            width = 1 + len(row.draft)
            block, pos = draws[pos : pos + width], pos + width
            if row.seq.status != SequenceStatus.RUNNING or None in block:
                continue
            try:
                accepted, emitted = self.post.take(row, block, finished)
            except Exception as exc:  # this row's bookkeeping: its requests fail, no one else
                self._fail(row.seq, exc)
                continue
            self.num_forward_rows += emitted
            if spec is not None and i < logit_plan.num_decode:
                spec.record(row, accepted, emitted)
        return finished

    def _sample(
        self, logits: torch.Tensor, logit_plan: LogitPlan
    ) -> list[tuple[list[int], Any] | None]:
        """One draw for the whole batch (a verify row draws at each of its positions); if
        that raises, row by row (the sequences of rows that still raise fail)."""
        seqs, offsets = logit_plan.sample_seqs(), logit_plan.offsets()
        try:
            tokens, logprobs = self.sampler.sample(logits, seqs, offsets)
            return list(zip(tokens, logprobs, strict=True))
        except Exception:
            out: list[tuple[list[int], Any] | None] = []
            for i, seq in enumerate(seqs):
                try:
                    rows = logits[i : i + 1].clone()
                    (toks,), (lps,) = self.sampler.sample(rows, [seq], [offsets[i]])
                    out.append((toks, lps))
                except Exception as exc:
                    out.append(None)
                    if seq.status == SequenceStatus.RUNNING:
                        self._fail(seq, exc)
            return out

    # -- counters ---------------------------------------------------------------------------
    @property
    def num_generated_tokens(self) -> int:
        return self.post.num_generated_tokens

    @property
    def num_forks(self) -> int:
        return self.post.num_forks

    def reset_counters(self) -> None:
        """Zero every counter (after start-up calibration: its steps are not the caller's)."""
        for name in _COUNTERS:
            setattr(self, name, type(getattr(self, name))(0))
        self.post.num_generated_tokens = self.post.num_forks = 0
        self.intake.num_requests = self.intake.num_merged_requests = 0
        self.intake.num_prompt_tokens = 0
        self.block_manager.num_prefix_hit_blocks = self.block_manager.num_cow_copies = 0
        self.scheduler.num_preemptions = 0
        if self.speculator is not None:
            self.speculator.reset_counters()
        if self.runner.graphs is not None:
            self.runner.graphs.reset_counters()
        self.clock.reset()
        self.runner.gpu.reset()

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        out = {name: float(getattr(self, name)) for name in _COUNTERS}
        out.update(
            num_requests=float(self.intake.num_requests),
            num_merged_requests=float(self.intake.num_merged_requests),
            num_prompt_tokens=float(self.intake.num_prompt_tokens),
            num_generated_tokens=float(self.num_generated_tokens),
            num_forks=float(self.num_forks),
            peak_kv_blocks=float(self.peak_kv_blocks_used),
            num_total_blocks=float(bm.num_total_blocks),
            num_free_blocks=float(bm.num_free_blocks),
            num_prefix_hit_blocks=float(bm.num_prefix_hit_blocks),
            num_cached_prompt_tokens=float(bm.num_prefix_hit_blocks * bm.block_size),
            num_cow_copies=float(bm.num_cow_copies),
            num_preemptions=float(self.scheduler.num_preemptions),
            num_running=float(len(self.scheduler.running)),
            num_waiting=float(self.scheduler.num_waiting),
            num_dedup_saved_tokens=float(self.num_generated_tokens - self.num_forward_rows),
        )
        out.update(self.clock.as_stats("stage_"))
        out["stage_gpu_forward_s"] = self.runner.gpu.seconds
        graphs = self.runner.graphs
        if graphs is not None:
            g = graphs.stats()
            out.update(
                num_graph_steps=float(g.graph_steps),
                num_eager_steps=float(g.eager_steps),
                num_graphs_captured=float(g.graphs_captured),
                num_graph_padded_tokens=float(g.padded_tokens),
                graph_capture_s=self.graph_capture_seconds,
            )
        out.update(
            self.speculator.counters.as_stats() if self.speculator else SpecCounters().as_stats()
        )
        return out
