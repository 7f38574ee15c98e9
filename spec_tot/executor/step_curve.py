"""The step-time curve a dispatcher values speculation with: seconds per generated token
against rows in flight, learnt from the committed requests' own latency over the backend's
calibrated curve (or the roofline's shape when it has none)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

__all__ = ["StepCurve"]


@dataclass
class StepCurve:
    """Seconds per generated token against rows in flight, learnt per power-of-two bucket
    (moving averages) over a shape: the backend's calibrated step-time curve when it has
    one (``prior``: decode batch -> seconds a step), else the roofline's
    ``max(1, rows / saturation)``."""

    saturation: int
    scale: dict[int, float] = field(default_factory=dict)  # bucket -> s/token over the shape
    prior: dict[int, float] = field(default_factory=dict)
    # (step_s, marginal_s, slack) per rows until the next sample: every offer of one
    # prediction is valued at the same load, and the dispatcher values each again as it pops.
    _memo: dict[float, tuple[float, float, float]] = field(default_factory=dict, repr=False)

    def _shape(self, rows: float) -> float:
        if not self.prior:
            return max(1.0, rows / self.saturation)
        return _interpolate(self.prior, max(rows, 1.0))

    @staticmethod
    def _bucket(rows: float) -> int:
        return max(0, math.ceil(math.log2(max(rows, 1.0))))

    @property
    def measured(self) -> bool:
        """Whether its figures are seconds (sampled, or calibrated), not steps."""
        return bool(self.scale) or bool(self.prior)

    def observe(self, rows: float, seconds: float, tokens: int) -> None:
        if tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        bucket = self._bucket(rows)
        sample = seconds / tokens / self._shape(rows)
        old = self.scale.get(bucket)
        self.scale[bucket] = sample if old is None else 0.8 * old + 0.2 * sample
        self._memo.clear()

    def costs(self, rows: float) -> tuple[float, float, float]:
        """``(step_s(rows + 1), marginal_s(rows), slack(rows))``: what a launch at ``rows``
        is valued with, remembered until the next sample."""
        known = self._memo.get(rows)
        if known is None:
            if len(self._memo) > 256:  # rows seen since the last sample: a few dozen
                self._memo.clear()
            step, marginal = self.step_s(rows + 1), self.marginal_s(rows)
            known = self._memo[rows] = (step, marginal, self.slack(rows, self.saturation))
        return known

    def step_s(self, rows: float) -> float:
        """Seconds per token at ``rows`` in flight (the shape itself before any sample)."""
        if not self.scale:
            return self._shape(rows)
        bucket = self._bucket(rows)
        nearest = min(self.scale, key=lambda b: (abs(b - bucket), b))
        return float(self.scale[nearest] * self._shape(rows))

    def slack(self, rows: float, capacity: int) -> float:
        """The share of the engine's throughput at ``capacity`` rows that is unused at
        ``rows``: ``1 - tokens/s(rows) / tokens/s(capacity)`` (0 at or past capacity)."""
        if rows >= capacity:
            return 0.0
        rows = max(rows, 1.0)
        used = rows / self.step_s(rows)
        return max(0.0, 1.0 - used / (capacity / self.step_s(capacity)))

    def marginal_s(self, rows: float) -> float:
        """What one more row adds to a step at ``rows``: the slope between the buckets
        measured around it, but never less than the step time there times the shape's
        relative slope. A sample's rows are those at its start and the load moves during
        its life, so measured slopes can come out flat or falling (REST-MCTS* at 16 in
        flight: seconds per token 5x the calibration at 8 rows, 1x at 32), which priced
        every extra row at nothing."""
        shape = self._shape(rows)
        floor = self.step_s(rows) * max(0.0, self._shape(rows + 1) - shape) / shape
        lower = [1 << b for b in self.scale if 1 << b <= max(rows, 1.0)]
        upper = [1 << b for b in self.scale if 1 << b > max(rows, 1.0)]
        if lower and upper:
            lo, hi = max(lower), min(upper)
            return max(floor, (self.step_s(hi) - self.step_s(lo)) / (hi - lo))
        return max(floor, self.step_s(rows + 1) - self.step_s(rows))


def _interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through ``points``, extended by the last segment's slope."""
    keys = sorted(points)
    if len(keys) == 1 or x <= keys[0]:
        return points[keys[0]]
    pairs = list(itertools.pairwise(keys))
    b0, b1 = next(((lo, hi) for lo, hi in pairs if x <= hi), pairs[-1])
    t0, t1 = points[b0], points[b1]
    return t0 + (t1 - t0) * (x - b0) / (b1 - b0)
