"""A worker's circuit breaker: closed, open after k consecutive failures, half-open (one
probe) after a cooldown."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CircuitBreaker", "Clock"]

Clock = Callable[[], float]


@dataclass
class CircuitBreaker:
    """closed -> (k consecutive failures, timeouts included) -> open -> (cooldown) ->
    half-open: one probe (a request, or the pool's timed health probe). The probe's success
    closes the breaker; its failure reopens it for another cooldown."""

    threshold: int
    cooldown_s: float
    clock: Clock
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.cooldown_s else "open"

    def available(self) -> bool:
        """May a request be sent now? (Does not claim the half-open probe.)"""
        state = self.state
        return state == "closed" or (state == "half_open" and not self.probing)

    def acquire(self) -> bool:
        """Claim the right to send; in half-open only one caller gets it (the probe)."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self.probing:
            self.probing = True
            return True
        return False

    def trip(self) -> None:
        """Open now, whatever the count: the worker was seen stopped."""
        self.failures = max(self.failures, self.threshold)
        self.probing = False
        self.opened_at = self.clock()

    def abandon_probe(self) -> None:
        """The half-open probe was cancelled before any reply: another caller may probe."""
        self.probing = False

    def success(self) -> None:
        self.failures, self.opened_at, self.probing = 0, None, False

    def failure(self) -> bool:
        """Count a failure; True when this one opened a closed breaker."""
        was_closed = self.opened_at is None
        self.failures += 1
        self.probing = False
        if self.opened_at is not None or self.failures >= self.threshold:
            self.opened_at = self.clock()
        return was_closed and self.opened_at is not None
