"""EngineCore: the engine side of ``LocalBackend``'s boundary.

It owns the ``LLMEngine`` (scheduler, model runner, block manager, sampler) and the
``PrmScorer``, takes typed commands (``messages.py``), steps the engine and emits typed
outputs through one callable. The same class runs in a child process (``core_process.py``,
the default) or on a worker thread of the caller's process (``proc.ThreadLink``): only the
transport differs. The engine is not thread-safe, so one loop (``run``) owns it; PRM
scoring runs on one thread of its own beside it, so neither kind of work waits for the
other.

A request that fails inside a step fails alone (``LLMEngine.take_failures``); only a step
that fails as a whole, with no row to blame, fails every request in flight; an exception
while handling a command answers that command. Outputs are batched per step: one
``StepBatch`` carries every result, stream update and failure of the step with the counters
after it, and steps that produced none send only a counters heartbeat (at most one per
``STATS_INTERVAL_S``).
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, assert_never

from spec_tot.errors import BackendError, ConfigError
from spec_tot.plugins import load_target
from spec_tot.progress import timed_step

from ..engine.calibrate import CalibrationCache, calibrate_engine, calibrate_prm
from ..stage_clock import StageClock
from .heap import HeapTrimmer
from .messages import (
    PROTOCOL,
    Abort,
    Add,
    Cancel,
    Classify,
    Command,
    Done,
    ErrorInfo,
    Failed,
    Flush,
    FlushPrefixCache,
    Inspect,
    Ping,
    PolicyInfo,
    Pong,
    PoolReport,
    Ready,
    RewardInfo,
    Rewards,
    Score,
    Scores,
    Start,
    StepBatch,
    Stop,
)

__all__ = ["STATS_INTERVAL_S", "EngineCore", "Inbox"]

STATS_INTERVAL_S = 0.01
Emit = Callable[[Any], None]


class Inbox(ABC):
    """Where a core's commands come from."""

    @abstractmethod
    def take(self, timeout: float | None) -> list[Any] | None:
        """The commands waiting, after waiting up to ``timeout`` seconds for one (``None``:
        as long as it takes; 0: not at all); ``[]`` if none came; None once the other side
        is gone."""


class EngineCore:
    def __init__(self, start: Start, emit: Emit) -> None:
        import torch

        from ..engine.llm_engine import LLMEngine
        from ..engine.prm import PrmScorer

        if start.protocol != PROTOCOL:
            raise ConfigError("protocol", f"core speaks {PROTOCOL}, the backend {start.protocol}")
        if start.threads is not None:
            torch.set_num_threads(start.threads)
        self.threads = torch.get_num_threads()
        self._emit = emit
        self.engine = _load_engine(LLMEngine, start.engine)
        self.prm = None
        self.reward_info: RewardInfo | None = None
        if start.prm is not None:
            from ..config import resolve_device, resolve_dtype

            cfg, device = start.prm, resolve_device(start.prm.device)
            dtype = resolve_dtype(cfg.dtype, device)
            self.prm = PrmScorer(cfg.path, device, dtype, cfg.num_kv_blocks, cfg.block_size)
            self.reward_info = _reward_info(self.prm)
        cache = CalibrationCache(start.cache_dir)
        self.saturation, self.step_curve = (0, {})
        if self.engine is not None:
            self.saturation, self.step_curve = calibrate_engine(self.engine, cache)
        self.reward_knee = None
        if self.prm is not None and self.reward_info is not None:
            self.reward_knee = calibrate_prm(self.prm, cache, self.reward_info.item_tokens)
        self._tickets: dict[str, int] = {}
        self.received = 0  # the last request ticket read (``StepBatch.received``)
        self._prm_pool = ThreadPoolExecutor(1, thread_name_prefix="spec-tot-prm")
        self._last_stats = 0.0
        # the loop's own time beside the engine's steps: commands handled, outputs sent; a
        # score's wait for the PRM thread and its reply (that thread's own clock)
        self.clock = StageClock("commands", "emit")
        self._prm_clock = StageClock("queue", "reply")
        self.heap = HeapTrimmer()
        if start.hook:
            load_target(start.hook)(self)

    # -- what the backend learns at start ---------------------------------------------------
    def ready(self) -> Ready:
        policy = None
        if self.engine is not None:
            cfg = self.engine.config
            policy = PolicyInfo(
                model=cfg.model,
                vocab_size=int(self.engine.loaded.args.vocab_size),
                max_len=int(self.engine.max_len),
                max_prompt_chars=int(self.engine.validator.max_chars),
                max_num_seqs=cfg.max_num_seqs,
                num_kv_blocks=cfg.num_kv_blocks,
                block_size=cfg.block_size,
                eos_token_ids=tuple(sorted(self.engine.eos_ids)),
            )
        return Ready(
            protocol=PROTOCOL,
            pid=os.getpid(),
            threads=self.threads,
            policy=policy,
            reward=self.reward_info,
            saturation_batch=self.saturation,
            step_curve=self.step_curve,
            reward_knee=self.reward_knee,
            stats=self._stats(),
        )

    # -- the loop ---------------------------------------------------------------------------
    def run(self, inbox: Inbox) -> None:
        """Handle commands and step until ``Stop`` or until the inbox closes; then every
        request still in flight fails with "backend closed"."""
        running = True
        while running:
            idle = not self.has_work()
            self.heap.maybe_trim(idle=idle)
            # idle: wake for a trim still due (the last work before a long wait is given back)
            commands = inbox.take(self.heap.due_in() if idle else 0.0)
            if commands is None:
                break
            self.clock.start()
            _encode_ahead(self.engine, commands)
            for command in commands:
                running = self.handle(command) and running
            self.clock.lap("commands")
            if running and self.has_work():
                self.step()
                self.heap.worked()
        self.close(BackendError("local", "backend closed"))

    def has_work(self) -> bool:
        return self.engine is not None and self.engine.has_unfinished()

    def handle(self, command: Command) -> bool:
        """Carry out one command; False for ``Stop``."""
        if isinstance(command, Stop):
            return False
        try:
            self._handle(command)
        except Exception as exc:  # keep the loop alive; the caller gets the error
            match command:
                case Add(ticket=ticket):  # a ConfigError naming the field, to this caller only
                    self._emit(StepBatch([], [], [(ticket, ErrorInfo.of(exc))], {}, ticket))
                case Cancel() | Start():
                    pass  # nobody waits for a reply
                case _:
                    self._emit(Failed(command.call, ErrorInfo.of(exc)))
        return True

    def _handle(self, command: Command) -> None:
        """One command, dispatched by its type (``messages.Command``, a closed union)."""
        match command:
            case Score() | Classify():
                self._score(command)
            case Ping(call=call):
                self._emit(Pong(call, os.getpid()))
            case Inspect(call=call):
                # Scores run on their own thread: wait for those sent earlier (FIFO, one
                # worker), or the report would count a running score's blocks as left behind.
                self._prm_pool.submit(lambda: None).result()
                self._emit(Pong(call, os.getpid(), self.pool_report()))
            case Start() | Stop():
                raise BackendError("local", f"{type(command).__name__} is not a step command")
            case FlushPrefixCache(call=call):
                self._emit(Done(call, self._flush_caches()))
            case Add() | Cancel() | Abort() | Flush():
                self._engine_command(command)
            case _:
                assert_never(command)

    def _flush_caches(self) -> bool:
        """Every content cache of this core, only while idle: the engine's prefix cache and
        its drafters' history, the PRM's scores and prefixes (on its scoring thread, after
        the scores sent before). Whether all of them were flushed."""
        done = True
        if self.engine is not None:
            done = not self.engine.has_unfinished() and self.engine.reset_prefix_cache()
        if self.prm is not None:
            done = self._prm_pool.submit(self.prm.flush).result() and done
        return done

    def _engine_command(self, command: Add | Cancel | Abort | Flush) -> None:
        engine = self.engine
        if engine is None:
            raise BackendError("local", "no policy engine (built with a PRM only)")
        match command:
            case Add(ticket=ticket, request=request, stream=stream):
                engine.add_request(request, stream=stream)
                self._tickets[request.request_id] = self.received = ticket
            case Cancel(request_id=request_id):
                engine.abort_request(request_id)
                self._tickets.pop(request_id, None)
            case Abort(call=call, prefix=prefix):
                results = engine.abort(prefix)
                tickets = self._tickets
                done = [(tickets.pop(r.request_id), r) for r in results if r.request_id in tickets]
                self._emit(StepBatch(done, [], [], self._stats(), self.received))
                self._emit(Done(call, len(results)))
            case Flush(call=call):
                self._emit(Done(call, None, self._stats()))

    def step(self) -> None:
        """One engine step, and its outputs as one batch."""
        engine = self.engine
        assert engine is not None  # internal: has_work() said so
        failures: list[tuple[int, ErrorInfo]] = []
        try:
            results = engine.step()
        except Exception as exc:  # no row to blame: fail every request in flight
            error = ErrorInfo.of(BackendError("local", f"engine step failed: {exc!r}"))
            failures = [(t, error) for t in self._tickets.values()]
            self._tickets.clear()
            engine.abort_all()
            results = []
        tickets = self._tickets
        updates = [
            (tickets[u.request_id], u)
            for u in engine.take_stream_updates()
            if u.request_id in tickets
        ]
        for rid, error in engine.take_failures():
            if rid in tickets:
                info = ErrorInfo.of(BackendError("local", f"request {rid!r}: {error!r}"))
                failures.append((tickets.pop(rid), info))
        done = [(tickets.pop(r.request_id), r) for r in results if r.request_id in tickets]
        now = time.monotonic()
        if done or updates or failures or now - self._last_stats >= STATS_INTERVAL_S:
            self._last_stats = now
            self.clock.start()
            self._emit(StepBatch(done, updates, failures, self._stats(), self.received))
            self.clock.lap("emit")

    def close(self, error: BaseException) -> None:
        """Fail everything in flight with ``error`` and free the engine's blocks."""
        if self.engine is not None:
            self.engine.abort_all()
            self.engine.take_stream_updates()
        info = ErrorInfo.of(error)
        if self._tickets:
            self._emit(StepBatch([], [], [(t, info) for t in self._tickets.values()], {}))
        self._tickets.clear()
        self._prm_pool.shutdown(wait=True)

    # -- reward scoring (its own thread) ----------------------------------------------------
    def _score(self, command: Score | Classify) -> None:
        prm = self.prm
        if prm is None:
            raise BackendError("local", "no PRM loaded (pass prm_path)")
        submitted = time.perf_counter()

        def call() -> Any:
            self._prm_clock.add("queue", time.perf_counter() - submitted)
            if isinstance(command, Score):
                return prm.score(command.items)
            return prm.classify(command.texts)

        future = self._prm_pool.submit(call)
        self.heap.worked()
        future.add_done_callback(lambda f: self._scored(command, f))

    def _scored(self, command: Score | Classify, future: Future[Any]) -> None:
        clock = self._prm_clock
        clock.start()
        error = future.exception()
        if error is not None:
            self._emit(Failed(command.call, ErrorInfo.of(error)))
        elif isinstance(command, Score):
            self._emit(Scores(command.call, future.result(), self._reward_stats()))
        else:
            self._emit(Rewards(command.call, future.result(), self._reward_stats()))
        clock.lap("reply")

    # -- counters and accounting ------------------------------------------------------------
    def _stats(self) -> dict[str, float]:
        out = self.engine.stats() if self.engine is not None else {}
        out.update(self.clock.as_stats("core_"))
        if self.prm is not None:
            out.update(self._reward_stats())
        return out

    def _reward_stats(self) -> dict[str, float]:
        """The PRM's per-stage seconds and calls, with this loop's queue/reply times."""
        assert self.prm is not None  # internal: only asked with a PRM
        return {**self.prm.stats(), **self._prm_clock.as_stats("prm_")}

    def pool_report(self) -> PoolReport:
        """Where every KV block is (tests and debugging: nothing may be left behind)."""
        return pool_report(self.engine, self.prm)


def _reward_info(prm: Any) -> RewardInfo:
    return RewardInfo(
        folder=str(prm.folder),
        step_tag=prm.step_tag,
        tag_ids=tuple(prm.tag_ids),
        vocab_size=int(prm.loaded.args.vocab_size),
        max_len=int(prm.max_len),
        max_chars=int(prm.max_chars),
        tokens_per_char=float(prm.tokens_per_char),
    )


def pool_report(engine: Any, prm: Any) -> PoolReport:
    """Where every KV block of ``engine`` and ``prm`` is (None: not loaded)."""
    prm_free = prm_total = -1
    if prm is not None:
        prm_free = prm.block_manager.num_free_blocks
        prm_total = prm.block_manager.num_total_blocks
    if engine is None:
        return PoolReport(0, 0, 0, 0, 0, 0, prm_free, prm_total)
    bm = engine.block_manager
    return PoolReport(
        free_blocks=bm.num_free_blocks,
        total_blocks=bm.num_total_blocks,
        referenced_blocks=sum(1 for b in bm.blocks if b.ref_count),
        running=len(engine.scheduler.running),
        waiting=engine.scheduler.num_waiting,
        requests=len(engine.requests),
        prm_free_blocks=prm_free,
        prm_total_blocks=prm_total,
    )


def _encode_ahead(engine: Any, commands: list[Any]) -> None:
    """The text prompts of a batch of ``Add`` commands, tokenized in one call."""
    texts = [c.request.prompt for c in commands if isinstance(c, Add) and c.request.prompt]
    if engine is not None and len(texts) > 1:
        engine.validator.encode_ahead(texts)


def _load_engine(engine_class: Any, config: Any) -> Any:
    """The policy engine of ``config`` (None without one), its load shown as progress."""
    if config is None:
        return None
    with timed_step(f"loading the model {config.model or '(random weights)'}"):
        return engine_class(config)
