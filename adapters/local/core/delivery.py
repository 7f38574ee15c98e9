"""Delivery: routes an engine core's outputs to the callers waiting for them.

``LocalBackend`` registers a sink per request ticket (a future for ``generate``, a queue
for ``stream``) and a future per call (abort, flush, score, ...), each with the event loop
it belongs to and the core (``CoreLink``) it went to. ``on_output`` runs on the link's
thread: it updates the counters first (a woken caller sees them), then hands each loop the
step's items in one ``call_soon_threadsafe``. When a core ends, ``fail_link`` fails what
was waiting on it, and nothing else.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from spec_tot.errors import BackendError

from .messages import Done, Failed, Pong, Rewards, Scores, StepBatch
from .proc import CoreLink

__all__ = ["Delivery", "Unread"]


class Unread(BackendError):
    """The core died before it read the request (it had reported reading only lower
    tickets): nothing of it ran, so a fresh core may take it."""


_Item = tuple[Any, Any, BaseException | None, bool]  # sink, value, error, final


@dataclass(slots=True, frozen=True)
class _Waiter:
    link: CoreLink
    loop: asyncio.AbstractEventLoop
    sink: Any  # asyncio.Future, or the asyncio.Queue of a stream


class Delivery:
    def __init__(self) -> None:
        self.stats: dict[str, float] = {}
        self.reward_stats: dict[str, float] = {}  # a PRM core's, from its replies
        self._sinks: dict[int, _Waiter] = {}
        self._calls: dict[int, _Waiter] = {}
        self._call_ids = itertools.count(1)
        self._received: dict[int, int] = {}  # id(link) -> the last ticket its core read

    # -- the caller's side ------------------------------------------------------------------
    def expect(self, ticket: int, link: CoreLink, loop: Any, sink: Any) -> None:
        self._sinks[ticket] = _Waiter(link, loop, sink)

    def forget(self, ticket: int) -> None:
        self._sinks.pop(ticket, None)

    def fail(self, ticket: int, error: BaseException) -> None:
        waiter = self._sinks.pop(ticket, None)
        if waiter is not None:
            _post(waiter.loop, [(waiter.sink, None, error, True)])

    def expect_call(self, link: CoreLink, loop: Any, fut: asyncio.Future[Any]) -> int:
        call = next(self._call_ids)
        self._calls[call] = _Waiter(link, loop, fut)
        return call

    def fail_call(self, call: int, error: BaseException) -> None:
        waiter = self._calls.pop(call, None)
        if waiter is not None:
            _post(waiter.loop, [(waiter.sink, None, error, True)])

    # -- the core's side (its link's thread) ------------------------------------------------
    def on_output(self, link: CoreLink, output: Any) -> None:
        if isinstance(output, StepBatch):
            if output.received > self._received.get(id(link), 0):
                self._received[id(link)] = output.received
            self._step(output)
        elif isinstance(output, Done | Scores | Rewards | Pong | Failed):
            if isinstance(output, Done) and output.stats:
                self.stats = output.stats
            elif isinstance(output, Scores | Rewards) and output.stats:
                self.reward_stats = output.stats
            waiter = self._calls.pop(output.call, None)
            if waiter is not None:
                error = output.error.to_exception() if isinstance(output, Failed) else None
                _post(waiter.loop, [(waiter.sink, output, error, True)])

    def _step(self, batch: StepBatch) -> None:
        if batch.stats:
            self.stats = batch.stats  # before waking anyone: callers see it
        by_loop: dict[Any, list[_Item]] = defaultdict(list)
        sinks = self._sinks
        for ticket, update in batch.updates:
            waiter = sinks.get(ticket)
            if waiter is not None:
                by_loop[waiter.loop].append((waiter.sink, update, None, False))
        for ticket, result in batch.results:
            waiter = sinks.pop(ticket, None)
            if waiter is not None:
                by_loop[waiter.loop].append((waiter.sink, result, None, True))
        for ticket, info in batch.failures:
            waiter = sinks.pop(ticket, None)
            if waiter is not None:
                by_loop[waiter.loop].append((waiter.sink, None, info.to_exception(), True))
        for loop, items in by_loop.items():
            _post(loop, items)

    def fail_link(self, link: CoreLink, error: BaseException) -> None:
        """``link``'s core has ended: everything still waiting on it fails with ``error``,
        but a request its core never read fails ``Unread`` (a fresh core may take it: a
        batch sent to an idle core in the moments it took to die failed whole)."""
        received = self._received.pop(id(link), 0)
        unread = Unread("local", f"{str(error).removeprefix('local: ')} (before it read this)")
        for table in (self._sinks, self._calls):
            gone = [key for key, waiter in list(table.items()) if waiter.link is link]
            by_loop: dict[Any, list[_Item]] = defaultdict(list)
            for key in gone:
                waiter = table.pop(key, None)
                if waiter is not None:
                    lost = unread if table is self._sinks and key > received else error
                    by_loop[waiter.loop].append((waiter.sink, None, lost, True))
            for loop, items in by_loop.items():
                _post(loop, items)


def _deliver(items: list[_Item]) -> None:
    """On the caller's loop: resolve futures (unless cancelled meanwhile), feed streams (an
    error or a final result ends a stream)."""
    for sink, value, error, final in items:
        if isinstance(sink, asyncio.Future):
            if final and not sink.done():
                if error is not None:
                    sink.set_exception(error)
                else:
                    sink.set_result(value)
        else:
            sink.put_nowait(error if error is not None else value)


def _post(loop: asyncio.AbstractEventLoop, items: list[_Item]) -> None:
    """``loop.call_soon_threadsafe(_deliver, items)``, unless the caller's loop has closed
    (a stream consumer's ``asyncio.run`` may end right after its last update): nobody waits
    there any more, and the core's thread must live on."""
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:
        if not loop.is_closed():
            raise
