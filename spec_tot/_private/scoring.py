"""Reward batching: when the branches waiting at reward nodes are scored, and with whom.

Three flush rules, one router:
- ``round`` (baseline): a query's batch is scored once every live committed branch of the
  query waits, which is exactly a search-and-learn round.
- ``eager`` (naive): everything waiting is scored at the next loop tick.
- lazy verification (SpecScale LV): one queue across queries, scored when pending tokens reach
  a threshold, a query's committed sibling group is complete, an item was deferred too often,
  the oldest item waited too long, or too many speculative items wait.
Scores are normalised to a tuple of per-step floats.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from spec_tot._private.compiled import maybe_await
from spec_tot.backends import RewardBackend
from spec_tot.config import LazyVerification
from spec_tot.errors import ExecutionError
from spec_tot.graph import GraphNode, State
from spec_tot.metrics import MetricsRecorder
from spec_tot.requests import Capabilities, RewardItem

__all__ = ["FlushRule", "RewardRouter", "calibrated_lv", "call_scorer"]

Scorer = RewardBackend | Any
FlushRule = Literal["round", "eager"] | LazyVerification


async def call_scorer(scorer: Scorer, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
    """Call a RewardBackend or a plain (sync or async) callable; check and normalise."""
    if isinstance(scorer, RewardBackend):
        raw: Any = await scorer.score(items)
    else:
        raw = await maybe_await(scorer(list(items)))
    scores = list(raw)
    if len(scores) != len(items):
        raise ExecutionError(f"scorer returned {len(scores)} scores for {len(items)} items")
    out: list[tuple[float, ...]] = []
    for value in scores:
        steps = (float(value),) if isinstance(value, int | float) else tuple(map(float, value))
        if not steps:
            raise ExecutionError("scorer returned an empty score tuple")
        out.append(steps)
    return out


def calibrated_lv(lv: LazyVerification, given: Any, caps: Capabilities) -> LazyVerification:
    """``lv`` with the backend's calibration (its reward-batch knee as the token threshold,
    that batch's latency as the wall-clock bound) wherever the user did not set the value
    (``given``, the ``lv`` override: a LazyVerification sets both, a dict the keys it names)."""
    explicit = set(given) if isinstance(given, Mapping) else set()
    if isinstance(given, LazyVerification):
        explicit = {"token_threshold", "max_wait_s"}
    if caps.reward_batch_tokens and "token_threshold" not in explicit:
        lv = replace(lv, token_threshold=caps.reward_batch_tokens)
    if caps.reward_batch_s and "max_wait_s" not in explicit:
        lv = replace(lv, max_wait_s=caps.reward_batch_s)
    return lv


def _select(
    items: list[_Pending], lv: LazyVerification, backlog: bool
) -> tuple[list[_Pending], list[_Pending]]:
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


def _tokens(scorer: Scorer, item: RewardItem) -> int:
    if isinstance(scorer, RewardBackend):
        return scorer.count_item_tokens(item)
    return max(1, len(item.question) // 4 + len(item.text) // 4)


@dataclass(slots=True)
class _Pending:
    query_id: str
    scorer: Scorer
    item: RewardItem
    speculative: bool
    tokens: int
    future: asyncio.Future[tuple[float, ...]]
    since: float = 0.0  # when it started waiting
    counted: bool = False  # counts in its query's committed group
    queued: bool = True  # still waiting in a queue (not yet in a batch being scored)
    deferrals: int = 0


@dataclass(slots=True)
class _Query:
    committed_unscored: int = 0
    pending_committed: int = 0

    @property
    def group_complete(self) -> bool:
        return 0 < self.committed_unscored <= self.pending_committed


@dataclass(slots=True)
class _Queue:
    items: list[_Pending] = field(default_factory=list)


class RewardRouter:
    """Shared by all queries of a run (one event loop; no locks)."""

    def __init__(
        self,
        default_scorer: Scorer | None,
        recorder: MetricsRecorder,
        rule: FlushRule = "round",
        busy: Callable[[], bool] | None = None,
        saturated: Callable[[], bool] | None = None,
    ) -> None:
        """``busy`` (adaptive LV): while it is False the engine has idle capacity and lazy
        verification would only delay scores, so pending items are scored at once.
        ``saturated`` (committed load fills the engine): an early score would only steer
        or prune speculation, worth little then, so the deferral and wall-clock rules rest
        and batches form by sibling groups and the token threshold alone."""
        self._default = default_scorer
        self._recorder = recorder
        self._rule = rule
        self._busy = busy
        self._saturated = saturated
        self._queries: dict[str, _Query] = {}
        self._pending: dict[str, _Queue] = {}  # round rule: per query; others: one ("")
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._tick_scheduled = False
        self._unresolved: dict[str, _Pending] = {}  # node id -> its item, until scored
        self._last_deferral = -math.inf

    # -- branch accounting (committed branches only decide a round) --------------------------
    def segment_started(self, query_id: str, *, speculative: bool) -> None:
        if not speculative:
            self._queries.setdefault(query_id, _Query()).committed_unscored += 1

    def adopt(self, query_id: str, node_id: str) -> None:
        """A speculative branch became committed before its score came back: from now on it
        counts for its query's sibling group, wherever it is (before its reward, waiting in
        a queue, or in a batch being scored)."""
        query = self._queries.setdefault(query_id, _Query())
        query.committed_unscored += 1
        pending = self._unresolved.get(node_id)
        if pending is not None and not pending.counted:
            pending.speculative = False
            pending.counted = True
            if pending.queued:
                query.pending_committed += 1
        self._check(query_id)

    def segment_ended_unscored(self, query_id: str, *, speculative: bool) -> None:
        query = self._queries.get(query_id)
        if query is not None and not speculative:
            query.committed_unscored -= 1
            self._check(query_id)

    def forget(self, query_id: str) -> None:
        self._queries.pop(query_id, None)
        for key, queue in list(self._pending.items()):
            for p in queue.items:
                if p.query_id == query_id:
                    p.future.cancel()
            queue.items = [p for p in queue.items if p.query_id != query_id]
            if not queue.items:
                del self._pending[key]

    # -- scoring ------------------------------------------------------------------------------
    async def score(
        self,
        query_id: str,
        node_id: str,
        reward_node: GraphNode,
        state: State,
        *,
        speculative: bool,
    ) -> tuple[float, ...]:
        try:
            item, scorer = self._prepare(node_id, reward_node, state)
            tokens = _tokens(scorer, item)
        except Exception:
            # Never registered: release the branch so its round can still complete.
            self.segment_ended_unscored(query_id, speculative=speculative)
            raise
        loop = asyncio.get_running_loop()
        pending = _Pending(
            query_id, scorer, item, speculative, tokens, loop.create_future(), loop.time()
        )
        query = self._queries.setdefault(query_id, _Query())
        key = query_id if self._rule == "round" else ""
        queue = self._pending.setdefault(key, _Queue())
        queue.items.append(pending)
        self._unresolved[node_id] = pending
        if not speculative:
            pending.counted = True
            query.pending_committed += 1
        self._check(query_id)
        try:
            return await pending.future
        finally:
            self._unresolved.pop(node_id, None)
            if pending.queued:  # left before its batch ran (cancelled): take it out
                pending.queued = False
                waiting = self._pending.get(key)
                if waiting is not None and pending in waiting.items:
                    waiting.items.remove(pending)
                if pending.counted:
                    query.pending_committed -= 1
            if pending.counted:
                query.committed_unscored -= 1
            self._check(query_id)

    def _prepare(
        self, node_id: str, reward_node: GraphNode, state: State
    ) -> tuple[RewardItem, Scorer]:
        scorer = reward_node.scorer if reward_node.scorer is not None else self._default
        if scorer is None or reward_node.reward_input is None:
            raise ExecutionError(f"reward node {reward_node.name!r} has no scorer")
        question, steps = reward_node.reward_input(state)
        return RewardItem(request_id=node_id, question=question, steps=tuple(steps)), scorer

    def _check(self, query_id: str) -> None:
        rule = self._rule
        if rule == "round":
            query = self._queries.get(query_id)
            if query is not None and query.group_complete:
                self._flush(query_id)
        elif self._pending.get("") and not self._tick_scheduled:
            # One decision per loop tick, so completions of one engine step share a batch.
            self._tick_scheduled = True
            asyncio.get_running_loop().call_soon(self._on_tick)

    def _on_tick(self) -> None:
        self._tick_scheduled = False
        rule = self._rule
        if rule == "eager" or (self._busy is not None and not self._busy()):
            self._flush("")  # eager, or adaptive LV with an idle engine: nothing to batch for
        elif isinstance(rule, LazyVerification):
            self._check_lazy(rule)

    def _check_lazy(self, lv: LazyVerification) -> None:
        queue = self._pending.get("")
        if not queue or not queue.items:
            return
        loop = asyncio.get_running_loop()
        items = queue.items
        # With deferred speculation only committed items start the clock and the counters:
        # a speculative item alone is never urgent.
        timed = [p for p in items if not p.speculative] if lv.defer_speculative else items
        backlog = sum(p.speculative for p in items) >= lv.spec_flush
        patient = self._saturated is not None and self._saturated()
        reasons = (
            sum(p.tokens for p in timed) >= lv.token_threshold,
            any(q.group_complete for q in self._queries.values()),
            not patient and max((p.deferrals for p in timed), default=0) >= lv.max_deferrals,
            backlog,
            not patient
            and bool(timed)
            and loop.time() - min(p.since for p in timed) >= lv.max_wait_s,
        )
        if any(reasons):
            self._flush("", lv, backlog)
            return
        # A deferral is a scheduling opportunity passed over: at most one per clock instant,
        # since one engine step's results can set off several ticks at the same moment.
        now = loop.time()
        if now != self._last_deferral:
            self._last_deferral = now
            for p in timed:
                p.deferrals += 1
        if self._timer is None and timed and not patient:
            # While loaded no timer runs: load only falls when a committed request finishes,
            # and its branch then reaches the router (scored or ended), which decides again.
            self._timer = loop.call_later(lv.max_wait_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        rule = self._rule
        if not self._pending.get(""):
            return
        if not isinstance(rule, LazyVerification):
            self._flush("")
        elif self._saturated is None or not self._saturated():
            self._flush("", rule, backlog=False)

    def _flush(self, key: str, lv: LazyVerification | None = None, backlog: bool = False) -> None:
        """Score the queue ``key`` now: all of it, or with ``lv`` what ``_select`` picks (the
        rest waits in a fresh queue)."""
        if key == "" and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queue = self._pending.pop(key, None)
        if queue is None or not queue.items:
            return
        batch = queue.items
        if lv is not None:
            batch, rest = _select(batch, lv, backlog)
            if rest:
                self._pending[key] = _Queue(rest)
                self._check("")  # what stays gets a fresh decision (and timer) next tick
            if not batch:
                return
        for p in batch:  # in flight now: no longer "waiting" for the group rule
            p.queued = False
            if p.counted:
                self._queries.setdefault(p.query_id, _Query()).pending_committed -= 1
        # Committed work first: its scores unblock the policy.
        batch = sorted(batch, key=lambda p: p.speculative)
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, pending: list[_Pending]) -> None:
        groups: dict[int, list[_Pending]] = {}
        for entry in pending:
            groups.setdefault(id(entry.scorer), []).append(entry)
        for group in groups.values():
            await self._score_group(group)

    async def _score_group(self, group: list[_Pending]) -> None:
        live = [p for p in group if not p.future.done()]
        if not live:
            return
        try:
            self._recorder.reward_call(len(live), sum(p.tokens for p in live))
            scores = await call_scorer(live[0].scorer, [p.item for p in live])
        except Exception as exc:
            queries = {p.query_id for p in live}
            if len(queries) > 1:
                # A batch shared by queries failed: score each query alone, so that only
                # the query whose items fail sees the error.
                for query_id in sorted(queries):
                    await self._score_group([p for p in live if p.query_id == query_id])
                return
            for p in live:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        for p, value in zip(live, scores, strict=True):
            if not p.future.done():
                p.future.set_result(value)
