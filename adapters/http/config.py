"""The HTTP client's settings (``HttpConfig``: timeouts, retries, breaker, deadlines, the
API key) and how a backend factory takes them out of its keyword options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spec_tot.errors import ConfigError

__all__ = ["HttpConfig", "split_http_options"]


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """Per-request deadline: ``deadline_floor_s + deadline_slack * budget * s_per_token``,
    at most ``deadline_cap_s``, where ``budget`` is the request's output-token limit and
    ``s_per_token`` the worker's learned speed (``assumed_s_per_token`` until it answered
    once). A request with no budget (classify, abort) gets the floor. ``health_path``: what
    the timed probe of an open breaker requests (None: probe only with traffic).

    ``stall_s``: a worker that holds requests and has not said a word for this long (no
    reply opened or finished) has its health checked, every ``stall_s / 9`` seconds while
    it stays silent; no answer within ``probe_timeout_s`` and it is declared stopped: its
    breaker opens and every request on it is released at once, to another worker or failed
    with an error naming its URL and what was seen (with the defaults, within 55 s of its
    last word; a deadline alone could take ``deadline_cap_s``). Above 30 s on purpose: a
    server paused and continued within that loses nothing. None: never (deadlines only)."""

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
    stall_s: float | None = 45.0
    # Where a worker publishes its running and waiting requests (every client's): the work
    # ahead of a request and the engine's load (``queues.py``): its Prometheus page (vLLM's
    # and SGLang's names), else SGLang's /v1/loads; None: do not read that one.
    metrics_path: str | None = "/metrics"
    loads_path: str | None = "/v1/loads?include=core"
    # How often it is read while requests wait there, or all along once a backend follows
    # it for its dispatcher; 0: never.
    queue_poll_s: float = 0.5
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
        for name in ("health_path", "metrics_path", "loads_path"):
            path = getattr(self, name)
            if path is not None and not str(path).startswith("/"):
                raise ConfigError(name, f"must start with '/', got {path!r}")
        stall = self.stall_s
        if stall is not None and (
            isinstance(stall, bool) or not isinstance(stall, int | float) or not stall > 0
        ):
            raise ConfigError("stall_s", f"must be a number > 0 or None, got {stall!r}")
        poll = self.queue_poll_s
        if isinstance(poll, bool) or not isinstance(poll, int | float) or not poll >= 0:
            raise ConfigError("queue_poll_s", f"must be a number >= 0, got {poll!r}")
        if self.api_key is not None and (
            not isinstance(self.api_key, str)
            or not self.api_key.strip()
            or any(c in self.api_key for c in "\r\n")
        ):
            raise ConfigError("api_key", "must be a non-empty string on one line")


def split_http_options(options: dict[str, Any]) -> HttpConfig:
    """Take ``http=HttpConfig(...)`` or loose HttpConfig fields out of factory options."""
    given = options.pop("http", None)
    if isinstance(given, HttpConfig):
        return given
    if given is not None:
        raise ConfigError("http", f"expected an HttpConfig, got {type(given).__name__}")
    fields = {k: options.pop(k) for k in list(options) if k in HttpConfig.__dataclass_fields__}
    return HttpConfig(**fields)
