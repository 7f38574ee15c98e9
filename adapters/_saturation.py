"""The saturation of a model behind an API, measured from its own traffic.

A hosted model's latency stays flat while the provider has spare capacity and grows once
calls queue; the concurrency where it starts to grow is the ``saturation_batch`` that the
speculation budget needs (speculating below it is free, above it slows committed work).
"""

from __future__ import annotations

import statistics
from collections import deque

from spec_tot.errors import ConfigError

__all__ = ["LoadProbe"]


class LoadProbe:
    """Seconds per output token of each call, grouped by the number of calls in flight when
    it started (groups 1, 2, 4, 8, ...). The estimate is the largest group whose median stays
    within ``slowdown`` x the least-loaded group's median; while even the busiest group seen
    is flat, it is twice that group (the budget may probe higher), at most ``ceiling``.
    Before ``min_samples`` calls in two groups it is ``initial``."""

    def __init__(
        self,
        *,
        initial: int = 4,
        slowdown: float = 1.5,
        ceiling: int = 1024,
        window: int = 64,
        min_samples: int = 3,
    ) -> None:
        if initial < 1 or ceiling < initial:
            raise ConfigError("initial", f"need 1 <= initial <= ceiling, got {initial}, {ceiling}")
        if not slowdown > 1:
            raise ConfigError("slowdown", f"must be > 1, got {slowdown}")
        self.initial, self.slowdown, self.ceiling = initial, slowdown, ceiling
        self.window, self.min_samples = window, min_samples
        self._groups: dict[int, deque[float]] = {}

    def record(self, inflight: int, seconds: float, tokens: int) -> None:
        group = 1 << max(0, max(1, inflight) - 1).bit_length()  # 1, 2, 4, 8, ...
        samples = self._groups.setdefault(group, deque(maxlen=self.window))
        samples.append(max(seconds, 0.0) / max(1, tokens))

    def estimate(self) -> int:
        medians = {
            g: statistics.median(s) for g, s in self._groups.items() if len(s) >= self.min_samples
        }
        if len(medians) < 2:
            return self.initial
        groups = sorted(medians)
        base = medians[groups[0]]
        flat = [g for g in groups if medians[g] <= self.slowdown * base]
        best = max(flat)
        if best == groups[-1]:  # no slowdown seen yet: allow probing above the busiest group
            return min(self.ceiling, 2 * best)
        return best
