"""One worker as the pool sees it: its breaker and slots, its load, its learned speed and
the deadlines armed on it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .breaker import CircuitBreaker

__all__ = ["Endpoint"]


@dataclass
class Endpoint:
    """One worker: its breaker and slots, and what the pool learned about it."""

    url: str
    breaker: CircuitBreaker
    semaphore: asyncio.Semaphore
    inflight: int = 0
    attempts: int = 0  # every send attempt, for tests and stats
    timeouts: int = 0  # requests that missed their deadline here
    s_per_token: float | None = None  # learned: seconds per output token, smoothed
    # The deadline of each request in flight here -> its due time (loop clock), so that a
    # worker found stopped releases them all at once instead of each waiting its own out.
    pending: dict[asyncio.Timeout, float] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Endpoint({self.url!r}, {self.breaker.state}, inflight={self.inflight})"

    def observe(self, tokens: float, seconds: float, weight: float) -> None:
        """Learn from one finished request (queueing and prefill included, so a loaded
        worker is seen as slower: its deadlines grow with its load)."""
        sample = seconds / max(tokens, 1.0)
        if self.s_per_token is None:
            self.s_per_token = sample
        else:
            self.s_per_token += weight * (sample - self.s_per_token)

    def release(self, now: float) -> int:
        """Expire every deadline armed here now; the requests give up on this worker.
        Returns how many were released (one already expiring is left to finish)."""
        released = 0
        for timer in list(self.pending):
            try:
                timer.reschedule(now)
            except RuntimeError:
                continue
            released += 1
        return released
