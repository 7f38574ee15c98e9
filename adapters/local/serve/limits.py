"""Every limit of ``spec-tot serve`` in one frozen config, and the admission of work past them.

A request is refused before the engine sees it: over a per-request limit with a 400 that
names the limit (its size can never fit, so retrying is pointless); over a server-wide
in-flight limit with a 429 and ``Retry-After`` (SGLang's and vLLM's answer to a full server),
so clients back off and retry. ``Admission`` holds the server's in-flight counts: samples and
tokens of the generation and scoring requests running, and bytes of request bodies being
read, each released when its request ends however it ends (done, failed, disconnected).

One request may take at most half of the in-flight room still free (samples and tokens
alike): a client sending the largest requests it may fills at most half of what is left each
time, so requests beside them (small ones above all) always find room; a request larger than
half an idle server's room could never run, and is a 400.

A sample's tokens are its prompt plus ``max_new_tokens``, at most the engine's length limit;
a text prompt counts its UTF-8 bytes (no tokenizer yields more tokens than bytes, apart from
a few special tokens, and counting costs no tokenising on the event loop).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from spec_tot.errors import ConfigError

__all__ = ["Admission", "ServeLimits", "ServerBusy", "demand", "prompt_tokens"]

# File descriptors kept free of connections for the engine, logs and the PRM (an idle
# server holds about 10). A full table makes accept() fail, and asyncio then stops accepting
# for a second, so fresh clients time out: the cap leaves room for these and for two accept
# bursts (the listener takes up to a burst before any of them reaches the guard, and an
# evicted socket's descriptor closes one loop pass later; ``connections.Listener``).
FD_OTHER = 64


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """The server's limits; ``spec-tot serve --limit NAME=VALUE`` sets any of them.

    Per request (a 400 naming the limit): ``max_samples_per_request`` (prompts x n on
    ``/generate``, ``/v1/completions``, ``/v1/chat/completions``; prompts on ``/classify``),
    ``max_body_bytes`` (a 413), ``max_header_bytes`` and ``max_header_count`` (a 431). Server-
    wide (a 429 with ``Retry-After: retry_after_s``): ``max_inflight_samples``,
    ``max_inflight_tokens`` (a request takes at most half of what is free of each),
    ``max_buffered_body_bytes`` (bodies being read at once). Connections: at most
    ``max_connections`` (None: what the open-file limit leaves, at most 2048; see
    ``connection_plan``); when full, a new connection closes the one that has waited longest
    without a request running (half-sent headers, idle keep-alive), so floods cannot lock out
    clients that send a request. ``header_timeout_s``: a connection that has not sent a whole
    request head by then is closed; ``keep_alive_s``: an idle connection is closed;
    ``body_timeout_s``: a body not received by then is a 408. Streams: a client that leaves more
    than ``stream_buffer_bytes`` unread pauses its stream (updates coalesce: each event carries
    the sample so far); one paused for ``stream_stall_s`` is aborted, its engine work freed and
    its connection closed. Every limit has an upper bound (an hour for times, half the
    machine's RAM for byte limits, 2**20 for counts, 2**24 in-flight samples, 2**40 tokens),
    checked at start-up."""

    max_samples_per_request: int = 4096
    max_inflight_samples: int = 16384
    max_inflight_tokens: int = 32 << 20
    max_body_bytes: int = 32 << 20
    max_buffered_body_bytes: int = 256 << 20
    max_header_bytes: int = 16 << 10
    max_header_count: int = 100
    max_connections: int | None = None
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    body_timeout_s: float = 30.0
    stream_buffer_bytes: int = 1 << 20
    stream_stall_s: float = 10.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_connections":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f.name, f"must be a number, got {value!r}")
            if f.name.endswith("_s") and f.name != "retry_after_s":
                if not 0 < value < float("inf"):
                    raise ConfigError(f.name, f"must be a finite number of seconds > 0: {value}")
            elif not isinstance(value, int) or value < 1:
                raise ConfigError(f.name, f"must be an integer >= 1, got {value!r}")
            high = _upper_bound(f.name)
            if value > high:
                raise ConfigError(f.name, f"{value} is over the bound of {high}")
        if 2 * self.max_samples_per_request > self.max_inflight_samples:
            raise ConfigError(
                "max_samples_per_request",
                f"{self.max_samples_per_request} is more than half of max_inflight_samples "
                f"({self.max_inflight_samples}): such a request could never run",
            )
        if self.max_body_bytes > self.max_buffered_body_bytes:
            raise ConfigError(
                "max_body_bytes",
                f"{self.max_body_bytes} is more than max_buffered_body_bytes "
                f"({self.max_buffered_body_bytes})",
            )

    def connection_plan(self) -> tuple[int, int]:
        """``(max_connections, accept burst)``, checked against this process's open-file
        limit: connections + two accept bursts + ``FD_OTHER`` fit within it (the kernel's
        listen queue is deeper: ``connections.KERNEL_BACKLOG``)."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        backlog = max(16, min(2048, soft // 16))
        room = soft - 2 * backlog - FD_OTHER
        if self.max_connections is None:
            if room < 16:
                raise ConfigError(
                    "max_connections",
                    f"the open-file limit ({soft}) leaves no room for connections; raise it "
                    f"(ulimit -n) to at least {2 * 16 + FD_OTHER + 16}",
                )
            return min(2048, room), backlog
        if self.max_connections > room:
            raise ConfigError(
                "max_connections",
                f"{self.max_connections} connections need more file descriptors than the "
                f"open-file limit ({soft}) leaves: at most {room} (after {2 * backlog} for "
                f"accepting and {FD_OTHER} for the rest); raise ulimit -n or lower the limit",
            )
        return self.max_connections, backlog


# Upper bounds of the limits: an hour for any time, a million of any count, and for the byte
# limits that buffer bodies the machine's RAM (a body is held whole while it is read).
_MAX_SECONDS = 3600.0
_MAX_COUNT = 1 << 20
_COUNT_BOUNDS = {"max_inflight_samples": 1 << 24, "max_inflight_tokens": 1 << 40}


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: a documented stand-in
        return 64 << 30


def _upper_bound(name: str) -> float:
    if name.endswith("_s"):
        return _MAX_SECONDS
    if name.endswith("_bytes"):
        return _ram_bytes() // 2
    return _COUNT_BOUNDS.get(name, _MAX_COUNT)


class ServerBusy(Exception):
    """Past a server-wide in-flight limit: answered 429 with ``Retry-After``."""

    def __init__(self, limit: str, message: str, retry_after_s: int) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        super().__init__(f"server busy: {message} (limit {limit}); retry after {retry_after_s} s")


def prompt_tokens(prompt: str | Sequence[int]) -> int:
    """A prompt's tokens for the in-flight count: its ids, or an upper bound for text."""
    return len(prompt) if not isinstance(prompt, str) else len(prompt.encode("utf-8")) + 1


def demand(prompts: Sequence[str | Sequence[int]], max_tokens: Sequence[int], max_len: int) -> int:
    """Tokens one sample of each prompt may hold at most: its prompt plus its
    ``max_tokens``, capped at the engine's sequence length (0: no engine, prompts only)."""
    return sum(
        min(max_len, prompt_tokens(p) + m) if max_len else prompt_tokens(p)
        for p, m in zip(prompts, max_tokens, strict=True)
    )


class Admission:
    """The server's in-flight samples, tokens and body bytes (event-loop only, no locks)."""

    def __init__(self, limits: ServeLimits) -> None:
        self.limits = limits
        self.samples = 0
        self.tokens = 0
        self.body_bytes = 0

    def hold(self, samples: int, tokens: int, field: str) -> Callable[[], None]:
        """Count ``samples`` and ``tokens`` in flight; returns the release (safe to call
        twice). A request that could never fit is a ``ConfigError`` naming ``field`` and
        the limit; one that does not fit now (more than half of the room still free)
        raises ``ServerBusy``."""
        limits = self.limits
        if 2 * tokens > limits.max_inflight_tokens:
            raise ConfigError(
                field,
                f"{samples} samples reserve {tokens} tokens (prompt + max_new_tokens "
                f"each), more than half of this server's max_inflight_tokens "
                f"({limits.max_inflight_tokens})",
            )
        for limit, cap, used, asked in (
            ("max_inflight_samples", limits.max_inflight_samples, self.samples, samples),
            ("max_inflight_tokens", limits.max_inflight_tokens, self.tokens, tokens),
        ):
            if 2 * asked > cap - used:
                raise ServerBusy(
                    limit,
                    f"{used} of {cap} in flight, {asked} more asked (one request takes at "
                    "most half of what is free)",
                    limits.retry_after_s,
                )
        self.samples += samples
        self.tokens += tokens
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                self.samples -= samples
                self.tokens -= tokens

        return release

    def take_body(self, size: int) -> None:
        """``size`` more bytes of a body being read, or ``ServerBusy`` past the server's cap."""
        cap = self.limits.max_buffered_body_bytes
        if self.body_bytes + size > cap:
            raise ServerBusy(
                "max_buffered_body_bytes",
                f"{self.body_bytes} bytes of request bodies being read, at most {cap}",
                self.limits.retry_after_s,
            )
        self.body_bytes += size

    def give_body(self, size: int) -> None:
        self.body_bytes -= size
