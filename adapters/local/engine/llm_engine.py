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
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from spec_tot.drafting import Drafter
from spec_tot.requests import FinishReason, GenerateRequest, GenerateResult, StreamUpdate

from ..config import EngineConfig, resolve_device, resolve_dtype
from ..model.loader import LoadedModel, build_random_model, cpu_auto_dtype, load_model_folder
from ..model.model import KVCache
from ..model.runner import ModelRunner
from ..stage_clock import StageClock
from .block_manager import BlockManager
from .detokenizer import StopChecker
from .drafter import HFDraftModel, NgramDrafter, load_drafter
from .engine_stats import StepCounters, engine_stats, reset_engine_counters
from .intake import Intake
from .postprocess import LogitPlan, Postprocessor, plan_logits, record_prompt_logprobs
from .request_table import RequestTable
from .sampler import Sampler
from .scheduler import Scheduler, StepPlan
from .sequence import (
    ScheduledRow,
    Sequence,
    SequenceStatus,
)
from .synthetic import PseudoTokenizer
from .tokenspec import TokenSpeculator
from .validate import RequestValidator

__all__ = ["MAX_GRAPH_TOKENS", "LLMEngine"]

# The largest step (in tokens) replayed from a CUDA graph: 64 rows with a few drafted tokens
# each; larger steps are compute-bound and lose little by launching eagerly.
MAX_GRAPH_TOKENS = 512


def _load(config: EngineConfig, device: str, loaded: LoadedModel | None) -> tuple[LoadedModel, Any]:
    """The model (``loaded`` when given) and the float type the engine runs."""
    dtype = resolve_dtype(config.dtype, device)
    if loaded is None and config.model is not None and config.dtype == "auto" and device == "cpu":
        dtype = cpu_auto_dtype(config.model, config.weights)
    if loaded is None:
        if config.model is not None:
            loaded = load_model_folder(config.model, device, dtype, weights=config.weights)
        else:
            loaded = build_random_model(config.model_config or {}, device, dtype, config.seed)
    return loaded, dtype


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        # what runs: "auto" resolved (the step-time calibration is keyed by it)
        loaded, self.dtype = _load(config, self.device, loaded)
        dtype = self.dtype
        self.loaded = loaded
        args = loaded.args
        self.tokenizer: Any = loaded.tokenizer or PseudoTokenizer(args.vocab_size)
        self.eos_ids = _eos_ids(args.eos_token_ids, self.tokenizer)
        bs, kv = config.block_size, config.num_kv_blocks
        self.max_len = min(config.max_model_len, args.max_position_embeddings, kv * bs)
        self.validator = RequestValidator(
            self.tokenizer, args.vocab_size, self.max_len, config.max_num_seqs
        )
        self.block_manager = BlockManager(kv, bs, config.enable_prefix_caching)
        cache = KVCache.allocate(args, kv, bs, self.device, dtype)
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
        self.speculator = (
            _token_speculator(config, self.tokenizer, self.block_manager, self.device, self.max_len)
            if config.token_speculation
            else None
        )
        self.counters = StepCounters()  # exported by ``stats()``

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

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes and the drafters' history, only while idle (a run after
        it computes what a cold engine would). Returns whether it did."""
        done = self.block_manager.reset_prefix_cache()
        if done and self.speculator is not None:
            self.speculator.forget()
        return done

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
        self.counters.num_aborted_requests += len(ids)
        return self.requests.abort(ids, self._decode)

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

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
            spec.extend(plan, draft_budget(plan, self.config, self.runner.graph_token_limit))
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
        self.counters.step_seconds += time.perf_counter() - started
        return finished

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
        self.counters.num_failed_requests += len(ids)
        self._abort_ids(ids)
        self.counters.num_aborted_requests -= len(ids)

    def _postprocess(
        self, plan: StepPlan, logit_plan: LogitPlan, logits: torch.Tensor
    ) -> list[GenerateResult]:
        running = len(self.scheduler.running)
        self.counters.record_step(
            len(plan.rows), plan.num_decode, self.block_manager.num_used_blocks, running
        )
        for row in plan.rows[: plan.num_decode]:
            if not row.draft:  # a verify row's count is settled once its drafts are judged
                row.seq.num_computed_tokens += 1
        for row in plan.rows[plan.num_decode :]:
            seq = row.seq
            self.counters.num_computed_prompt_tokens += row.num_tokens
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
        draws = self.sampler.sample_or_isolate(
            logits[:n], logit_plan.sample_seqs(), logit_plan.offsets(), self._fail
        )
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
            self.counters.num_forward_rows += emitted
            if spec is not None and i < logit_plan.num_decode:
                spec.record(row, accepted, emitted)
        return finished

    # -- counters ---------------------------------------------------------------------------
    @property
    def num_generated_tokens(self) -> int:
        return self.post.num_generated_tokens

    @property
    def num_forks(self) -> int:
        return self.post.num_forks

    def reset_counters(self) -> None:
        """Zero every counter (after start-up calibration: its steps are not the caller's)."""
        reset_engine_counters(self)

    def stats(self) -> dict[str, float]:
        return engine_stats(self)


def _token_speculator(
    cfg: EngineConfig, tokenizer: Any, blocks: BlockManager, device: str, max_len: int
) -> TokenSpeculator:
    drafters: list[Drafter] = []
    if cfg.drafter is not None:
        drafters.append(load_drafter(cfg.drafter, tokenizer))
    if cfg.draft_model is not None:
        drafters.append(HFDraftModel(cfg.draft_model, device))
    if cfg.ngram_max:
        drafters.append(NgramDrafter(cfg.ngram_max, cfg.ngram_min))
    return TokenSpeculator(drafters, blocks, max_draft_tokens=cfg.max_draft_tokens, max_len=max_len)


def draft_budget(plan: StepPlan, cfg: EngineConfig, graph_limit: int | None) -> int:
    """Tokens drafts may add to ``plan``. A step that replays from a CUDA graph stays
    within the largest graph: past it the step runs eagerly, a cliff in its cost (on
    an H200 the engine alone's steps took 3.3x as long eagerly as replayed,
    ``benchmarks/results/h200/cuda_graphs.json``) that the speculator's step-cost curve,
    measured on plain decode steps, does not show."""
    budget = cfg.max_num_batched_tokens - plan.num_tokens
    if graph_limit is not None and plan.num_tokens <= graph_limit:
        budget = min(budget, graph_limit - plan.num_tokens)
    return budget


def _eos_ids(model_eos: Iterable[int], tokenizer: Any) -> frozenset[int]:
    """The model's end-of-sequence ids and its tokenizer's."""
    eos = set(model_eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id or 0))
    return frozenset(eos)
