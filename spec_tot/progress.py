"""Progress lines for work that takes long enough to look like a hang: loading a model,
calibrating an engine's step times, compiling a kernel, converting weights, a long run.

Libraries only log (``logging.getLogger(PROGRESS_LOGGER)`` at INFO), so an application that
embeds spec-tot decides where they go. The CLI calls ``show_progress()``: one plain line per
step on stderr, ``spec-tot: <what>``. It also sets ``$SPEC_TOT_PROGRESS``, which the
embedded engine's own processes inherit and read (``show_progress_from_env``), so what they
do (model load, calibration) is shown too.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

__all__ = [
    "PROGRESS_ENV",
    "PROGRESS_LOGGER",
    "note",
    "run_progress",
    "show_progress",
    "show_progress_from_env",
    "timed_step",
]

PROGRESS_LOGGER = "spec_tot.progress"
PROGRESS_ENV = "SPEC_TOT_PROGRESS"


@contextmanager
def run_progress(
    label: str, total: int, console: Console, every_s: float = 10.0
) -> Iterator[Callable[[], None]]:
    """A callable to call once per finished item: a transient bar on a terminal, else a
    plain progress line at most every ``every_s`` seconds (``label: done/total (N s)``)."""
    if console.is_terminal:
        columns = ("[progress.description]{task.description}", BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn())  # fmt: skip
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(label, total=total)
            yield lambda: bar.advance(task)
        return
    started = last = time.monotonic()
    done = 0

    def advance() -> None:
        nonlocal done, last
        done += 1
        now = time.monotonic()
        if now - last >= every_s and done < total:
            last = now
            note(f"{label}: {done}/{total} done ({now - started:.0f} s)")

    yield advance


def note(message: str) -> None:
    """One progress line (shown where an application asked for them)."""
    logging.getLogger(PROGRESS_LOGGER).info(message)


@contextmanager
def timed_step(what: str, detail: str = "") -> Iterator[None]:
    """``what (detail) ...`` now, ``what: done in N s`` after (or ``failed``)."""
    note(f"{what} ({detail}) ..." if detail else f"{what} ...")
    started = time.monotonic()
    try:
        yield
    except BaseException:
        note(f"{what}: failed after {time.monotonic() - started:.1f} s")
        raise
    note(f"{what}: done in {time.monotonic() - started:.1f} s")


class _Lines(logging.Handler):
    """``spec-tot: message`` lines, flushed at once (a pipe must see them as they happen)."""

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__(logging.INFO)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        stream = self.stream or sys.stderr  # read late: pytest swaps stderr per test
        try:
            stream.write(f"spec-tot: {record.getMessage()}\n")
            stream.flush()
        except (OSError, ValueError):  # a closed stream must not fail the work it reports
            pass


def show_progress(stream: TextIO | None = None, *, children: bool = True) -> None:
    """Print progress lines on ``stream`` (default: stderr); idempotent. ``children``: set
    ``$SPEC_TOT_PROGRESS`` so that processes started from here print theirs too."""
    logger = logging.getLogger(PROGRESS_LOGGER)
    logger.setLevel(logging.INFO)
    if not any(isinstance(h, _Lines) for h in logger.handlers):
        logger.addHandler(_Lines(stream))
    logger.propagate = False  # an application's root handler would print them twice
    if children:
        os.environ[PROGRESS_ENV] = "1"


def show_progress_from_env() -> None:
    """``show_progress()`` in a child process whose parent asked for it."""
    if os.environ.get(PROGRESS_ENV) == "1":
        show_progress(children=False)
