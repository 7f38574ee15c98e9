"""Reward batching rules: *when* the items waiting at reward nodes are scored, and with whom.

One strategy seam, three rules (``RewardRouter`` holds the queues and runs the batches):

- ``RoundRule`` (baseline): a query's items form one queue, scored once every live committed
  branch of the query waits there, which is exactly a search-and-learn round;
- ``EagerRule`` (naive): everything waiting is scored at the next loop tick;
- ``LazyRule`` (SpecScale LV): one queue across queries, scored when pending tokens reach a
  threshold, a query's committed sibling group is complete, an item was deferred too often,
  the oldest item waited too long, or too many speculative items wait.
"""

from __future__ import annotations

import asyncio
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from spec_tot.config import LazyVerification

__all__ = [
    "BatchRule",
    "EagerRule",
    "LazyRule",
    "Pending",
    "Queue",
    "RoundRule",
    "RuleHost",
    "select_lazy",
]


@dataclass(slots=True, eq=False)
class Pending:
    """One item waiting for its score."""

    query_id: str
    node_id: str
    scorer: Any
    item: Any
    speculative: bool
    tokens: int
    future: asyncio.Future[tuple[float, ...]]
    since: float = 0.0  # when it started waiting
    queued: bool = True  # still waiting in a queue (not yet in a batch being scored)
    deferrals: int = 0
    key: Hashable = ""  # the queue it waits in
    node_name: str = ""  # the reward node (errors name it)


@dataclass(slots=True)
class Queue:
    items: list[Pending] = field(default_factory=list)
    tick_scheduled: bool = False
    timer: asyncio.TimerHandle | None = None
    last_deferral: float = -math.inf


class RuleHost(Protocol):
    """What a rule may ask of the router that holds its queues (``RewardRouter``): the rules
    decide when, the router does."""

    def group_complete(self, query_id: str) -> bool: ...
    def urgent(self, query_id: str) -> bool: ...
    def queue(self, key: Hashable) -> Queue | None: ...
    def batches_in_flight(self, key: Hashable) -> int: ...
    def schedule_tick(self, key: Hashable) -> None: ...
    def fire_timer(self, key: Hashable) -> None: ...
    def flush(
        self,
        key: Hashable,
        select: Callable[[list[Pending]], tuple[list[Pending], list[Pending]]] | None = None,
    ) -> None: ...


class BatchRule(ABC):
    """When a queue is scored. ``key`` names the queue a query's items wait in; ``check`` is
    called whenever that queue or a query's sibling group changes."""

    @abstractmethod
    def key(self, query_id: str) -> Hashable: ...

    @abstractmethod
    def check(self, router: RuleHost, key: Hashable, query_id: str) -> None: ...

    def on_tick(self, router: RuleHost, key: Hashable) -> None:  # noqa: B027 - optional
        """A loop tick scheduled by ``router.schedule_tick`` came."""

    def on_timer(self, router: RuleHost, key: Hashable) -> None:  # noqa: B027 - optional
        """A timer set by the rule fired."""

    def on_batch_done(self, router: RuleHost, key: Hashable) -> None:  # noqa: B027
        """A batch of the queue ``key`` was scored (the reward model is free again)."""


class RoundRule(BatchRule):
    """One queue per query, scored when the query's committed sibling group is complete."""

    def key(self, query_id: str) -> Hashable:
        return ("round", query_id)

    def check(self, router: RuleHost, key: Hashable, query_id: str) -> None:
        if router.group_complete(query_id):
            router.flush(key)


class EagerRule(BatchRule):
    """Everything waiting is scored at the next loop tick (one engine step's completions
    share a batch)."""

    def key(self, query_id: str) -> Hashable:
        return ("eager",)

    def check(self, router: RuleHost, key: Hashable, query_id: str) -> None:
        router.schedule_tick(key)

    def on_tick(self, router: RuleHost, key: Hashable) -> None:
        router.flush(key)


class LazyRule(BatchRule):
    """SpecScale LV, one queue per LV setting across queries: a batching rule, never a
    delay on the critical path.

    - A committed item never waits while the reward model is idle (no batch of this queue
      in flight, and the engine, whose device a reward model often shares, not loaded) if
      waiting could cost anything: its sibling group is complete (the round waits for it),
      or its query is speculating (its score steers predictions and pruning). It goes at
      once, with whatever waits beside it. While a batch runs, items gather; when it ends
      the next one goes. A round's early siblings of a query that is not speculating wait
      for the group: scoring them one by one would only cost reward calls.
    - Otherwise (a batch is running, or only speculative items wait) the queue is scored
      when its pending tokens reach ``token_threshold`` (speculative items count), a
      query's committed sibling group is complete, an item was passed over
      ``max_deferrals`` times, the oldest item waited ``max_wait_s``, or ``spec_flush``
      speculative items wait.
    - Speculative items ride in the same batches as committed ones (so a speculative step
      is usually scored before its branch is adopted), unless ``defer_speculative``.

    ``busy`` (adaptive LV): while it is False the engine has idle capacity and lazy
    verification would only delay scores, so pending items are scored at once.
    ``saturated`` (committed load fills the engine): an early score would only steer or
    prune speculation, worth little then, so the deferral and wall-clock rules rest."""

    def __init__(
        self,
        lv: LazyVerification,
        busy: Callable[[], bool] | None = None,
        saturated: Callable[[], bool] | None = None,
    ) -> None:
        self.lv = lv
        self.busy = busy
        self.saturated = saturated

    def key(self, query_id: str) -> Hashable:
        return ("lazy", self.lv)

    def check(self, router: RuleHost, key: Hashable, query_id: str) -> None:
        router.schedule_tick(key)

    def on_batch_done(self, router: RuleHost, key: Hashable) -> None:
        router.schedule_tick(key)

    def on_tick(self, router: RuleHost, key: Hashable) -> None:
        queue = router.queue(key)
        if queue is None or not queue.items:
            return
        lv = self.lv
        items = queue.items
        patient = self.saturated is not None and self.saturated()
        # The reward model is idle when no batch of its own runs and the engine it may
        # share is not loaded either: then batching would only delay the critical path.
        idle = router.batches_in_flight(key) == 0 and not patient
        urgent = any(not p.speculative and router.urgent(p.query_id) for p in items)
        if (self.busy is not None and not self.busy()) or (idle and urgent and lv.idle_flush):
            router.flush(key, lambda batch: select_lazy(batch, lv, False))
            return
        loop = asyncio.get_running_loop()
        # With deferred speculation only committed items start the clock and the counters:
        # a speculative item alone is never urgent.
        timed = [p for p in items if not p.speculative] if lv.defer_speculative else items
        backlog = sum(p.speculative for p in items) >= lv.spec_flush
        reasons = (
            sum(p.tokens for p in timed) >= lv.token_threshold,
            any(router.group_complete(q) for q in {p.query_id for p in items}),
            not patient and max((p.deferrals for p in timed), default=0) >= lv.max_deferrals,
            backlog,
            not patient
            and bool(timed)
            and loop.time() - min(p.since for p in timed) >= lv.max_wait_s,
        )
        if any(reasons):
            router.flush(key, lambda batch: select_lazy(batch, lv, backlog))
            return
        # A deferral is a scheduling opportunity passed over: at most one per clock instant,
        # since one engine step's results can set off several ticks at the same moment.
        now = loop.time()
        if now != queue.last_deferral:
            queue.last_deferral = now
            for p in timed:
                p.deferrals += 1
        if queue.timer is None and timed and not patient:
            # While loaded no timer runs: load only falls when a committed request finishes,
            # and its branch then reaches the router (scored or ended), which decides again.
            queue.timer = loop.call_later(lv.max_wait_s, router.fire_timer, key)

    def on_timer(self, router: RuleHost, key: Hashable) -> None:
        if self.saturated is None or not self.saturated():
            router.flush(key, lambda batch: select_lazy(batch, self.lv, False))


def select_lazy(
    items: list[Pending], lv: LazyVerification, backlog: bool
) -> tuple[list[Pending], list[Pending]]:
    """Which pending items a lazy batch takes, and which keep waiting: every committed item;
    speculative ones too unless ``defer_speculative``, in which case only on the ``backlog``
    rule, oldest first, up to ``token_threshold``."""
    batch = [p for p in items if not p.speculative]
    speculative = [p for p in items if p.speculative]
    if not lv.defer_speculative:
        return batch + speculative, []
    total = 0
    taken = 0
    for p in speculative if backlog else ():
        if taken and total + p.tokens > lv.token_threshold:
            break
        total += p.tokens
        taken += 1
    return batch + speculative[:taken], speculative[taken:]
