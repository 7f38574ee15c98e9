"""The warm process that forks engine cores, one per process (``ForkServer.shared``)."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading

import msgspec

from spec_tot.errors import BackendError

from ..config import CoreOptions
from .messages import Exited, Forked, ForkRequest, ForkServerMessage

__all__ = ["CORE_MODULE", "ForkServer"]

CORE_MODULE = "spec_tot.adapters.local.core.core_process"


class ForkServer:
    """A warm process that forks engine cores (``core_process.fork_server``).

    One per process (``shared``), like ``multiprocessing``'s fork server: every backend
    of the process forks from it, so only the first start pays the imports. A fork server
    that died is replaced on the next ``shared`` call; one inherited through ``os.fork``
    belongs to the parent, and the child gets its own.
    """

    _lock = threading.Lock()
    _by_pid: dict[int, ForkServer] = {}  # noqa: RUF012 - one per process, by design

    @staticmethod
    def forks(options: CoreOptions) -> bool:
        """Whether cores of ``options`` are forked from a fork server."""
        if options.launcher == "auto":
            return sys.platform.startswith("linux")
        return options.launcher == "fork"

    @classmethod
    def shared(cls) -> ForkServer:
        with cls._lock:
            server = cls._by_pid.get(os.getpid())
            if server is None or not server.alive:
                server = cls._by_pid[os.getpid()] = cls()
            return server

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-m", CORE_MODULE, "--fork-server", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self.pid = self._popen.pid
        self._sock = mine
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(ForkServerMessage).decode  # type: ignore[valid-type]
        self._fork_lock = threading.Lock()
        self._forked: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._codes: dict[int, int] = {}
        self._ended = threading.Condition()
        self._dead = False
        threading.Thread(target=self._read, name="spec-tot-forkserver", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._dead

    def fork(self, core_socket: socket.socket, timeout: float) -> int:
        """Fork a core that serves ``core_socket``; its pid."""
        request = ForkRequest(dict(os.environ), os.getcwd(), list(sys.path))
        with self._fork_lock:
            try:
                socket.send_fds(self._sock, [self._encode(request)], [core_socket.fileno()])
                return self._forked.get(timeout=timeout)
            except (OSError, queue.Empty) as exc:
                self._dead = True
                raise BackendError("local", f"the engine fork server failed: {exc!r}") from None

    def exit_code(self, pid: int, timeout: float) -> int | None:
        with self._ended:
            self._ended.wait_for(lambda: pid in self._codes or self._dead, timeout)
            return self._codes.pop(pid, None)

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            message = self._decode(data)
            if isinstance(message, Forked):
                self._forked.put(message.pid)
            elif isinstance(message, Exited):
                with self._ended:
                    self._codes[message.pid] = message.code
                    self._ended.notify_all()
        with self._ended:
            self._dead = True
            self._ended.notify_all()
