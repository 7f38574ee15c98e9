"""The engine core's own process: ``python -m spec_tot.adapters.local.core.core_process``.

- ``--core FD``: one ``EngineCore`` serving the socket ``FD`` (a ``"spawn"`` start).
- ``--fork-server FD``: a fork server on the ``SOCK_SEQPACKET`` socket ``FD``: it imports
  torch, transformers and the engine once, then forks one core per ``ForkRequest`` (the
  core's socket comes with the request), reports each fork's pid and, when it ends, its
  exit code. It runs no torch op and starts no thread, so a fork is safe and costs a few
  milliseconds instead of an interpreter start and the imports (seconds).

A core exits on ``Stop``, when its socket closes, and when the backend's process dies: a
watchdog thread waits for the socket's hang-up (``POLLRDHUP``; the parent's pid changing
where that flag does not exist), so it goes even while a step, a model load or a
calibration is running. It ignores SIGINT (Ctrl-C reaches the whole process group: the
backend decides, and closes it), and SIGTERM stops it cleanly. The fork server exits when
its socket closes and stops the cores it forked.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from .messages import (
    CommandCodec,
    ErrorInfo,
    Exited,
    Fatal,
    Forked,
    ForkRequest,
    OutputCodec,
    Start,
    StartFailed,
)

__all__ = ["fork_server", "serve_core"]

_WATCH_S = 0.25
_MAX_REQUEST = 1 << 20


class _ConnInbox:
    """Commands from the backend's socket (``core.Inbox``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.codec = CommandCodec()

    def take(self, timeout: float | None) -> list[Any] | None:
        out: list[Any] = []
        try:
            if timeout != 0:
                self.conn.poll(timeout)
            while self.conn.poll(0):
                out.extend(self.codec.decode(self.conn.recv_bytes()))
        except (EOFError, OSError):
            return None
        return out


def _watch_parent(fd: int) -> None:
    """Exit at once when the backend's end of the socket goes away."""
    rdhup = getattr(select, "POLLRDHUP", 0)
    if rdhup:
        poller = select.poll()
        poller.register(fd, rdhup | select.POLLHUP)
        while True:
            if poller.poll(None):
                os._exit(0)
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(_WATCH_S)
    os._exit(0)


def serve_core(conn: Connection) -> None:
    """Run one core on ``conn`` until it is stopped or its backend goes away."""
    from spec_tot.progress import show_progress_from_env

    from .engine_core import EngineCore

    show_progress_from_env()  # the CLI's progress lines: model load, calibration
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # A core's CPUs are its model's threads: a batch tokenization (the engine's prompts, the
    # PRM's items) on a thread pool of its own would only contend with them.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    threading.Thread(target=_watch_parent, args=(conn.fileno(),), daemon=True).start()
    out = OutputCodec()
    lock = threading.Lock()

    def emit(message: Any) -> None:
        frame = out.encode(message)
        try:
            with lock:
                conn.send_bytes(frame)
        except OSError:  # the backend is gone; the watchdog ends this process
            pass

    inbox = _ConnInbox(conn)
    first = inbox.take(None)
    if not first or not isinstance(first[0], Start):
        return
    try:
        core = EngineCore(first[0], emit)
    except Exception as exc:
        emit(StartFailed(ErrorInfo.of(exc)))
        return
    emit(core.ready())
    # Everything alive now (torch, transformers, the weights' Python objects, calibration's
    # leftovers) lives as long as the core: out of the collector's generations, so that its
    # collections of the loop's short-lived objects (requests, sequences, results) no longer
    # walk them. A profile of the main job's core showed ~11% of its samples in collections;
    # the executor's main job at 32 queries (--micro, 4 interleaved pairs): 1.5x steps/s.
    gc.collect()
    gc.freeze()
    try:
        core.run(inbox)
    except Exception as exc:
        emit(Fatal(ErrorInfo.of(exc)))
        raise


def _preload() -> None:
    """Everything a core imports, so that a fork imports nothing."""
    import safetensors.torch  # noqa: F401
    import transformers
    from transformers import modeling_rope_utils  # noqa: F401

    from ..engine import llm_engine, prm  # noqa: F401
    from . import engine_core  # noqa: F401

    for name in ("AutoConfig", "AutoTokenizer", "LlamaConfig", "Qwen2Config"):
        getattr(transformers, name)
    transformers.PreTrainedTokenizerFast  # noqa: B018


def fork_server(sock: socket.socket) -> None:
    import msgspec

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _preload()
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(ForkRequest).decode
    children: set[int] = set()
    # A core's end wakes the loop (SIGCHLD through a wake-up pipe), so its exit code reaches
    # the backend at once: ``ProcessLink.close`` waits for it.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            for pid, code in _reap(children):
                _send(sock, encode(Exited(pid, code)))
        if sock not in readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, 1)
        except OSError:
            data, fds = b"", []
        if not data:  # the backend's process is gone: so are its cores
            for pid in children:
                _kill(pid)
            # Nothing here needs finalizing, and tearing down an interpreter with torch
            # imported takes a second or more, during which this process still holds the
            # backend's stdout and stderr (a caller reading them to the end waits for it).
            os._exit(0)
        request = decode(data)
        pid = os.fork()
        if pid == 0:  # the core
            sock.close()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wake_r)
            os.close(wake_w)
            _become(request)
            _serve_then_exit(Connection(fds[0]))
        for fd in fds:
            os.close(fd)
        children.add(pid)
        _send(sock, encode(Forked(pid)))


def _serve_then_exit(conn: Connection) -> None:
    """``serve_core``, then end the process without finalizing the interpreter: a core has
    nothing to flush, and tearing down torch takes a second or more that the backend's
    ``close`` would wait for."""
    code = 0
    try:
        serve_core(conn)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(children: set[int]) -> list[tuple[int, int]]:
    """``(pid, exit code)`` of the cores that ended since the last call."""
    done = []
    for pid in list(children):
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            got, status = pid, 0
        if got:
            children.discard(pid)
            done.append((pid, os.waitstatus_to_exitcode(status)))
    return done


def _send(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the backend is gone: the loop sees it next
        sock.send(data)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)


def _become(request: ForkRequest) -> None:
    """Take on the backend's view of the world (not the fork server's, set when it
    started)."""
    os.environ.clear()
    os.environ.update(request.env)
    with contextlib.suppress(OSError):  # a folder gone meanwhile: the fork server's stays
        os.chdir(request.cwd)
    sys.path[:] = request.sys_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--core", type=int, metavar="FD")
    group.add_argument("--fork-server", type=int, metavar="FD")
    args = parser.parse_args(argv)
    if args.core is not None:
        _serve_then_exit(Connection(args.core))
    else:
        fork_server(socket.socket(fileno=args.fork_server))


if __name__ == "__main__":
    main()
