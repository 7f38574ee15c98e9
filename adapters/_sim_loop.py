"""The continuous-batching GPU engine of the simulator (``SimEngine``), run in virtual time
(``_virtual_time.py``); the cost model, workload and backend contract live in
``spec_tot.adapters.sim``."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from ._virtual_time import VirtualDeadlockError, VirtualTimeLoop, run_virtual

__all__ = [
    "EngineCosts",
    "SimEngine",
    "SimSeq",
    "VirtualDeadlockError",
    "VirtualTimeLoop",
    "run_virtual",
]


class EngineCosts(Protocol):
    """What the engine needs from a configuration (``SimConfig`` provides it)."""

    @property
    def max_running(self) -> int: ...
    @property
    def kv_capacity_tokens(self) -> int: ...
    @property
    def prefill_chunk_tokens(self) -> int: ...
    @property
    def max_macro_tokens(self) -> int: ...
    @property
    def shared_gpu(self) -> bool: ...
    def step_time(self, batch: int, kv_read_tokens: int, prefill_tokens: int) -> float: ...
    def prm_time(self, tokens: int) -> float: ...


@dataclass(eq=False, slots=True)
class SimSeq:
    """One physical-or-merged sequence (one sample of a request)."""

    request_id: str
    priority: int
    prompt_key: str
    prompt_tokens: int
    target_tokens: int
    done: asyncio.Future[None]
    group_key: str | None = None  # CD: same key, admitted in one step -> decode together
    shared_tokens: int = 0  # CD: leading tokens it may decode merged with its group leader
    prefixes: tuple[tuple[str, int], ...] = ()  # (cache key, tokens) to look up, longest first
    finish_key: str = ""  # cache key of its whole context once finished (a child's prompt)
    order: int = 0
    generated: int = 0
    own_kv: int = 0  # KV tokens held beyond the (shared) prompt
    prefill: int = 0  # tokens to prefill in its next step
    leader: SimSeq | None = None
    followers: list[SimSeq] = field(default_factory=list)

    @property
    def merged(self) -> bool:
        return self.leader is not None and self.generated < self.shared_tokens


class SimEngine:
    """Continuous batching in virtual time on one GPU.

    Each iteration runs a pending PRM batch (same GPU: it stalls decoding, as in SpecScale's
    single-card setup) or one decode step of every running sequence, plus the prefill of
    sequences admitted for that step. Runs of steps with no event in between are slept as
    one "macro step" that an arrival or abort interrupts at the next step boundary.
    Scheduling: committed before speculative (then FIFO); admission bounded by the running
    limit and the KV capacity; a waiting sequence may preempt a lower-priority running one,
    which later re-prefills its context (recompute preemption, as in vLLM/SGLang).
    """

    def __init__(self, costs: EngineCosts) -> None:
        self.costs = costs
        self.waiting: list[SimSeq] = []
        self.running: list[SimSeq] = []
        self.kv_used = 0
        self.stats: dict[str, float] = dict.fromkeys(_STAT_KEYS, 0.0)
        self._prompts: dict[str, list[int]] = {}  # resident prompt -> [tokens, refcount]
        self._cache: OrderedDict[str, int] = OrderedDict()  # finished contexts (radix-like)
        self._cache_tokens = 0
        self._prm_jobs: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._prm_lock = asyncio.Lock()
        self._order = itertools.count()
        self._waiter: asyncio.Future[bool] | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- requests -------------------------------------------------------------------------
    def submit(self, seqs: list[SimSeq]) -> None:
        self._ensure_task()
        for seq in seqs:
            seq.order = next(self._order)
            self.waiting.append(seq)
        self._wake()

    def remove(self, seq: SimSeq) -> bool:
        """Abort: free its KV at once and resolve it (partial tokens stay counted)."""
        if seq in self.running:
            self._free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return False
        if not seq.done.done():
            seq.done.set_result(None)
        self._wake()
        return True

    async def run_prm(self, tokens: int) -> None:
        """One reward forward pass over ``tokens`` input tokens."""
        if not self.costs.shared_gpu:
            async with self._prm_lock:  # its own GPU: PRM calls queue only behind each other
                await self._prm_step(tokens)
            return
        self._ensure_task()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._prm_jobs.append((tokens, future))
        self._wake()
        await future

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    # -- the loop -------------------------------------------------------------------------
    def _ensure_task(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._prm_lock = asyncio.Lock()
            self._task = loop.create_task(self._run(), name="sim-engine")
            self._task.add_done_callback(self._on_crash)

    def _on_crash(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()  # fail every waiter rather than leave it hanging
        for seq in [*self.running, *self.waiting]:
            if not seq.done.done():
                seq.done.set_exception(RuntimeError(f"sim engine crashed: {exc!r}"))
        for _, future in self._prm_jobs:
            if not future.done():
                future.set_exception(RuntimeError(f"sim engine crashed: {exc!r}"))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._prm_jobs:
                futures = _next_prm_batch(self._prm_jobs, self.costs.prefill_chunk_tokens)
                await self._prm_step(sum(tokens for tokens, _ in futures))
                for _, future in futures:
                    if not future.done():
                        future.set_result(None)
                continue
            self._schedule()
            if not self.running:
                await self._sleep(None)
                continue
            physical = [s for s in self.running if not s.merged]
            prefill = sum(s.prefill for s in self.running)
            kv_read = sum(s.prompt_tokens + s.generated for s in physical)
            dt = self.costs.step_time(len(physical), kv_read, prefill)
            k = 1 if prefill else _steps_to_next_event(self.running, self.costs.max_macro_tokens)
            start = loop.time()
            done = k
            if await self._sleep(k * dt):  # interrupted: finish the step in progress
                elapsed = loop.time() - start
                done = min(k, math.ceil(elapsed / dt - 1e-9))
                if done * dt > elapsed:
                    await asyncio.sleep(done * dt - elapsed)
            if done > 0:
                self._credit(done, dt, len(physical))

    async def _prm_step(self, tokens: int) -> None:
        dt = self.costs.prm_time(tokens)
        await asyncio.sleep(dt)
        self.stats["prm_busy_s"] += dt
        self.stats["prm_calls"] += 1
        self.stats["prm_tokens"] += tokens

    async def _sleep(self, timeout: float | None) -> bool:
        """Sleep ``timeout`` (None: until woken); True when woken early."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        timer = None if timeout is None else loop.call_later(timeout, _resolve, waiter, False)
        try:
            return await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    # -- scheduling and memory ------------------------------------------------------------
    def _schedule(self) -> None:
        self.waiting.sort(key=lambda s: (s.priority, s.order))
        leaders: dict[str, SimSeq] = {}
        prefill = sum(s.prefill for s in self.running)
        while self.waiting:
            seq = self.waiting[0]
            resident = seq.prompt_key in self._prompts
            need = (0 if resident else seq.prompt_tokens) + seq.generated + 1
            full = len(self.running) >= self.costs.max_running
            if full or self.kv_used + need > self.costs.kv_capacity_tokens:
                if self._preempt(below=seq.priority):
                    continue
                break
            if prefill and prefill + need > self.costs.prefill_chunk_tokens:
                break  # chunked prefill: the rest joins the next step
            self.waiting.pop(0)
            prefill += self._admit(seq, resident)
            if seq.group_key is not None and seq.generated == 0:
                leader = leaders.setdefault(seq.group_key, seq)
                if leader is not seq and seq.shared_tokens > 0:
                    seq.shared_tokens = min(seq.shared_tokens, leader.target_tokens)
                    seq.leader = leader
                    leader.followers.append(seq)

    def _admit(self, seq: SimSeq, resident: bool) -> int:
        cached = seq.prompt_tokens if resident else 0
        for key, tokens in seq.prefixes if not resident else ():
            if key in self._cache:
                self._cache.move_to_end(key)
                cached = max(cached, min(tokens, seq.prompt_tokens))
                break
        ref = self._prompts.setdefault(seq.prompt_key, [seq.prompt_tokens, 0])
        ref[1] += 1
        if ref[1] == 1:
            self.kv_used += seq.prompt_tokens
        seq.own_kv = seq.generated
        self.kv_used += seq.own_kv
        seq.prefill = seq.prompt_tokens - cached + seq.generated  # recompute after preemption
        self.stats["prefill_tokens"] += seq.prefill
        self.stats["cached_prompt_tokens"] += cached
        self.running.append(seq)
        self._peaks()
        return seq.prefill

    def _free(self, seq: SimSeq) -> None:
        self.running.remove(seq)
        ref = self._prompts[seq.prompt_key]
        ref[1] -= 1
        if ref[1] == 0:
            del self._prompts[seq.prompt_key]
            self.kv_used -= ref[0]
        self.kv_used -= seq.own_kv
        seq.own_kv = seq.prefill = 0
        for follower in seq.followers:  # they go on alone from here
            follower.leader = None
        seq.followers.clear()
        if seq.leader is not None:
            seq.leader.followers.remove(seq)
            seq.leader = None

    def _preempt(self, below: int) -> bool:
        """Send the newest running sequence of priority lower than ``below`` back to waiting."""
        victims = [s for s in self.running if s.priority > below]
        if not victims:
            return False
        victim = max(victims, key=lambda s: (s.priority, s.order))
        self._free(victim)
        self.waiting.append(victim)
        self.stats["preemptions"] += 1
        return True

    def _credit(self, steps: int, dt: float, physical: int) -> None:
        for s in self.running:
            if not s.merged:
                s.own_kv += steps
                self.kv_used += steps
            else:
                self.stats["dedup_saved_tokens"] += steps
            s.generated += steps
            s.prefill = 0
        st = self.stats
        st["steps"] += steps
        st["decode_busy_s"] += steps * dt
        st["physical_batch_sum"] += steps * physical
        st["logical_batch_sum"] += steps * len(self.running)
        self._peaks()
        for s in [s for s in self.running if s.generated >= s.target_tokens]:
            self._free(s)
            if s.finish_key:
                self._cache[s.finish_key] = s.prompt_tokens + s.generated
                self._cache_tokens += s.prompt_tokens + s.generated
            if not s.done.done():
                s.done.set_result(None)
        while self.kv_used > self.costs.kv_capacity_tokens and len(self.running) > 1:
            self._preempt(below=-1)
        while self._cache and self._cache_tokens > self.costs.kv_capacity_tokens - self.kv_used:
            self._cache_tokens -= self._cache.popitem(last=False)[1]  # LRU eviction

    def _peaks(self) -> None:
        st = self.stats
        st["peak_running"] = max(st["peak_running"], len(self.running))
        st["peak_kv_tokens"] = max(st["peak_kv_tokens"], self.kv_used)


_STAT_KEYS = (
    "steps",
    "decode_busy_s",
    "prm_busy_s",
    "prm_calls",
    "prm_tokens",
    "physical_batch_sum",
    "logical_batch_sum",
    "peak_running",
    "peak_kv_tokens",
    "prefill_tokens",
    "cached_prompt_tokens",
    "dedup_saved_tokens",
    "preemptions",
)


def _steps_to_next_event(running: list[SimSeq], max_macro: int) -> int:
    k = max_macro  # bounds the error of a constant step time
    for s in running:
        k = min(k, s.target_tokens - s.generated)
        if s.merged:
            k = min(k, s.shared_tokens - s.generated)
    return max(1, k)


def _next_prm_batch(
    jobs: deque[tuple[int, asyncio.Future[None]]], chunk: int
) -> list[tuple[int, asyncio.Future[None]]]:
    """The queued reward calls one forward pass takes: a serving engine batches requests
    that wait together, up to its prefill chunk (a larger single call still runs whole)."""
    batch = [jobs.popleft()]
    total = batch[0][0]
    while jobs and total + jobs[0][0] <= chunk:
        batch.append(jobs.popleft())
        total += batch[-1][0]
    return batch


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)
