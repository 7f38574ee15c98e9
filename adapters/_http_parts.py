"""Pieces of the HTTP client kept apart from the pool: its config, the circuit breaker, a
worker's record (load, learned speed, the deadlines armed on it), sticky routing, and the two
protocol facts a deadline needs, for SGLang's native API and OpenAI's: a request's token
budget and a reply's output tokens."""

from __future__ import annotations

import asyncio
import json
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from spec_tot.errors import ConfigError

__all__ = [
    "CircuitBreaker",
    "Endpoint",
    "HttpConfig",
    "Probing",
    "Routing",
    "completion_tokens",
    "request_budget",
]

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """Per-request deadline: ``deadline_floor_s + deadline_slack * budget * s_per_token``,
    at most ``deadline_cap_s``, where ``budget`` is the request's output-token limit and
    ``s_per_token`` the worker's learned speed (``assumed_s_per_token`` until it answered
    once). A request with no budget (classify, abort) gets the floor. ``health_path``: what
    the timed probe of an open breaker requests (None: probe only with traffic)."""

    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # between two bytes; deadlines bound the whole request
    max_retries: int = 3  # extra attempts after the first one
    backoff_base_s: float = 0.05
    backoff_max_s: float = 2.0
    breaker_threshold: int = 3  # consecutive failures that open a worker's breaker
    breaker_cooldown_s: float = 5.0
    max_concurrency: int = 512  # per worker; above it callers queue here, not in the server
    affinity_size: int = 65_536  # remembered query -> worker homes (LRU)
    deadline_floor_s: float = 30.0
    deadline_slack: float = 4.0
    deadline_cap_s: float = 600.0
    assumed_s_per_token: float = 0.1  # 10 tokens/s: slow on purpose, until measured
    speed_weight: float = 0.2  # weight of each new speed sample (exponential smoothing)
    health_path: str | None = "/health"
    probe_timeout_s: float = 5.0
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("max_retries", "breaker_threshold", "max_concurrency", "affinity_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(name, f"must be an integer, got {value!r}")
        if self.max_retries < 0:
            raise ConfigError("max_retries", f"must be >= 0, got {self.max_retries}")
        for name in ("breaker_threshold", "max_concurrency", "affinity_size"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in (
            "connect_timeout_s", "read_timeout_s", "backoff_base_s", "backoff_max_s",
            "breaker_cooldown_s", "deadline_floor_s", "deadline_slack", "deadline_cap_s",
            "assumed_s_per_token", "speed_weight", "probe_timeout_s",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(name, f"must be a number > 0, got {value!r}")
        if self.deadline_cap_s < self.deadline_floor_s:
            raise ConfigError("deadline_cap_s", "must be >= deadline_floor_s")
        if self.speed_weight > 1:
            raise ConfigError("speed_weight", f"must be in (0, 1], got {self.speed_weight}")
        if self.health_path is not None and not str(self.health_path).startswith("/"):
            raise ConfigError("health_path", f"must start with '/', got {self.health_path!r}")
        if self.api_key is not None and (
            not isinstance(self.api_key, str)
            or not self.api_key.strip()
            or any(c in self.api_key for c in "\r\n")
        ):
            raise ConfigError("api_key", "must be a non-empty string on one line")


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


class Routing:
    """Sticky routing by query key (its prefix cache lives on one worker), over the pool's
    ``urls``/``endpoints``; the key -> worker homes are an LRU of ``affinity_size``."""

    urls: list[str]
    endpoints: dict[str, Endpoint]
    config: HttpConfig
    _home: OrderedDict[str, str]
    _homed: Counter[str]

    def candidates(self, key: str | None) -> list[Endpoint]:
        """Workers to try, best first: the key's home if healthy, then the least loaded."""
        healthy = [e for e in self.endpoints.values() if e.breaker.available()]
        # New queries go to the least busy worker, then the one homing fewest queries.
        healthy.sort(key=lambda e: (e.inflight, self._homed[e.url], self.urls.index(e.url)))
        home = self._home.get(key) if key is not None else None
        if home is not None:
            self._home.move_to_end(key)  # type: ignore[arg-type]
            first = [e for e in healthy if e.url == home]
            healthy = first + [e for e in healthy if e.url != home]
        return healthy

    def home_of(self, key: str) -> str | None:
        return self._home.get(key)

    def _settle(self, key: str | None, endpoint: Endpoint) -> None:
        if key is None:
            return
        old = self._home.get(key)
        if old != endpoint.url:
            if old is not None:
                self._homed[old] -= 1
            self._homed[endpoint.url] += 1
        self._home[key] = endpoint.url
        self._home.move_to_end(key)
        while len(self._home) > self.config.affinity_size:
            self._homed[self._home.popitem(last=False)[1]] -= 1

    def forget(self, key: str) -> None:
        old = self._home.pop(key, None)
        if old is not None:
            self._homed[old] -= 1


class Probing:
    """Timed health probes of open breakers, so a worker that comes back is taken back
    without waiting for traffic to try it."""

    endpoints: dict[str, Endpoint]
    config: HttpConfig
    sleep: Callable[[float], Awaitable[None]]
    clock: Clock
    _headers: dict[str, str]
    _prober: asyncio.Task[None] | None

    @property
    def http(self) -> httpx.AsyncClient:
        raise NotImplementedError

    def _watch(self) -> None:
        """Start the timed probe of open breakers, unless it runs or is turned off."""
        if self.config.health_path is None or (self._prober and not self._prober.done()):
            return
        self._prober = asyncio.get_running_loop().create_task(self._probe_open())

    async def _probe_open(self) -> None:
        """While some breaker is open: at each cooldown's end, probe the worker's health
        endpoint (claiming the one half-open probe); an answer closes the breaker, silence
        or a 5xx reopens it for another cooldown."""
        while True:
            opened = [e for e in self.endpoints.values() if e.breaker.opened_at is not None]
            if not opened:
                return
            due = min(e.breaker.opened_at or 0.0 for e in opened) + self.config.breaker_cooldown_s
            # Never spin: a probe claimed by traffic is waited for at a tenth of a cooldown.
            await self.sleep(max(due - self.clock(), self.config.breaker_cooldown_s / 10))
            ready = [e for e in opened if e.breaker.acquire()]
            await asyncio.gather(*(self._probe(e) for e in ready))

    async def _probe(self, endpoint: Endpoint) -> None:
        assert self.config.health_path is not None
        try:
            response = await self.http.get(
                endpoint.url + self.config.health_path,
                headers=self._headers,
                timeout=self.config.probe_timeout_s,
            )
        except httpx.HTTPError:
            endpoint.breaker.failure()
            return
        if response.status_code >= 500:
            endpoint.breaker.failure()
        else:  # any answer below 500, a 404 included, is a live server
            endpoint.breaker.success()


def request_budget(body: Any) -> int | None:
    """The most output tokens a request body asks for: SGLang's
    ``sampling_params.max_new_tokens`` (one dict, or one per prompt of a batch: the largest)
    or OpenAI's ``max_tokens`` / ``max_completion_tokens``. Samples and prompts of one
    request run side by side, so their count does not multiply it. None for a body that
    generates nothing (classify, abort, pooling)."""
    if not isinstance(body, dict):
        return None
    params = body.get("sampling_params")
    per_prompt = params if isinstance(params, list) else [params]
    values = [p.get("max_new_tokens") for p in per_prompt if isinstance(p, dict)]
    values.append(body.get("max_tokens", body.get("max_completion_tokens")))
    budgets = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return max(budgets) if budgets else None


def completion_tokens(response: httpx.Response) -> float | None:
    """Output tokens per sample of a reply whose body was read (SGLang: the longest
    ``meta_info.completion_tokens``; OpenAI: ``usage.completion_tokens`` over the choices);
    None for a streamed or unrecognised reply."""
    try:
        raw = response.content
    except httpx.ResponseNotRead:
        return None  # streamed: the caller may report it with EndpointPool.observe
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    if isinstance(value, dict) and isinstance(value.get("usage"), dict):
        total = value["usage"].get("completion_tokens")
        choices = value.get("choices")
        per = len(choices) if isinstance(choices, list) and choices else 1
        return float(total) / per if isinstance(total, int | float) else None
    items = value if isinstance(value, list) else [value]
    counts = [
        item["meta_info"].get("completion_tokens")
        for item in items
        if isinstance(item, dict) and isinstance(item.get("meta_info"), dict)
    ]
    numbers = [float(c) for c in counts if isinstance(c, int | float)]
    return max(numbers) if numbers else None
