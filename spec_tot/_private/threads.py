"""Sync twins of async runs, usable where an event loop is already running (notebooks)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["iterate_in_thread", "run_in_thread_if_needed"]

T = TypeVar("T")
_DONE = object()


def run_in_thread_if_needed(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``; inside a running loop, on a fresh loop in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def iterate_in_thread(
    stream: AsyncIterator[T], loop: asyncio.AbstractEventLoop | None = None
) -> Iterator[T]:
    """Iterate an async iterator from sync code, item by item, on its own loop and thread,
    or on ``loop`` (running in another thread; the stream sees this thread's context), where
    leaving early cancels it."""
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
        thread = threading.Thread(target=asyncio.run, args=(pump(),), daemon=True)
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
