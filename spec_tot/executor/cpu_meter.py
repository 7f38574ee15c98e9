"""The process's CPU time per wall second: the dispatcher's gate against speculating in a
process whose Python is already busy (its speculation would only slow committed work)."""

from __future__ import annotations

import collections
import threading
import time

__all__ = ["CpuMeter"]


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
