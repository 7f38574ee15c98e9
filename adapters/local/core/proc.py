"""The backend's end of an engine core: a child process (``ProcessLink``) or a worker
thread (``ThreadLink``), both speaking the typed messages of ``messages.py``.

A link delivers every output to ``on_output(link, output)`` and its end to ``on_exit(link,
error)`` (``error`` None when it was closed on purpose), from its own thread, never from
the caller's event loop; ``send`` only queues, so no event loop ever waits for a core.

``ProcessLink``: a writer thread sends the commands queued since its last frame as one
frame; a reader thread decodes the core's outputs. When the socket closes without a
``close()`` the core died: ``on_exit`` gets a ``BackendError`` that says so, with the exit
code (from the fork server, or the process handle). Cores are forked from one warm fork
server per process (``ForkServer.shared``) or spawned as fresh interpreters.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from spec_tot.errors import BackendError

from ..config import CoreOptions
from .fork_server import CORE_MODULE, ForkServer
from .messages import (
    CommandCodec,
    Fatal,
    OutputCodec,
    Ready,
    Start,
    StartFailed,
    Stop,
)

__all__ = [
    "CoreLink",
    "ProcessLink",
    "ThreadLink",
    "default_threads",
    "describe_exit",
    "start_link",
    "usable_cores",
]

OnOutput = Callable[["CoreLink", Any], None]
OnExit = Callable[["CoreLink", BaseException | None], None]
_CLOSE_S = 10.0


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads(split: bool = False, caller_core: bool = True) -> tuple[int, int]:
    """Torch threads for the engine child and for the PRM's (``split``: the PRM has a child
    of its own; else both run in the engine's child, the first figure).

    ``caller_core``: every core but one, which stays for the caller (its executor and
    search run Python beside the engine; measured on 2 cores, the main job at 32 queries: 1
    thread 1.31x the in-thread engine, 2 threads 1.19x); split, a third of them for the PRM
    (it scores short traces in few batches) and the rest for the engine, at least one each.
    Without it (``spec-tot serve``: the caller only moves HTTP) the engine gets every core
    (SmolLM2 through ``/v1/completions`` on 2 cores: 2 threads 1.14x one at one request,
    1.45x at eight) and a split PRM a third of them, at least one: it scores only when a
    client asks, so the two rarely compete."""
    cores = usable_cores()
    if caller_core:
        spare = max(1, cores - 1)
        if not split:
            return spare, spare
        prm = max(1, spare // 3)
        return max(1, spare - prm), prm
    return cores, max(1, cores // 3) if split else cores


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class CoreLink(ABC):
    """A started core. ``ready`` is what it reported when it came up."""

    ready: Ready
    pid: int

    @property
    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def send(self, command: Any) -> bool:
        """Queue ``command`` (never blocks); False when the core is gone."""

    @abstractmethod
    def close(self, timeout: float = _CLOSE_S) -> None:
        """Stop the core (every request in flight fails with "backend closed") and wait
        for it; one that does not stop in ``timeout`` seconds is killed."""


def start_link(
    start: Start, options: CoreOptions, on_output: OnOutput, on_exit: OnExit
) -> CoreLink:
    """Start a core as ``options`` say and wait until it is ready (its start error is
    raised here: a ``ConfigError`` naming the field for a bad folder or option)."""
    if options.process:
        return ProcessLink(start, options, on_output, on_exit)
    return ThreadLink(start, on_output, on_exit)


# -- in the caller's process ---------------------------------------------------------------
class _QueueInbox:
    def __init__(self, commands: queue.SimpleQueue[Any]) -> None:
        self.commands = commands

    def take(self, timeout: float | None) -> list[Any] | None:
        out = []
        try:
            out.append(self.commands.get(block=timeout != 0, timeout=timeout or None))
            while True:
                out.append(self.commands.get_nowait())
        except queue.Empty:
            pass
        return out


class ThreadLink(CoreLink):
    """The core on a worker thread of this process (``process=False``): the same core and
    messages without encoding; it shares the GIL with the caller."""

    def __init__(self, start: Start, on_output: OnOutput, on_exit: OnExit) -> None:
        from .engine_core import EngineCore

        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.core = EngineCore(start, lambda output: on_output(self, output))
        self.ready = self.core.ready()
        self.pid = os.getpid()
        self._on_exit = on_exit
        self._done = False
        self._thread = threading.Thread(target=self._run, name="spec-tot-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            self.core.run(_QueueInbox(self._commands))
        except BaseException as exc:  # the loop itself broke: every waiter must hear of it
            error = BackendError("local", f"the engine thread died: {exc!r}")
        self._done = True
        self._on_exit(self, error)

    @property
    def alive(self) -> bool:
        return not self._done

    def send(self, command: Any) -> bool:
        if self._done:
            return False
        self._commands.put(command)
        return True

    def close(self, timeout: float = _CLOSE_S) -> None:
        self.send(Stop())
        self._thread.join(timeout)


# -- in a child process --------------------------------------------------------------------
class ProcessLink(CoreLink):
    def __init__(
        self, start: Start, options: CoreOptions, on_output: OnOutput, on_exit: OnExit
    ) -> None:
        mine, theirs = socket.socketpair()
        self._popen: subprocess.Popen[bytes] | None = None
        self._server: ForkServer | None = None
        try:
            if ForkServer.forks(options):
                self._server = ForkServer.shared()
                self.pid = self._server.fork(theirs, options.start_timeout_s)
            else:
                self._popen = subprocess.Popen(
                    [sys.executable, "-m", CORE_MODULE, "--core", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                )
                self.pid = self._popen.pid
        finally:
            theirs.close()
        self._conn = Connection(mine.detach())
        self._outputs = OutputCodec()
        self._commands = CommandCodec()
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_output = on_output
        self._on_exit = on_exit
        self._closing = self._dead = False
        self.ready = self._handshake(start, options.start_timeout_s)
        self._reader = threading.Thread(target=self._read, name="spec-tot-core-rx", daemon=True)
        self._writer = threading.Thread(target=self._write, name="spec-tot-core-tx", daemon=True)
        self._reader.start()
        self._writer.start()

    def _handshake(self, start: Start, timeout: float) -> Ready:
        try:
            self._conn.send_bytes(self._commands.encode([start]))
            if not self._conn.poll(timeout):
                raise BackendError("local", f"the engine process gave no sign in {timeout:.0f} s")
            reply = self._outputs.decode(self._conn.recv_bytes())
        except (EOFError, OSError, msgspec.DecodeError) as exc:
            self._kill()
            code = self._exit_code(2.0)
            raise BackendError(
                "local", f"the engine process (pid {self.pid}) ended as it started "
                f"({describe_exit(code)}): {exc!r}"
            ) from None  # fmt: skip
        except BaseException:
            self._kill()
            raise
        if isinstance(reply, StartFailed):
            self._conn.close()
            raise reply.error.to_exception()
        if not isinstance(reply, Ready):
            self._kill()
            raise BackendError("local", f"the engine process answered {type(reply).__name__}")
        return reply

    @property
    def alive(self) -> bool:
        return not self._dead

    def send(self, command: Any) -> bool:
        if self._dead:
            return False
        self._outbox.put(command)
        return True

    def _write(self) -> None:
        while True:
            batch = [self._outbox.get()]
            try:
                while True:
                    batch.append(self._outbox.get_nowait())
            except queue.Empty:
                pass
            try:
                self._conn.send_bytes(self._commands.encode(batch))
            except OSError:  # the core is gone: the reader reports it
                return
            if any(isinstance(c, Stop) for c in batch):
                return

    def _read(self) -> None:
        fatal = None
        while True:
            try:
                output = self._outputs.decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            if isinstance(output, Fatal):
                fatal = output.error.message
                continue
            self._on_output(self, output)
        self._dead = True
        self._outbox.put(Stop())  # frees the writer
        if self._closing:
            self._on_exit(self, None)
            return
        code = self._exit_code(2.0)
        why = f": {fatal}" if fatal else ""
        self._on_exit(
            self,
            BackendError(
                "local", f"the engine process (pid {self.pid}) died ({describe_exit(code)}){why}"
            ),
        )

    def close(self, timeout: float = _CLOSE_S) -> None:
        self._closing = True
        self.send(Stop())
        self._reader.join(timeout)
        if self._reader.is_alive():
            self._kill()
            self._reader.join(timeout)
        self._exit_code(timeout)
        self._conn.close()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def _exit_code(self, timeout: float) -> int | None:
        if self._popen is not None:
            try:
                return self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        assert self._server is not None  # internal: one of the two started it
        return self._server.exit_code(self.pid, timeout)
