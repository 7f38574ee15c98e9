"""LocalBackend: the engine behind the async backend contracts.

The engine is not thread-safe, so exactly one worker thread owns it: the event loop only
puts commands on a queue (add, abort, flush, stop) and awaits futures that the worker
resolves through ``loop.call_soon_threadsafe``. The worker drains commands between steps, so
an abort frees its KV blocks before the next step. PRM scoring runs on its own single
thread (one batched forward), so neither kind of work ever blocks the event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spec_tot.backends import GenerationBackend, RewardBackend
from spec_tot.errors import BackendError, ConfigError
from spec_tot.requests import Capabilities, GenerateRequest, GenerateResult, RewardItem

from .engine import LLMEngine
from .prm import PrmScorer, build_prm_text

__all__ = ["LocalBackend"]

_Command = tuple[str, Any, "asyncio.AbstractEventLoop | None", "asyncio.Future[Any] | None"]


def _resolve(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if fut.done():  # cancelled by its caller meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class LocalBackend(GenerationBackend, RewardBackend):
    def __init__(self, engine: LLMEngine | None, prm: PrmScorer | None = None) -> None:
        if engine is None and prm is None:
            raise ConfigError("policy_path", "give a policy model, a PRM, or both")
        self.engine = engine
        self.prm = prm
        self._inflight: dict[str, asyncio.Future[GenerateResult]] = {}
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._stats: dict[str, float] = engine.stats() if engine else {}
        self._closed = False
        self._saturation = 0
        if engine is not None:
            configured = engine.config.saturation_batch
            self._saturation = configured or measure_saturation_batch(engine)
        self._prm_pool = ThreadPoolExecutor(1, thread_name_prefix="spec-tot-prm") if prm else None
        self._reward_knee = measure_reward_knee(prm) if prm is not None else None
        self._prm_tokens_per_char = _tokens_per_char(prm) if prm is not None else 0.25
        self._thread = threading.Thread(target=self._worker, name="spec-tot-engine", daemon=True)
        if engine is not None:
            self._thread.start()

    # -- contract ---------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        cfg = self.engine.config if self.engine else None
        return Capabilities(
            abort=True,
            prefix_abort=True,
            prefix_cache=True,
            engine_dedup=True,
            saturation_batch=max(1, self._saturation),
            max_running_requests=cfg.max_num_seqs if cfg else 1,
            reward_batch_tokens=self._reward_knee[0] if self._reward_knee else None,
            reward_batch_s=self._reward_knee[1] if self._reward_knee else None,
            name="local",
            extra={
                "num_kv_blocks": float(cfg.num_kv_blocks if cfg else 0),
                "block_size": float(cfg.block_size if cfg else 0),
            },
        )

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.engine is None or self._closed:
            raise BackendError("local", "no policy engine (closed, or built with a PRM only)")
        if request.request_id in self._inflight:
            raise ConfigError("request_id", f"{request.request_id!r} is already in flight")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerateResult] = loop.create_future()
        self._inflight[request.request_id] = fut
        self._commands.put(("add", request, loop, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            # a cancelled caller leaves nothing behind: abort exactly this id in the engine
            self._commands.put(("abort_exact", request.request_id, None, None))
            raise
        finally:
            self._inflight.pop(request.request_id, None)

    async def abort(self, prefix: str) -> int:
        if self.engine is None or self._closed:
            return 0
        return int(await self._call("abort", prefix))

    async def flush(self) -> None:
        """Wait until the worker has handled every command sent before this call."""
        if self.engine is not None and not self._closed:
            await self._call("flush", None)

    async def flush_prefix_cache(self) -> bool:
        """Drop the engine's prefix cache while it is idle; False (nothing done) while
        requests run or wait."""
        if self.engine is None or self._closed:
            return False
        return bool(await self._call("flush_prefix_cache", None))

    def count_tokens(self, text: str) -> int:
        if self.engine is None:
            return max(1, len(text) // 4)
        return max(1, len(self.engine.encode(text)))

    def count_item_tokens(self, item: RewardItem) -> int:
        """Tokens of the PRM input built from ``item``, estimated from its length: LV's
        threshold needs no exact count, and tokenizing every item on the event loop cost a
        third of the executor's CPU time at 64 concurrent queries."""
        if self.prm is not None:
            text = build_prm_text(item, self.prm.step_tag)[0]
        else:
            text = item.question + "\n" + "\n".join(item.steps)
        return max(1, round(len(text) * self._prm_tokens_per_char))

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    async def score(self, items: Seq[RewardItem]) -> list[tuple[float, ...]]:
        if self.prm is None or self._prm_pool is None:
            raise BackendError("local", "no PRM loaded (pass prm_path)")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prm_pool, self.prm.score, list(items))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._commands.put(("stop", None, None, None))
            await asyncio.to_thread(self._thread.join)
        if self._prm_pool is not None:
            self._prm_pool.shutdown(wait=False)

    async def _call(self, kind: str, payload: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._commands.put((kind, payload, loop, fut))
        return await fut

    # -- worker thread ----------------------------------------------------------------------
    def _worker(self) -> None:
        engine = self.engine
        assert engine is not None  # internal: the thread starts only with an engine
        running = True
        while running:
            try:
                command = self._commands.get(block=not engine.has_unfinished())
                while True:
                    running = self._handle(engine, command) and running
                    command = self._commands.get_nowait()
            except queue.Empty:
                pass
            if running and engine.has_unfinished():
                try:
                    results = engine.step()
                    self._stats = engine.stats()  # before waking anyone: callers see it
                    self._deliver(results)
                except Exception as exc:  # fail every waiter, keep the thread alive
                    error = BackendError("local", f"engine step failed: {exc!r}")
                    engine.abort_all()
                    for loop, fut in self._pending.values():
                        loop.call_soon_threadsafe(_resolve, fut, None, error)
                    self._pending.clear()
            self._stats = engine.stats()
        closed = BackendError("local", "backend closed")
        engine.abort_all()
        for loop, fut in self._pending.values():
            loop.call_soon_threadsafe(_resolve, fut, None, closed)
        self._pending.clear()

    def _handle(self, engine: LLMEngine, command: _Command) -> bool:
        try:
            return self._handle_one(engine, command)
        except Exception as exc:  # keep the worker alive; the caller gets the error
            _, _, loop, fut = command
            if loop is not None and fut is not None:
                loop.call_soon_threadsafe(_resolve, fut, None, BackendError("local", repr(exc)))
            return True

    def _handle_one(self, engine: LLMEngine, command: _Command) -> bool:
        kind, payload, loop, fut = command
        value: Any = None
        error: BaseException | None = None
        if kind == "add":
            try:
                engine.add_request(payload)
                assert loop is not None and fut is not None
                self._pending[payload.request_id] = (loop, fut)
                return True
            except Exception as exc:
                error = exc
        elif kind == "abort":
            results = engine.abort(payload)
            self._stats = engine.stats()
            self._deliver(results)
            value = len(results)
        elif kind == "abort_exact":
            engine.abort_request(payload)
            self._pending.pop(payload, None)
        elif kind == "flush":
            self._stats = engine.stats()
        elif kind == "flush_prefix_cache":
            value = not engine.has_unfinished() and engine.block_manager.reset_prefix_cache()
        elif kind == "stop":
            return False
        if loop is not None and fut is not None:
            loop.call_soon_threadsafe(_resolve, fut, value, error)
        return True

    def _deliver(self, results: list[GenerateResult]) -> None:
        for result in results:
            entry = self._pending.pop(result.request_id, None)
            if entry is not None:
                entry[0].call_soon_threadsafe(_resolve, entry[1], result, None)


def measure_saturation_batch(engine: LLMEngine, reps: int = 7, factor: float = 3.0) -> int:
    """Largest power-of-two decode batch whose step time stays within ``factor`` x batch 1's:
    below it extra sequences cost little (memory/overhead-bound), past it they cost."""
    limit = engine.config.max_num_seqs
    base = engine.runner.time_decode(1, reps)
    best, batch = 1, 2
    while batch <= limit:
        if engine.runner.time_decode(batch, reps) > factor * base:
            break
        best, batch = batch, batch * 2
    return best


# A typical two-step trace: what the PRM calibrations below measure with.
_PROBE = RewardItem("probe", "1 2 3 4", ("1+2=3 (left: 3 3 4)", "3*3=9 (left: 4 9)"))


def _tokens_per_char(prm: PrmScorer) -> float:
    text = build_prm_text(_PROBE, prm.step_tag)[0]
    return prm.count_tokens(_PROBE) / max(1, len(text))


def measure_reward_knee(prm: PrmScorer, reps: int = 3) -> tuple[int, float]:
    """Input tokens of the smallest PRM batch whose cost per item is within 1.25x of a
    32-item batch's (lazy verification gains little by waiting for more than that), and
    that batch's latency in seconds (waiting longer than one batch takes cannot pay off)."""
    tokens = prm.count_tokens(_PROBE)

    def per_item(n: int) -> float:
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            prm.score([_PROBE] * n)
            best = min(best, time.perf_counter() - start)
        return best / n

    prm.score([_PROBE] * 32)  # warm-up: first calls pay allocation and kernel selection
    floor = per_item(32)
    for n in (1, 2, 4, 8, 16):
        cost = per_item(n)
        if cost <= 1.25 * floor:
            return n * tokens, cost * n
    return 32 * tokens, floor * 32
