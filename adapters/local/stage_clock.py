"""Where a loop's wall time goes: seconds per named stage, cheap enough to stay on.

``start()`` marks the beginning of an iteration, ``lap(stage)`` charges the time since the
last mark to ``stage`` and moves the mark (two ``perf_counter`` reads and a dict update,
well under a microsecond). On CUDA the host does not wait for the GPU where it launches
work, so a launch stage ("forward") holds the host's launch time and the GPU's time shows
where the host first waits for it (the sampler reading its draws); the GPU's own busy time
is measured apart with CUDA events (``GpuTimer``), read back only once they have passed.
"""

from __future__ import annotations

import time

import torch

__all__ = ["GpuTimer", "StageClock"]


class StageClock:
    def __init__(self, *stages: str) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(stages, 0.0)
        self._mark = 0.0

    def start(self) -> None:
        self._mark = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._mark
        self._mark = now

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def reset(self) -> None:
        for stage in self.seconds:
            self.seconds[stage] = 0.0

    def as_stats(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}{stage}_s": value for stage, value in self.seconds.items()}


class GpuTimer:
    """GPU seconds between pairs of CUDA events: ``begin()``/``end()`` around the work,
    ``seconds`` adds up the pairs that have completed (no synchronisation: a pair still
    running is read at a later call). A no-op off CUDA."""

    def __init__(self, device: str) -> None:
        self.enabled = device.startswith("cuda")
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: torch.cuda.Event | None = None
        self._done = 0.0

    def begin(self) -> None:
        if self.enabled:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def end(self) -> None:
        if self.enabled and self._start is not None:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self._pending.append((self._start, stop))
            self._start = None
            if len(self._pending) > 64:
                self._collect()

    def _collect(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, stop = self._pending.pop(0)
            self._done += start.elapsed_time(stop) / 1000.0

    @property
    def seconds(self) -> float:
        self._collect()
        return self._done

    def reset(self) -> None:
        self._collect()
        self._pending.clear()
        self._done = 0.0
