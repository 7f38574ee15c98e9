"""LocalBackend: the engine behind the async backend contracts.

The engine is not thread-safe, so exactly one worker thread owns it: the event loop only
puts commands on a queue (add, abort, flush, stop) and awaits futures (``generate``) or
reads queues (``stream``) that the worker feeds through ``loop.call_soon_threadsafe``. The
worker drains commands between steps, so an abort frees its KV blocks before the next step.
PRM scoring runs on its own single thread, so neither kind of work ever blocks the event
loop. A request that fails inside a step fails alone (``LLMEngine.take_failures``); only a
step that fails as a whole, with no row to blame, fails every request in flight.

Requests are checked on the event loop before they are queued (types, ids in the
vocabulary, lengths, text capped by characters), so a bad one costs the engine nothing.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spec_tot.backends import GenerationBackend, RewardBackend
from spec_tot.errors import BackendError, ConfigError
from spec_tot.requests import (
    Capabilities,
    Completion,
    GenerateRequest,
    GenerateResult,
    RewardItem,
    StreamUpdate,
)

from .calibrate import (
    CalibrationCache,
    disturbed,
    model_fingerprint,
    reward_knee,
    saturation_from_curve,
    step_cost_curve,
)
from .engine import LLMEngine
from .prm import PrmScorer

__all__ = ["LocalBackend"]

_Command = tuple[str, Any, "asyncio.AbstractEventLoop | None", "asyncio.Future[Any] | None"]


def _resolve(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if fut.done():  # cancelled by its caller meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _send(sink: Any, value: Any, error: BaseException | None, final: bool = True) -> None:
    """Deliver to a future, or append to a stream's queue (an error or a final result ends
    the stream)."""
    if isinstance(sink, asyncio.Future):
        if final:
            _resolve(sink, value, error)
        return
    sink.put_nowait(error if error is not None else value)


class LocalBackend(GenerationBackend, RewardBackend):
    def __init__(
        self,
        engine: LLMEngine | None,
        prm: PrmScorer | None = None,
        *,
        cache: CalibrationCache | None = None,
    ) -> None:
        if engine is None and prm is None:
            raise ConfigError("policy_path", "give a policy model, a PRM, or both")
        self.engine = engine
        self.prm = prm
        self._inflight: dict[str, Any] = {}
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, Any]] = {}
        self._closed = False
        self._cache = cache or CalibrationCache()
        self._saturation = 0
        self._step_curve: dict[int, float] = {}
        if engine is not None:
            configured = engine.config.saturation_batch
            self._saturation = configured or self._calibrate_engine(engine)
        self._stats: dict[str, float] = engine.stats() if engine else {}
        self._prm_pool = ThreadPoolExecutor(1, thread_name_prefix="spec-tot-prm") if prm else None
        self._reward_knee = self._calibrate_prm(prm) if prm is not None else None
        self._thread = threading.Thread(target=self._worker, name="spec-tot-engine", daemon=True)
        if engine is not None:
            self._thread.start()

    # -- calibration ------------------------------------------------------------------------
    def _calibrate_engine(self, engine: LLMEngine) -> int:
        cfg = engine.config
        what = {
            "model": model_fingerprint(cfg.model, cfg.model_config),
            "engine": [
                cfg.device,
                cfg.dtype,
                cfg.block_size,
                cfg.max_num_seqs,
                cfg.max_num_batched_tokens,
                cfg.mixed_steps,
                engine.runner.attention,
            ],
        }
        key = self._cache.key("steps", what)
        hit = self._cache.get(key)
        curve = {}
        if hit is not None and isinstance(hit.get("curve"), dict):
            curve = {int(b): float(t) for b, t in hit["curve"].items()}
        if not curve or disturbed(curve):  # a disturbed curve is measured again
            with engine.plain_decoding():
                curve = step_cost_curve(engine)
            if not disturbed(curve):
                self._cache.put(key, {"curve": {str(b): t for b, t in curve.items()}})
        self._step_curve = curve
        engine.use_step_costs(curve)
        return saturation_from_curve(curve, cfg.max_num_seqs)

    def _calibrate_prm(self, prm: PrmScorer) -> tuple[int, float]:
        what = {"model": model_fingerprint(prm.folder, None), "prm": [prm.device, prm.max_len]}
        key = self._cache.key("reward", what)
        hit = self._cache.get(key)
        if hit is not None and {"tokens", "seconds"} <= hit.keys():
            return int(hit["tokens"]), float(hit["seconds"])
        tokens, seconds, curve = reward_knee(prm, step_tokens=self.count_item_tokens)
        self._cache.put(key, {"tokens": tokens, "seconds": seconds, "curve": curve})
        return tokens, seconds

    # -- contract ---------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """``saturation_batch`` and the reward knee as measured (see ``calibrate.py``);
        ``extra`` adds the KV pool size and ``step_s_b{n}``, the measured full step time
        (seconds) at decode batch ``n``."""
        cfg = self.engine.config if self.engine else None
        extra = {
            "num_kv_blocks": float(cfg.num_kv_blocks if cfg else 0),
            "block_size": float(cfg.block_size if cfg else 0),
        }
        extra.update({f"step_s_b{b}": t for b, t in self._step_curve.items()})
        return Capabilities(
            abort=True,
            prefix_abort=True,
            prefix_cache=True,
            engine_dedup=True,
            streaming=True,
            saturation_batch=max(1, self._saturation),
            max_running_requests=cfg.max_num_seqs if cfg else 1,
            reward_batch_tokens=self._reward_knee[0] if self._reward_knee else None,
            reward_batch_s=self._reward_knee[1] if self._reward_knee else None,
            name="local",
            extra=extra,
        )

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def _admit(self, request: GenerateRequest, sink: Any) -> asyncio.AbstractEventLoop:
        if self.engine is None or self._closed:
            raise BackendError("local", "no policy engine (closed, or built with a PRM only)")
        if not isinstance(request, GenerateRequest):
            raise ConfigError("request", f"must be a GenerateRequest, got {type(request).__name__}")
        if request.request_id in self._inflight:
            raise ConfigError("request_id", f"{request.request_id!r} is already in flight")
        self.engine.validator.check_request(request)  # cheap checks, no tokenizing
        self._inflight[request.request_id] = sink
        return asyncio.get_running_loop()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        loop = self._admit(request, fut)
        self._commands.put(("add", request, loop, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            # a cancelled caller leaves nothing behind: abort exactly this id in the engine
            self._commands.put(("abort_exact", request.request_id, None, None))
            raise
        finally:
            self._inflight.pop(request.request_id, None)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamUpdate]:
        """Per-token updates of every sample of ``request``; the last update of a sample
        carries its ``Completion``. Closing the iterator early aborts the request: at once
        when the consuming task is cancelled or the iterator is ``aclose()``d (wrap it in
        ``contextlib.aclosing`` to leave a loop with ``break``), else when it is collected."""
        updates: asyncio.Queue[Any] = asyncio.Queue()
        loop = self._admit(request, updates)
        self._commands.put(("add_stream", request, loop, None))
        open_samples = set(range(request.n))
        try:
            while open_samples:
                item = await updates.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, StreamUpdate):
                    if item.index in open_samples:
                        if item.finished:
                            open_samples.discard(item.index)
                        yield item
                    continue
                for index, completion in enumerate(item.completions):  # aborted: the rest
                    if index in open_samples:
                        open_samples.discard(index)
                        yield _final_update(item.request_id, index, completion)
                open_samples.clear()
        finally:
            if open_samples:
                self._commands.put(("abort_exact", request.request_id, None, None))
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
        """Tokens scoring ``item`` computes, estimated from length (tokenizing every item on
        the event loop cost a third of the executor's CPU at 64 queries): the PRM reuses the
        question and earlier steps, so an item costs its last step (and the question, for a
        first step)."""
        tag = self.prm.step_tag if self.prm is not None else ""
        chars = len(item.steps[-1]) + len(tag) + 1 if item.steps else 0
        if len(item.steps) <= 1:
            chars += len(item.question) + 1
        per_char = self.prm.tokens_per_char if self.prm is not None else 0.25
        return max(1, round(chars * per_char))

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    async def score(self, items: Seq[RewardItem]) -> list[tuple[float, ...]]:
        if self.prm is None or self._prm_pool is None:
            raise BackendError("local", "no PRM loaded (pass prm_path)")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prm_pool, self.prm.score, list(items))

    async def classify(self, texts: Seq[str | Seq[int]]) -> list[float]:
        """The PRM's reward of each raw text (``PrmScorer.classify``)."""
        if self.prm is None or self._prm_pool is None:
            raise BackendError("local", "no PRM loaded (pass prm_path)")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prm_pool, self.prm.classify, list(texts))

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
                except Exception as exc:  # no row to blame: fail every waiter, keep going
                    self._fail_all(engine, BackendError("local", f"engine step failed: {exc!r}"))
                    results = []
                self._stats = engine.stats()  # before waking anyone: callers see it
                self._deliver_updates(engine.take_stream_updates())
                for rid, error in engine.take_failures():
                    self._finish(rid, None, BackendError("local", f"request {rid!r}: {error!r}"))
                self._deliver(results)
        self._fail_all(engine, BackendError("local", "backend closed"))

    def _fail_all(self, engine: LLMEngine, error: BaseException) -> None:
        engine.abort_all()
        engine.take_stream_updates()
        for loop, sink in self._pending.values():
            _post(loop, _send, sink, None, error)
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
        if kind in ("add", "add_stream"):
            sink = fut if kind == "add" else self._inflight.get(payload.request_id)
            if loop is None or sink is None:  # a stream closed before its request got here
                return True
            try:
                engine.add_request(payload, stream=kind == "add_stream")
            except Exception as exc:  # a ConfigError naming the field, to this caller only
                loop.call_soon_threadsafe(_send, sink, None, exc)
                return True
            self._pending[payload.request_id] = (loop, sink)
            return True
        if kind == "abort":
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
            loop.call_soon_threadsafe(_resolve, fut, value, None)
        return True

    def _deliver_updates(self, updates: list[StreamUpdate]) -> None:
        for update in updates:
            entry = self._pending.get(update.request_id)
            if entry is not None:
                _post(entry[0], _send, entry[1], update, None, False)

    def _finish(self, rid: str, result: GenerateResult | None, error: BaseException | None) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None:
            _post(entry[0], _send, entry[1], result, error)

    def _deliver(self, results: list[GenerateResult]) -> None:
        for result in results:
            self._finish(result.request_id, result, None)


def _post(loop: asyncio.AbstractEventLoop, *callback: Any) -> None:
    """``loop.call_soon_threadsafe(*callback)``, unless the caller's loop has closed (a
    stream consumer's ``asyncio.run`` may end right after its last update): nobody waits
    there any more, and the worker must live on."""
    try:
        loop.call_soon_threadsafe(*callback)
    except RuntimeError:
        if not loop.is_closed():
            raise


def _final_update(request_id: str, index: int, completion: Completion) -> StreamUpdate:
    return StreamUpdate(request_id, index, completion.token_ids, completion.text, completion)
