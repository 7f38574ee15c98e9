"""Sync twins of async runs, usable where an event loop is already running (notebooks).

``run_sync`` is the one bridge every sync method of a Runnable here goes through (``ToTApp``,
the chat models, the LangGraph app): with no loop running it is ``asyncio.run``; inside one it
runs the coroutine on a fresh loop in a worker thread, so a notebook cell can call
``invoke``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["LoopThread", "iterate_in_thread", "run_sync"]

T = TypeVar("T")
_DONE = object()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``; inside a running loop, on a fresh loop in a worker thread,
    in a copy of the caller's context (a branch's ``current_branch`` goes with it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    context = contextvars.copy_context()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(context.run, asyncio.run, coro).result()


def iterate_in_thread(
    stream: AsyncIterator[T], loop: asyncio.AbstractEventLoop | None = None
) -> Iterator[T]:
    """Iterate an async iterator from sync code, item by item, on its own loop and thread,
    or on ``loop`` (running in another thread), where leaving early cancels it. Either way
    the stream sees a copy of this thread's context."""
    items: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()

    async def pump() -> None:
        try:
            async for item in stream:
                items.put((True, item))
                if stop.is_set():
                    break
        except BaseException as exc:
            items.put((False, exc))
        finally:
            items.put(_DONE)

    if loop is not None:
        future = asyncio.run_coroutine_threadsafe(pump(), loop)
        end: Callable[[], Any] = future.cancel
    else:
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(asyncio.run, pump()), daemon=True)
        thread.start()
        end = thread.join
    try:
        while (got := items.get()) is not _DONE:
            ok, value = got
            if not ok:
                raise value
            yield value
    finally:
        stop.set()
        end()


class LoopThread:
    """An event loop of its own on a daemon thread: the home of a sync run's speculation
    (its predictions and speculative tasks), which the run's worker threads talk to."""

    def __init__(self, name: str = "spec-tot-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        """Stop the loop (after what it was asked to do) and wait for the thread."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
