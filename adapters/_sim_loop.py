"""Virtual time for the simulator: an asyncio event loop whose clock jumps, and the
continuous-batching GPU engine that runs on it (``SimEngine``; the cost model, workload and
backend contract live in ``spec_tot.adapters.sim``).

``VirtualTimeLoop`` is a normal ``SelectorEventLoop`` except for two things:
- ``time()`` returns a virtual clock that starts at 0;
- when no callback is ready, the loop's own selector wait (``select(timeout)``, where
  ``timeout`` is the distance to the next timer) does not sleep: it moves the clock forward
  by ``timeout`` and returns at once.

Everything built on ``loop.time()``/``call_at`` (``asyncio.sleep``, ``asyncio.timeout``,
``wait_for``, the executor's LV timer, the simulator's engine steps) then runs in virtual
time: minutes of simulated GPU work take milliseconds, and a run is a pure function of its
inputs (callbacks run in the same order on every run: FIFO ready queue, timer heap).

Threads are the one thing that runs in real time. While a ``run_in_executor`` job (or the
default executor's shutdown) is pending, the loop waits for it in real time and virtual time
stands still: a thread's work takes zero virtual time, and the loop never jumps past it.
With nothing ready, no timer and no thread, every task waits on something that can never
happen; a real loop would hang forever, this one raises ``VirtualDeadlockError``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import selectors
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

__all__ = [
    "EngineCosts",
    "SimEngine",
    "SimSeq",
    "VirtualDeadlockError",
    "VirtualTimeLoop",
    "run_virtual",
]

_T = TypeVar("_T")


class VirtualDeadlockError(RuntimeError):
    """Nothing is ready, no timer is set and no thread works: the run can never finish."""


class _VirtualSelector(selectors.BaseSelector):
    """Delegates file registration to a real selector (the loop's self-pipe, sockets) and
    turns a timed wait into a jump of the virtual clock."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._real.select(0)  # real I/O (a thread's wake-up) always comes first
        if events or timeout == 0:
            return events
        if self._loop.threads_pending:
            # Wait for the thread in real time; virtual time stands still meanwhile.
            return self._real.select(None)
        if timeout is None:
            raise VirtualDeadlockError(
                "virtual-time deadlock: no callback is ready, no timer is scheduled and no "
                "thread is working, so every task waits on something that never happens"
            )
        self._loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock (see the module docstring)."""

    def __init__(self, start: float = 0.0) -> None:
        self._virtual_now = float(start)  # set first: the base __init__ may read time()
        self.threads_pending = 0
        super().__init__(_VirtualSelector(self))
        # Timers due within this much of "now" run now: covers the float rounding of
        # now + (when - now) after a jump (1 ulp at 1e6 s is ~1e-10 s).
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        """Move the virtual clock forward (the selector does it; tests may too)."""
        if seconds < 0:
            raise ValueError(f"cannot move virtual time backwards ({seconds})")
        self._virtual_now += seconds

    def run_in_executor(  # type: ignore[override]
        self, executor: Executor | None, func: Callable[..., _T], *args: Any
    ) -> asyncio.Future[_T]:
        future = super().run_in_executor(executor, func, *args)
        self.threads_pending += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _future: asyncio.Future[Any]) -> None:
        self.threads_pending -= 1

    async def shutdown_default_executor(self, timeout: float | None = None) -> None:
        # The base class joins the executor from a helper thread it starts itself.
        self.threads_pending += 1
        try:
            await super().shutdown_default_executor()
        finally:
            self.threads_pending -= 1


def run_virtual(coro: Coroutine[Any, Any, _T], *, debug: bool | None = None) -> _T:
    """Like ``asyncio.run`` but on a fresh ``VirtualTimeLoop`` (virtual clock from 0)."""
    with asyncio.Runner(debug=debug, loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)


# -- the engine ---------------------------------------------------------------------------------
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
                futures = self._next_prm_batch()
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
            k = 1 if prefill else self._steps_to_next_event()
            start = loop.time()
            done = k
            if await self._sleep(k * dt):  # interrupted: finish the step in progress
                elapsed = loop.time() - start
                done = min(k, math.ceil(elapsed / dt - 1e-9))
                if done * dt > elapsed:
                    await asyncio.sleep(done * dt - elapsed)
            if done > 0:
                self._credit(done, dt, len(physical))

    def _steps_to_next_event(self) -> int:
        k = self.costs.max_macro_tokens  # bounds the error of a constant step time
        for s in self.running:
            k = min(k, s.target_tokens - s.generated)
            if s.merged:
                k = min(k, s.shared_tokens - s.generated)
        return max(1, k)

    def _next_prm_batch(self) -> list[tuple[int, asyncio.Future[None]]]:
        """The queued reward calls one forward pass takes: a serving engine batches requests
        that wait together, up to its prefill chunk (a larger single call still runs whole)."""
        batch = [self._prm_jobs.popleft()]
        total = batch[0][0]
        while self._prm_jobs and total + self._prm_jobs[0][0] <= self.costs.prefill_chunk_tokens:
            batch.append(self._prm_jobs.popleft())
            total += batch[-1][0]
        return batch

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


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)
