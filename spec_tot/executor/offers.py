"""What a speculative candidate is (``Offer``) and how often each kind of candidate is
needed (``HitRates``): the dispatcher's vocabulary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["HitRates", "Offer"]

_MAX_LEVEL = 8  # levels past this share one hit rate
_BANDS = 4  # confidence bands of the predictor's own estimate
_RATE_WINDOW = 512  # hit-rate counts halve past this many launches: recent behaviour wins


@dataclass(frozen=True, slots=True)
class Offer:
    """One speculative sequence a client could start. ``launch(offer)`` starts it now and
    says whether it did (False: no longer wanted, e.g. its parent went away)."""

    kind: str
    level: int
    tokens: float
    launch: Callable[[Offer], bool]
    saved_s: float = 0.0  # critical-path seconds a hit saves besides its generation
    reward_s: float = 0.0  # reward seconds scoring it costs (wasted on a miss)
    waste_s: float = 0.0  # the process's CPU seconds its own run costs (wasted on a miss)
    confidence: float = 1.0  # the predictor's own estimate that it is needed, in [0, 1]

    @property
    def slot(self) -> tuple[str, int, int]:
        """Where its hit rate is learnt: kind, level, confidence band."""
        band = min(_BANDS - 1, max(0, int(self.confidence * _BANDS)))
        return self.kind, min(max(self.level, 0), _MAX_LEVEL), band


@dataclass
class HitRates:
    """Adopted / launched per slot (``Offer.slot``), halved past ``_RATE_WINDOW`` launches."""

    counts: dict[tuple[str, int, int], list[float]] = field(default_factory=dict)

    def _counts(self, slot: tuple[str, int, int]) -> list[float]:
        counts = self.counts.get(slot)
        if counts is None:
            counts = self.counts[slot] = [0.0, 0.0]
        return counts

    def rate(self, slot: tuple[str, int, int]) -> float:
        launched, hits = self._counts(slot)
        return (hits + 1.0) / (launched + 2.0)

    def launched(self, slot: tuple[str, int, int]) -> None:
        counts = self._counts(slot)
        counts[0] += 1
        if counts[0] > _RATE_WINDOW:
            counts[0] /= 2
            counts[1] /= 2

    def hit(self, slot: tuple[str, int, int]) -> None:
        counts = self._counts(slot)
        counts[1] = min(counts[0], counts[1] + 1)

    def merge(self, counts: dict[tuple[str, int, int], tuple[float, float]]) -> None:
        """Add ``counts`` ((launched, hits) per slot: what earlier runs learnt) to this
        one's; a slot past the window halves as its own launches would have."""
        for slot, (launched, hits) in counts.items():
            mine = self._counts(slot)
            mine[0] += launched
            mine[1] = min(mine[0], mine[1] + hits)
            while mine[0] > _RATE_WINDOW:
                mine[0] /= 2
                mine[1] /= 2

    def snapshot(self) -> dict[tuple[str, int, int], tuple[float, float]]:
        """(launched, hits) per slot tried so far."""
        return {slot: (c[0], c[1]) for slot, c in self.counts.items() if c[0] > 0}

    def best(self, kind: str) -> float:
        """The best rate among ``kind``'s slots, at least the prior's even odds (most of its
        slots are never tried)."""
        return max([0.5, *(self.rate(slot) for slot in self.counts if slot[0] == kind)])
