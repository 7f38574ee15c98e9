"""Ctrl-C or SIGTERM during ``spec-tot run`` / ``bench``: keep what finished.

The first SIGINT or SIGTERM cancels the batch in flight (its queries stop launching, the
backend cancels what runs, as at any close); the queries that had finished make a partial
run, reported and written to ``--json`` like a whole one but marked ``"partial": true``;
no further run starts; the CLI exits 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Sequence
from typing import Any

from spec_tot.cli._report import RunOutcome
from spec_tot.executor.controller import record_for
from spec_tot.metrics import MetricsRecorder
from spec_tot.results import BatchResult, ToTResult

__all__ = ["RunInterrupted", "StopSignal", "partial_batch"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(Exception):
    """A signal stopped the runs; ``outcomes``: the runs that finished or were cut short."""

    def __init__(self, signum: int, outcomes: Sequence[RunOutcome]) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.outcomes = list(outcomes)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignal:
    """Which signal stopped the runs (None: none yet)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def watch(self, work: asyncio.Future[Any]) -> Callable[[], None]:
        """Until the returned callable runs, SIGINT and SIGTERM cancel ``work``. A loop that
        cannot take signal handlers (not the main thread, a virtual-time loop) keeps the
        default behaviour."""
        loop = asyncio.get_running_loop()

        def stop(signum: int) -> None:
            if self.signum is None:
                self.signum = signum
                work.cancel()

        installed = []
        for sig in _SIGNALS:
            try:
                loop.add_signal_handler(sig, stop, sig)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                break

        def remove() -> None:
            for sig in installed:
                loop.remove_signal_handler(sig)

        return remove


def partial_batch(results: Sequence[ToTResult], wall_s: float) -> BatchResult:
    """The finished queries of a batch cut short, with their metrics."""
    recorder = MetricsRecorder()
    for r in results:
        recorder.query_finished(record_for(r.tree, r.status, r.solved, r.latency_s))
    return BatchResult(list(results), recorder.summary(wall_s=wall_s))
