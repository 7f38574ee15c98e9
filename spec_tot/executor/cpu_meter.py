"""What the executor's own CPU costs, for the dispatcher: the process's CPU time per wall
second (``CpuMeter``: its gate against speculating in a process whose Python is already
busy), the executor's CPU per request run (``RunCpu``: what a miss wastes beyond its
launch and its tokens) and per launch (``LaunchCpu``)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

__all__ = ["CpuMeter", "LaunchCpu", "RunCpu"]


class CpuMeter:
    """The process's CPU time per wall second (all threads), over the last ``window_s``,
    sampled at most every 20 ms."""

    def __init__(self, window_s: float = 0.2) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        now = time.perf_counter(), time.process_time()
        self._samples: collections.deque[tuple[float, float]] = collections.deque([now])
        self._share = 0.0

    def share(self) -> float:
        with self._lock:
            wall, cpu = time.perf_counter(), time.process_time()
            if wall - self._samples[-1][0] >= 0.02:
                self._samples.append((wall, cpu))
                while len(self._samples) > 2 and wall - self._samples[1][0] >= self.window_s:
                    self._samples.popleft()
                w0, c0 = self._samples[0]
                if wall > w0:
                    self._share = (cpu - c0) / (wall - w0)
            return self._share


class RunCpu:
    """The executor thread's CPU per request that ended (committed or speculative), a
    moving average: each request's whole run (its walk, parsing, reward routing, adoption
    or cancellation, the predictions it sets off) shares the thread's CPU since the last
    sample. Samples come from the thread that runs the requests; one from another thread
    (a sync LangGraph run's) restarts the count."""

    def __init__(self, clock: Callable[[], float] = time.thread_time) -> None:
        self.clock = clock
        self.per_run_s = 0.0
        self._mark: tuple[int, float] | None = None
        self._ended = 0

    def ended(self, count: int = 1) -> None:
        self._ended += count
        now, thread = self.clock(), threading.get_ident()
        mark = self._mark
        if mark is None or mark[0] != thread:
            self._mark, self._ended = (thread, now), 0
            return
        if now - mark[1] < 0.01:  # sample every 10 ms of CPU at most: the clock is coarse
            return
        sample = (now - mark[1]) / self._ended
        self.per_run_s = sample if not self.per_run_s else 0.9 * self.per_run_s + 0.1 * sample
        self._mark, self._ended = (thread, now), 0


class LaunchCpu:
    """The executor's CPU seconds per speculative launch, a moving average of what the
    launchers measured."""

    def __init__(self) -> None:
        self.per_launch_s = 0.0
        self._samples = 0

    def spent(self, seconds: float) -> None:
        spent = max(0.0, seconds)
        mean = self.per_launch_s
        self.per_launch_s = spent if not self._samples else 0.9 * mean + 0.1 * spent
        self._samples += 1
