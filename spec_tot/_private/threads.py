"""Sync twins of async runs, usable where an event loop is already running (notebooks)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["iterate_in_thread", "run_in_thread_if_needed"]

T = TypeVar("T")
_DONE = object()


def run_in_thread_if_needed(coro: Coroutine[Any, Any, T]) -> T:
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
