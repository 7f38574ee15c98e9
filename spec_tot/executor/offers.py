"""What a speculative candidate is (``Offer``) and how often each kind of candidate is
needed (``HitRates``): the dispatcher's vocabulary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["HitRates", "Offer", "Slot", "SlotCounts"]

_MAX_LEVEL = 8  # levels past this share one hit rate
_BANDS = 4  # confidence bands of the predictor's own estimate
_RATE_WINDOW = 512  # hit-rate counts halve past this many launches: recent behaviour wins


Slot = tuple[str, int, int]
# Per slot: launched, hits, hits whose head start was measured, and the sum of the share of
# its expected saving each of those realised.
SlotCounts = tuple[float, float, float, float]


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
    def slot(self) -> Slot:
        """Where its hit rate is learnt: kind, level, confidence band."""
        band = min(_BANDS - 1, max(0, int(self.confidence * _BANDS)))
        return self.kind, min(max(self.level, 0), _MAX_LEVEL), band


@dataclass
class HitRates:
    """Per slot (``Offer.slot``): adopted / launched, and the share of a hit's expected
    saving that hits realise (``realised``); halved past ``_RATE_WINDOW`` launches."""

    counts: dict[Slot, list[float]] = field(default_factory=dict)

    def _counts(self, slot: Slot) -> list[float]:
        counts = self.counts.get(slot)
        if counts is None:
            counts = self.counts[slot] = [0.0, 0.0, 0.0, 0.0]
        return counts

    def rate(self, slot: Slot) -> float:
        launched, hits, _, _ = self._counts(slot)
        return (hits + 1.0) / (launched + 2.0)

    def realised(self, slot: Slot) -> float:
        """The share of its expected saving a hit in ``slot`` realises, from a prior of one
        whole saving. A hit is mostly adopted soon after it started: the committed search
        was about to start it (measured on Game of 24: hits realised a quarter of the
        saving a whole generation's time promised, at 1 and at 4 in flight)."""
        _, _, measured, total = self._counts(slot)
        return (total + 1.0) / (measured + 1.0)

    def launched(self, slot: Slot) -> None:
        counts = self._counts(slot)
        counts[0] += 1
        _window(counts)

    def hit(self, slot: Slot, realised: float | None = None) -> None:
        """A hit in ``slot``; ``realised``: the share of its expected saving it realised."""
        counts = self._counts(slot)
        counts[1] = min(counts[0], counts[1] + 1)
        if realised is not None:
            counts[2] += 1
            counts[3] += min(max(realised, 0.0), 1.0)

    def merge(self, counts: dict[Slot, SlotCounts]) -> None:
        """Add ``counts`` (what earlier runs learnt) to this one's; a slot past the window
        halves as its own launches would have."""
        for slot, theirs in counts.items():
            mine = self._counts(slot)
            for i, value in enumerate(theirs):
                mine[i] += value
            mine[1] = min(mine[0], mine[1])
            _window(mine)

    def snapshot(self) -> dict[Slot, SlotCounts]:
        """The counts of every slot tried so far."""
        return {slot: (c[0], c[1], c[2], c[3]) for slot, c in self.counts.items() if c[0] > 0}

    def best(self, kind: str) -> float:
        """The best rate among ``kind``'s slots, at least the prior's even odds (most of its
        slots are never tried)."""
        return max([0.5, *(self.rate(slot) for slot in self.counts if slot[0] == kind)])


def _window(counts: list[float]) -> None:
    """Halve a slot's counts past the window: recent behaviour wins."""
    while counts[0] > _RATE_WINDOW:
        for i in range(len(counts)):
            counts[i] /= 2
