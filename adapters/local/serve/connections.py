"""Connections of ``spec-tot serve``: a cap, and a deadline for every moment a connection
holds a file descriptor without a request running.

uvicorn closes idle keep-alive connections but never times out a connection that has not
sent a whole request head (a slowloris, or a socket that sends nothing), and past the
open-file limit ``accept()`` fails and asyncio stops accepting for a second, so fresh
clients time out. ``GuardedH11Protocol`` (uvicorn's h11 protocol with a guard) fixes both:

- ``HEAD``: from accept (or the first byte after a response) until the request head is
  whole, at most ``header_timeout_s``, and at most ``max_header_bytes``, else a 431 naming
  the limit; more than ``max_header_count`` headers is a 431 too.
- ``BUSY``: a request runs; the routes bound it (``body_timeout_s``, in-flight admission,
  stalled streams).
- ``IDLE``: after a response; uvicorn closes it after ``keep_alive_s``, and the guard drops
  it ``stream_stall_s`` later if the close still waits on a client that reads nothing.

At ``max_connections`` a new connection closes the connection that has waited longest in
``HEAD`` or ``IDLE`` (so a flood of half-open sockets only ever evicts itself); when every
connection runs a request, the new one gets a 503 and is closed. The cap is checked against
the open-file limit at start-up (``ServeLimits.connection_plan``).

Each request's ASGI scope carries ``scope["extensions"]["spec_tot.connection"]``, the
connection's handle (``abort()``, ``set_write_limit()``), which ``streams.py`` uses to pause
and drop a stream whose client does not read.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import socket
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import ServeLimits
from .outputs import error_body

__all__ = [
    "CONNECTION_KEY",
    "KERNEL_BACKLOG",
    "ConnectionGuard",
    "GuardedH11Protocol",
    "GuardedServer",
    "Listener",
    "server_config",
]

CONNECTION_KEY = "spec_tot.connection"
# h11's own bound on a request head, set far enough past ours that ours answers first (one
# read can bring up to 256 KiB: asyncio's selector transport's max read size).
_H11_SLACK = 256 << 10
# The kernel's accept queue (it clamps this to net.core.somaxconn): deep enough that a flood's
# handshakes wait there while the guard evicts, instead of the kernel dropping SYNs.
KERNEL_BACKLOG = 4096
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_RETRY_S = 0.05  # after an EMFILE from descriptors held outside the guard


class Phase(Enum):
    HEAD = "head"
    BUSY = "busy"
    IDLE = "idle"


class ConnectionGuard:
    """The server's open connections and their deadlines (event-loop only)."""

    def __init__(self, limits: ServeLimits, cap: int, burst: int = 0) -> None:
        self.limits = limits
        self.cap = cap
        self.burst = burst
        self.open = 0
        # descriptors of connections, from connection_made to connection_lost (an evicted
        # one leaves ``open`` at once, but its descriptor closes a loop pass later)
        self.fds = 0
        self.listener: Listener | None = None
        self._waiting: OrderedDict[GuardedH11Protocol, None] = OrderedDict()  # HEAD/IDLE
        self.counts = {
            "evicted": 0,
            "timed_out": 0,
            "refused": 0,
            "header_limit": 0,
            "accept_out_of_files": 0,
        }

    def opened(self, conn: GuardedH11Protocol) -> bool:
        """A new connection: False when it must be refused (every other one is busy)."""
        self.open += 1
        if self.open > self.cap:
            victim = next(iter(self._waiting), None)
            if victim is None:
                self.counts["refused"] += 1
                return False
            self.counts["evicted"] += 1
            victim.drop()
            self.closed(victim)  # its connection_lost comes on a later loop pass
        self.enter(conn, Phase.HEAD)
        return True

    def enter(self, conn: GuardedH11Protocol, phase: Phase) -> None:
        conn.cancel_timer()
        conn.phase = phase
        self._waiting.pop(conn, None)
        if phase is Phase.BUSY:
            return
        self._waiting[conn] = None  # newest last: the longest-waiting goes first
        limits = self.limits
        delay = (
            limits.header_timeout_s
            if phase is Phase.HEAD
            else limits.keep_alive_s + limits.stream_stall_s
        )
        conn.timer = conn.loop.call_later(delay, self._expire, conn)

    def closed(self, conn: GuardedH11Protocol) -> None:
        conn.cancel_timer()
        if conn.counted:
            conn.counted = False
            self.open -= 1
        self._waiting.pop(conn, None)

    def fd_room(self, pending: int) -> int:
        """Sockets ``accept()`` may take now, with ``pending`` accepted and not yet made:
        the cap, plus two bursts for refusals and evictions still closing."""
        return self.cap + 2 * self.burst - self.fds - pending

    def released(self) -> None:
        """A connection's descriptor closed."""
        self.fds -= 1
        if self.listener is not None:
            self.listener.resume()

    def _expire(self, conn: GuardedH11Protocol) -> None:
        conn.timer = None
        self.counts["timed_out"] += 1
        conn.drop()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with the guard's deadlines and limits."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.phase = Phase.HEAD
        self.timer: asyncio.TimerHandle | None = None
        self.counted = False
        self.app = functools.partial(_guarded_app, self.app, self)

    # -- the handle requests see -----------------------------------------------------------
    def drop(self) -> None:
        """Close now, unsent output and all (a client that reads nothing holds no buffer)."""
        # abort(), not close(): close() waits to flush what a non-reading client never takes.
        if self.transport is not None:
            self.transport.abort()

    def abort(self) -> None:
        self.drop()

    def set_write_limit(self, high: int) -> None:
        """Pause this response's writer once ``high`` bytes wait unsent, in the transport and
        (about as much again) in the kernel's send buffer."""
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.set_write_buffer_limits(high=high)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, high)

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.counted = True
        self.guard.fds += 1
        if not self.guard.opened(self):
            _refuse(transport, 503, "max_connections", "every connection runs a request")

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.closed(self)
        self.guard.released()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.IDLE:
            self.guard.enter(self, Phase.HEAD)  # the next request's head: its own deadline
        super().data_received(data)
        if self.phase is Phase.BUSY or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a head just completed: its request starts on the next loop pass
        pending = len(self.conn.trailing_data[0])
        limit = self.guard.limits.max_header_bytes
        if pending > limit:
            self.guard.counts["header_limit"] += 1
            _refuse(self.transport, 431, "max_header_bytes", f"request head over {limit} bytes")


class Listener:
    """Accepts from one listening socket while the guard's descriptor budget has room
    (event-loop only): at most ``guard.burst`` sockets a wake-up, none while it is full."""

    def __init__(
        self,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        guard: ConnectionGuard,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.sock = sock
        self.protocol_factory = protocol_factory
        self.guard = guard
        self.loop = loop
        self.pending = 0  # accepted, transport not made yet
        self.reading = False
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Take the socket over from asyncio's own accept loop, with the deep kernel queue."""
        self.loop.remove_reader(self.sock.fileno())
        self.sock.listen(KERNEL_BACKLOG)
        self.guard.listener = self
        self.resume()

    def resume(self) -> None:
        if self.reading or self.sock.fileno() == -1:  # -1: the server closed it
            return
        if self.guard.fd_room(self.pending) > 0:
            self.loop.add_reader(self.sock.fileno(), self._accept)
            self.reading = True

    def pause(self) -> None:
        if self.reading:
            self.reading = False
            if self.sock.fileno() != -1:
                self.loop.remove_reader(self.sock.fileno())

    def _accept(self) -> None:
        for _ in range(min(self.guard.burst, self.guard.fd_room(self.pending))):
            try:
                conn, _address = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # the queue is empty
            except OSError as exc:
                if exc.errno not in _OUT_OF_FILES:
                    raise
                # descriptors held outside the guard (engine, logs) filled the table
                self.guard.counts["accept_out_of_files"] += 1
                self.pause()
                self.loop.call_later(_RETRY_S, self.resume)
                return
            conn.setblocking(False)
            self.pending += 1
            task = self.loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self.guard.fd_room(self.pending) <= 0:
            self.pause()  # the next closed connection resumes

    async def _serve(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.protocol_factory, conn)
        except OSError:
            conn.close()  # the client left before its transport was made
        finally:
            self.pending -= 1
            self.resume()


class GuardedServer(uvicorn.Server):
    """uvicorn's server for a ``server_config`` config: it binds the socket itself and
    accepts through a ``Listener`` within the connection guard's descriptor budget."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is not None:
            raise ValueError("GuardedServer binds its own socket (from config.host/port)")
        guard = getattr(getattr(self.config.app, "state", None), "connections", None)
        if not isinstance(guard, ConnectionGuard):
            raise ValueError("GuardedServer serves a config made by server_config")
        sock = self.config.bind_socket()
        await super().startup([sock])
        config = self.config
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:  # as uvicorn's startup makes each connection's
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                _loop=loop,
            )

        Listener(sock, protocol, guard, loop).start()


async def _guarded_app(
    app: Any, conn: GuardedH11Protocol, scope: Any, receive: Any, send: Any
) -> None:
    """Each request of ``conn``: ``BUSY`` while it runs, its head's size and header count
    checked (a head that arrived whole in one read never waited in ``HEAD``)."""
    guard = conn.guard
    limits = guard.limits
    guard.enter(conn, Phase.BUSY)
    try:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = len(scope.get("raw_path") or b"") + sum(len(k) + len(v) + 4 for k, v in headers)
            refusal = None
            if len(headers) > limits.max_header_count:
                refusal = ("max_header_count", f"{len(headers)} headers")
            elif size > limits.max_header_bytes:
                refusal = ("max_header_bytes", f"request head over {limits.max_header_bytes} bytes")
            if refusal is not None:
                guard.counts["header_limit"] += 1
                await _send_error(send, 431, *refusal)
                return
        scope["extensions"] = {**(scope.get("extensions") or {}), CONNECTION_KEY: conn}
        await app(scope, receive, send)
    finally:
        if not conn.transport.is_closing():
            guard.enter(conn, Phase.IDLE)


def _error_json(status: int, limit: str, message: str) -> bytes:
    return json.dumps(error_body(f"{message} (limit {limit})", limit, status)).encode()


async def _send_error(send: Any, status: int, limit: str, message: str) -> None:
    body = _error_json(status, limit, message)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _refuse(transport: asyncio.Transport, status: int, limit: str, message: str) -> None:
    """Answer outside any request (the head is not whole, or there is no room), then close."""
    body = _error_json(status, limit, message)
    reason = {431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}[status]
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\nretry-after: 1\r\n\r\n" % (status, reason, len(body))
    )
    transport.write(head + body)
    if transport.get_write_buffer_size():
        transport.abort()
    else:
        transport.close()


def server_config(
    app: Any,
    *,
    host: str,
    port: int,
    limits: ServeLimits | None = None,
    log_level: str = "warning",
    **options: Any,
) -> uvicorn.Config:
    """A ``uvicorn.Config`` that serves ``app`` with the guarded protocol and ``limits``
    (default: the app's own, ``app.state.serve.limits``)."""
    if limits is None:
        limits = app.state.serve.serve_limits
    cap, backlog = limits.connection_plan()
    guard = ConnectionGuard(limits, cap, burst=backlog)
    app.state.connections = guard
    app.state.serve.connections = guard
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=functools.partial(GuardedH11Protocol, guard=guard),  # type: ignore[arg-type]
        ws="none",  # no WebSocket routes: an upgrade must not leave the guard
        h11_max_incomplete_event_size=limits.max_header_bytes + _H11_SLACK,
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        backlog=backlog,
        **options,
    )
