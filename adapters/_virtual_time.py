"""Virtual time for the simulator: an asyncio event loop whose clock jumps.

``VirtualTimeLoop`` is a normal ``SelectorEventLoop`` except for two things:
- ``time()`` returns a virtual clock that starts at 0;
- when no callback is ready, the loop's own selector wait (``select(timeout)``, where
  ``timeout`` is the distance to the next timer) does not sleep: it moves the clock forward
  by ``timeout`` and returns at once.

Everything built on ``loop.time()``/``call_at`` (``asyncio.sleep``, ``asyncio.timeout``,
``wait_for``, the executor's LV timer, the simulator's engine steps) then runs in virtual
time: minutes of simulated GPU work take milliseconds, and a run is a pure function of its
inputs (callbacks run in the same order on every run: FIFO ready queue, timer heap).

Threads are the one thing that runs in real time. While a ``run_in_executor`` job (or the
default executor's shutdown) is pending, the loop waits for it in real time and virtual time
stands still: a thread's work takes zero virtual time, and the loop never jumps past it.
With nothing ready, no timer and no thread, every task waits on something that can never
happen; a real loop would hang forever, this one raises ``VirtualDeadlockError``.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Executor
from typing import Any, TypeVar

__all__ = ["VirtualDeadlockError", "VirtualTimeLoop", "run_virtual"]

_T = TypeVar("_T")


class VirtualDeadlockError(RuntimeError):
    """Nothing is ready, no timer is set and no thread works: the run can never finish."""


class _VirtualSelector(selectors.BaseSelector):
    """Delegates file registration to a real selector (the loop's self-pipe, sockets) and
    turns a timed wait into a jump of the virtual clock."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._real.select(0)  # real I/O (a thread's wake-up) always comes first
        if events or timeout == 0:
            return events
        if self._loop.threads_pending:
            # Wait for the thread in real time; virtual time stands still meanwhile.
            return self._real.select(None)
        if timeout is None:
            raise VirtualDeadlockError(
                "virtual-time deadlock: no callback is ready, no timer is scheduled and no "
                "thread is working, so every task waits on something that never happens"
            )
        self._loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock (see the module docstring)."""

    def __init__(self, start: float = 0.0) -> None:
        self._virtual_now = float(start)  # set first: the base __init__ may read time()
        self.threads_pending = 0
        super().__init__(_VirtualSelector(self))
        # Timers due within this much of "now" run now: covers the float rounding of
        # now + (when - now) after a jump (1 ulp at 1e6 s is ~1e-10 s).
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        """Move the virtual clock forward (the selector does it; tests may too)."""
        if seconds < 0:
            raise ValueError(f"cannot move virtual time backwards ({seconds})")
        self._virtual_now += seconds

    def run_in_executor(  # type: ignore[override]
        self, executor: Executor | None, func: Callable[..., _T], *args: Any
    ) -> asyncio.Future[_T]:
        future = super().run_in_executor(executor, func, *args)
        self.threads_pending += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _future: asyncio.Future[Any]) -> None:
        self.threads_pending -= 1

    async def shutdown_default_executor(self, timeout: float | None = None) -> None:
        # The base class joins the executor from a helper thread it starts itself.
        self.threads_pending += 1
        try:
            await super().shutdown_default_executor()
        finally:
            self.threads_pending -= 1


def run_virtual(coro: Coroutine[Any, Any, _T], *, debug: bool | None = None) -> _T:
    """Like ``asyncio.run`` but on a fresh ``VirtualTimeLoop`` (virtual clock from 0)."""
    with asyncio.Runner(debug=debug, loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)


# -- the engine ---------------------------------------------------------------------------------
