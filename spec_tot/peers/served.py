"""A serving engine started as a child process (vLLM, its router, llama.cpp's server): its
URL, its process group, its log, and the wait for its ``/health``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["Served", "command_line", "free_port", "launch", "log_path"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_path(name: str, port: int) -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"{name}-{port}.log"


@dataclass
class Served:
    """A started server: ``url``, the served ``model`` name, its process and log file."""

    url: str
    model: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT (a clean shutdown), then SIGKILL to its whole process group."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its engine core too
        self.process.wait(timeout=timeout)

    def run_until_interrupted(self, what: str) -> int:
        """Print where it serves, wait for it (Ctrl-C ends the wait), stop it; exit 0."""
        print(f"{what} on {self.url} (log: {self.log})", flush=True)
        try:
            self.process.wait()
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()
        return 0

    def healthy(self, what: str, wait_s: float) -> Served:
        """This server once its ``/health`` answers 200; stopped, and an error with its
        log's end, if it exits or stays silent for ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.process.returncode
                raise RuntimeError(f"{what} exited {code}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{what} not healthy after {wait_s:.0f} s:\n{self.log_tail()}")


def launch(
    command: Sequence[str], port: int, model: str, log: Path, env: dict[str, str] | None = None
) -> Served:
    """``command`` started in a session of its own (so ``stop`` reaches its children), its
    output to ``log``; not yet waited for."""
    with log.open("wb") as out:  # the child keeps its own descriptor
        process = subprocess.Popen(
            list(command), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Served(f"http://127.0.0.1:{port}", model, process, log)


def command_line(
    doc: str, setup: tuple[str, str], serve_help: str
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """A peer script's parser: a ``setup`` command (name, help) and ``serve`` (returned,
    for the peer's own options, ``--port`` already there)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(setup[0], help=setup[1])
    serve = sub.add_parser("serve", help=serve_help)
    serve.add_argument("--port", type=int, default=None)
    return parser, serve
