"""One worker as the pool sees it: its breaker and slots, its load, its learned speed and
the deadlines armed on it. The ``Endpoint`` owns these figures: the pool, the prober and
the queue reader change them only through its methods (``tests/core/test_ownership.py``)."""

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
    # learned: output tokens a second of all requests in flight here together, smoothed
    tokens_per_s: float | None = None
    # running + waiting requests the server last published (every client's); None: unknown
    reported_queue: float | None = None
    busy_misses: int = 0  # deadlines missed while the worker's health check answered
    # The deadline of each request in flight here -> its due time (loop clock), so that a
    # worker found stopped releases them all at once instead of each waiting its own out.
    pending: dict[asyncio.Timeout, float] = field(default_factory=dict)
    # The output-token budget of each request in flight here, and their sum (kept as they
    # come and go: a deadline reads it per request): the work ahead of a new one.
    budgets: dict[object, int] = field(default_factory=dict)
    queued_tokens: int = 0
    # The pool's clock when a reply last opened or finished here (or its health answered),
    # restarted when a request arrives at an idle worker: how long it has kept its requests
    # without a word.
    last_progress: float | None = None
    # Why its requests were released (it stopped answering), until it answers again.
    stopped_reason: str | None = None

    def __repr__(self) -> str:
        return f"Endpoint({self.url!r}, {self.breaker.state}, inflight={self.inflight})"

    def observe(self, tokens: float, seconds: float, weight: float, concurrent: int = 1) -> None:
        """Learn from one finished request (queueing and prefill included, so a loaded
        worker is seen as slower: its deadlines grow with its load). ``concurrent``: the
        requests in flight here with it, which shared the worker's throughput."""
        sample = seconds / max(tokens, 1.0)
        if self.s_per_token is None:
            self.s_per_token = sample
        else:
            self.s_per_token += weight * (sample - self.s_per_token)
        rate = max(concurrent, 1) / max(sample, 1e-6)
        if self.tokens_per_s is None:
            self.tokens_per_s = rate
        else:
            self.tokens_per_s += weight * (rate - self.tokens_per_s)

    def seconds_for(self, budget: int, assumed_s_per_token: float) -> float:
        """Seconds until a new request of ``budget`` output tokens is done here: alone at the
        learned speed, or, when longer, behind the work ahead at the learned throughput."""
        per_token = self.s_per_token or assumed_s_per_token
        rate = self.tokens_per_s or 1.0 / assumed_s_per_token
        return max(budget * per_token, (self.tokens_ahead(budget) + budget) / rate)

    # -- a request's life here ---------------------------------------------------------------
    def available(self) -> bool:
        """May traffic be sent here now? A worker found stopped is taken back only by the
        timed health probe: a request sent as its half-open probe would hang there."""
        return self.stopped_reason is None and self.breaker.available()

    def claim(self) -> bool:
        """Claim the right to send here (the half-open probe included; see ``available``)."""
        return self.stopped_reason is None and self.breaker.acquire()

    def count_attempt(self) -> None:
        """A send right on this worker was claimed for an attempt."""
        self.attempts += 1

    def begin(self, timer: asyncio.Timeout, due: float, budget: int, now: float) -> None:
        """A request of ``budget`` output tokens is in flight here under ``timer``, due at
        ``due`` (loop clock); ``now``: the pool's clock."""
        if not self.inflight:
            self.last_progress = now  # an idle worker owed nothing until now
        self.inflight += 1
        self.pending[timer] = due
        self.hold(timer, budget)

    def disarm(self, timer: asyncio.Timeout) -> None:
        """``timer`` no longer waits here (it fired): a stopped worker will not release it."""
        self.pending.pop(timer, None)

    def end(self, timer: asyncio.Timeout) -> None:
        """The request of ``timer`` left this worker (done, failed or cancelled)."""
        self.disarm(timer)
        self.drop(timer)
        self.inflight -= 1

    def hold(self, key: object, budget: int) -> None:
        """A request of ``budget`` output tokens is in flight here (``key``: its own)."""
        self.budgets[key] = budget
        self.queued_tokens += budget

    def drop(self, key: object) -> None:
        self.queued_tokens -= self.budgets.pop(key, 0)

    # -- what was seen of the worker ------------------------------------------------------------
    def progressed(self, now: float) -> None:
        """A reply opened or finished here, or its health check answered."""
        self.last_progress = now
        self.stopped_reason = None

    def silent_s(self, now: float) -> float:
        """Seconds this worker has held requests without a word (0 when it holds none)."""
        if not self.inflight or self.last_progress is None:
            return 0.0
        return max(0.0, now - self.last_progress)

    def declare_stopped(self, reason: str, loop_now: float) -> int:
        """It stopped answering (``reason``: what was seen): its breaker opens and every
        request waiting on it is released now. Returns how many were released."""
        self.stopped_reason = reason
        self.breaker.trip()
        return self.release(loop_now)

    def count_miss(self, *, busy: bool = False) -> None:
        """A request missed its deadline here; ``busy``: judged afterwards a busy worker
        (its health check answered), not a dead one."""
        if busy:
            self.busy_misses += 1
        else:
            self.timeouts += 1

    def report_queue(self, queue: float | None) -> None:
        """The running + waiting requests the server published (None: unknown now, or the
        worker idle: never a stale figure)."""
        self.reported_queue = queue

    def tokens_ahead(self, budget: int) -> float:
        """Output tokens the worker has to produce before a new request of ``budget`` is
        done: our own requests in flight here, or the server's published queue (every
        client's) at their mean budget when it is longer."""
        own = float(self.queued_tokens)
        mean = own / len(self.budgets) if self.budgets else float(budget)
        return max(own, (self.reported_queue or 0.0) * mean)

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
