"""What an app's runs share beside its plan: the threads speculation runs on
(``SharedThreads``) and the running totals of what the runs did (``RunTotals``). A leaf of
the LangGraph layer: the plan and each run use it, it uses neither."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from spec_tot._private.threads import LoopThread
from spec_tot.langgraph.results import LangGraphMetrics

__all__ = ["RunTotals", "SharedThreads"]


@dataclass(eq=False)
class SharedThreads:
    """An app's threads for speculation, shared by its runs: the event loop its sync runs
    speculate on (started with the first such run, stopped with the last) and the pool its
    speculative sync node functions run in (never LangGraph's: a committed task never waits
    for a thread speculation holds). The pool has as many threads as the app may run
    speculative tasks at once."""

    size: Callable[[], int]
    _host: LoopThread | None = None
    _users: int = 0
    _pool: ThreadPoolExecutor | None = None
    _detached: list[Future[Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire_host(self) -> LoopThread:
        with self._lock:
            if self._host is None:
                self._host = LoopThread("spec-tot-speculation")
            self._users += 1
            return self._host

    def release_host(self) -> None:
        with self._lock:
            self._users -= 1
            host, last = self._host, self._users == 0
            if last:
                self._host = None
        if last and host is not None:
            host.close()

    def detach(self, calls: Iterable[Future[Any]]) -> None:
        """Calls of ended runs still on a thread (cancelled speculative work)."""
        with self._lock:
            self._detached = [f for f in [*self._detached, *calls] if not f.done()]

    def detached(self) -> int:
        with self._lock:
            return sum(not f.done() for f in self._detached)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no detached call is still running; False on timeout."""
        with self._lock:
            calls = list(self._detached)
        _, pending = concurrent.futures.wait(calls, timeout=timeout)
        return not pending

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.size(), thread_name_prefix="spec-tot-spec")
            return self._pool


@dataclass(eq=False)
class RunTotals:
    """What an app's runs have done so far, summed (every run adds its figures when it
    ends): ``speculative`` tasks launched, ``adopted`` by a real task, and the rest."""

    runs: int = 0
    committed: int = 0
    speculative: int = 0
    adopted: int = 0
    cancelled: int = 0
    unused: int = 0
    failed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, m: LangGraphMetrics) -> None:
        with self._lock:
            self.runs += 1
            self.committed += m.committed
            self.speculative += m.speculative
            self.adopted += m.adopted
            self.cancelled += m.cancelled
            self.unused += m.unused
            self.failed += m.failed

    def to_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}
