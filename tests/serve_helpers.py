"""``spec-tot serve`` on 127.0.0.1 for tests: in the test's own event loop (``served``) or in a
thread of its own for synchronous third-party clients (``serve_in_thread``). On exit both
check that nothing is left running and every KV block is free."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from engine_fixtures import assert_backend_free

from spec_tot.adapters.local import LocalBackend
from spec_tot.adapters.local.serve import GuardedServer, create_server_app, server_config

__all__ = ["free_port", "serve_in_thread", "served", "settle"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def settle(backend: LocalBackend) -> None:
    """Wait for aborts to land, then check that nothing runs and every KV block is free."""
    for _ in range(200):  # a disconnect's abort lands a moment after the socket closes
        await backend.flush()
        if backend.num_inflight == 0 and (await backend.pool_report()).requests == 0:
            break
        await asyncio.sleep(0.01)
    await assert_backend_free(backend)


@asynccontextmanager
async def served(
    backend: LocalBackend, box: dict[str, Any] | None = None, **app_options: Any
) -> AsyncIterator[str]:
    """Serve ``backend`` in this loop (``server_config``: the guarded protocol and limits);
    yields the base URL. ``box["app"]``: the app, for tests that read its state."""
    port = free_port()
    app = create_server_app(backend, **app_options)
    if box is not None:
        box["app"] = app
    config = server_config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="error",
    )
    server = GuardedServer(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        await settle(backend)


@contextmanager
def serve_in_thread(make_backend: Callable[[], LocalBackend], **app_options: Any) -> Iterator[str]:
    """Serve a backend built inside a thread's own loop, for synchronous clients."""
    ready = threading.Event()
    stop = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        backend = make_backend()
        try:
            async with served(backend, **app_options) as url:
                box["url"] = url
                ready.set()
                while not stop.is_set():
                    await asyncio.sleep(0.02)
        finally:
            await backend.aclose()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced to the test below
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, name="spec-tot-serve-test", daemon=True)
    thread.start()
    ready.wait(120)
    if "error" in box:
        raise box["error"]
    try:
        yield box["url"]
    finally:
        stop.set()
        thread.join(60)
        if "error" in box:
            raise box["error"]
