"""Calling a scorer and checking what it returns.

A scorer is a ``RewardBackend`` or a plain (sync or async) callable over a batch of
``RewardItem``s returning one score, or one tuple of per-step scores, per item. Every score
must be a finite real number (not a string, not a bool), within the backend's stated
``score_range`` when it has one; a tuple holds one score per step (or a single outcome
score). ``check_score`` judges one item's score, so that a bad one fails only its query.

A sync callable (anything that is not a coroutine function) runs in a worker thread of its
own, never on the event loop, where a blocking one would stall every query and the engine;
the thread cannot be stopped, so a call that outlives its deadline is abandoned and its late
result discarded. Several calls of one sync scorer may run at once (one per query).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from spec_tot._private.compiled import maybe_await
from spec_tot.backends import RewardBackend
from spec_tot.errors import ExecutionError
from spec_tot.requests import RewardItem

__all__ = ["Scorer", "call_scorer", "check_score", "is_sync_scorer", "score_range"]

Scorer = RewardBackend | Any


def is_sync_scorer(scorer: Scorer) -> bool:
    """A plain callable that is not a coroutine function (nor an object whose ``__call__``
    is one): it runs in a worker thread."""
    if isinstance(scorer, RewardBackend):
        return False
    call = getattr(scorer, "__call__", None)  # noqa: B004 - the method itself is inspected
    return not (inspect.iscoroutinefunction(scorer) or inspect.iscoroutinefunction(call))


async def call_scorer(
    scorer: Scorer, items: Sequence[RewardItem], timeout_s: float | None = None
) -> list[Any]:
    """The scorer's raw answer for ``items``: one entry per item (checked), unjudged. A sync
    scorer's call is given ``timeout_s`` (its query's deadline): past it, an
    ``ExecutionError``, and whatever the thread returns later is dropped."""
    if isinstance(scorer, RewardBackend):
        raw: Any = await scorer.score(items)
    elif is_sync_scorer(scorer):
        raw = await maybe_await(await _in_thread(scorer, list(items), timeout_s))
    else:
        raw = await scorer(list(items))
    if isinstance(raw, str | bytes) or not hasattr(raw, "__iter__"):
        raise ExecutionError(f"scorer returned {type(raw).__name__}, not a list of scores")
    scores = list(raw)
    if len(scores) != len(items):
        raise ExecutionError(f"scorer returned {len(scores)} scores for {len(items)} items")
    return scores


async def _in_thread(fn: Callable[[Any], Any], arg: Any, timeout_s: float | None) -> Any:
    """``fn(arg)`` on a daemon thread (a scorer that never returns must not hold the
    process at exit, as a pool's worker would); cancelling the caller abandons the call."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if done.done():  # abandoned: cancelled, or past its deadline
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)

    def work() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(arg), None)
        except BaseException as exc:  # handed to the caller, whatever it is
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for it now
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=work, name="spec-tot-scorer", daemon=True).start()
    try:
        async with asyncio.timeout(timeout_s):
            return await done
    except TimeoutError:
        raise ExecutionError(
            f"scorer ran past its query's deadline ({timeout_s} s); its result is discarded"
        ) from None


def score_range(scorer: Scorer) -> tuple[float, float] | None:
    return scorer.score_range if isinstance(scorer, RewardBackend) else None


def check_score(
    value: Any, item: RewardItem, bounds: tuple[float, float] | None
) -> tuple[float, ...]:
    """``value`` as per-step scores for ``item``, or ``ValueError`` saying what is wrong."""
    if isinstance(value, str | bytes):
        raise ValueError(f"score for {item.request_id} is the string {value!r}, not a number")
    try:
        size = len(value)
    except TypeError:  # a scalar (a 0-d tensor too)
        return (_number(value, item, bounds),)
    steps = tuple(_number(v, item, bounds) for v in value)
    if size not in (1, len(item.steps)):
        raise ValueError(
            f"{size} scores for {item.request_id}, which has {len(item.steps)} steps "
            "(one per step, or one for the trace)"
        )
    return steps


def _number(value: Any, item: RewardItem, bounds: tuple[float, float] | None) -> float:
    if isinstance(value, bool | str | bytes) or not hasattr(value, "__float__"):
        raise ValueError(f"score for {item.request_id} is {value!r}, not a real number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"score for {item.request_id} is {number}, not finite")
    if bounds is not None and not bounds[0] <= number <= bounds[1]:
        raise ValueError(
            f"score for {item.request_id} is {number}, outside the scorer's range {bounds}"
        )
    return number
