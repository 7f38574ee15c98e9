"""The reward router: branches waiting at reward nodes hand their items here; a ``BatchRule``
(``spec_tot.executor.batching``) decides when each queue is scored, and the router runs the
batches, normalises the scores and hands each one back to its branch.

Scores are normalised to a tuple of per-step floats.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from spec_tot._private.compiled import maybe_await
from spec_tot.backends import RewardBackend
from spec_tot.config import LazyVerification
from spec_tot.errors import ExecutionError
from spec_tot.executor.batching import BatchRule, Pending, Queue
from spec_tot.metrics import MetricsRecorder
from spec_tot.nodes import GraphNode, State
from spec_tot.requests import Capabilities, RewardItem

__all__ = ["RewardRouter", "calibrated_lv", "call_scorer"]

Scorer = RewardBackend | Any


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


def _tokens(scorer: Scorer, item: RewardItem) -> int:
    if isinstance(scorer, RewardBackend):
        return scorer.count_item_tokens(item)
    return max(1, len(item.question) // 4 + len(item.text) // 4)


@dataclass(slots=True)
class _Query:
    rule: BatchRule
    recorder: MetricsRecorder
    default: Scorer | None
    committed_unscored: int = 0
    pending_committed: int = 0

    @property
    def group_complete(self) -> bool:
        return 0 < self.committed_unscored <= self.pending_committed


class RewardRouter:
    """Shared by the queries on one event loop (no locks). Each query opens with its batch
    rule, its metrics recorder and its default scorer."""

    def __init__(self) -> None:
        self._queries: dict[str, _Query] = {}
        self._queues: dict[Hashable, Queue] = {}
        self._rules: dict[Hashable, BatchRule] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._unresolved: dict[str, Pending] = {}  # node id -> its item, until scored

    # -- queries ------------------------------------------------------------------------------
    def open_query(
        self,
        query_id: str,
        rule: BatchRule,
        recorder: MetricsRecorder,
        default_scorer: Scorer | None,
    ) -> None:
        self._queries[query_id] = _Query(rule, recorder, default_scorer)

    def group_complete(self, query_id: str) -> bool:
        query = self._queries.get(query_id)
        return query is not None and query.group_complete

    # -- branch accounting (committed branches only decide a round) --------------------------
    def segment_started(self, query_id: str, *, speculative: bool) -> None:
        query = self._queries.get(query_id)
        if query is not None and not speculative:
            query.committed_unscored += 1

    def adopt(self, query_id: str, node_id: str) -> None:
        """A speculative branch became committed before its score came back: from now on it
        counts for its query's sibling group, wherever it is (before its reward, waiting in
        a queue, or in a batch being scored)."""
        query = self._queries.get(query_id)
        if query is None:
            return
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
        for key, queue in list(self._queues.items()):
            for p in queue.items:
                if p.query_id == query_id:
                    p.future.cancel()
            queue.items = [p for p in queue.items if p.query_id != query_id]
            if not queue.items:
                self._drop_queue(key)

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
        query = self._queries[query_id]
        try:
            item, scorer = self._prepare(node_id, reward_node, state, query.default)
            tokens = _tokens(scorer, item)
        except Exception:
            # Never registered: release the branch so its round can still complete.
            self.segment_ended_unscored(query_id, speculative=speculative)
            raise
        loop = asyncio.get_running_loop()
        key = query.rule.key(query_id)
        pending = Pending(
            query_id,
            node_id,
            scorer,
            item,
            speculative,
            tokens,
            loop.create_future(),
            loop.time(),
            key=key,
        )
        self._rules[key] = query.rule
        self._queues.setdefault(key, Queue()).items.append(pending)
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
                waiting = self._queues.get(key)
                if waiting is not None and pending in waiting.items:
                    waiting.items.remove(pending)
                if pending.counted:
                    query.pending_committed -= 1
            if pending.counted:
                query.committed_unscored -= 1
            self._check(query_id)

    @staticmethod
    def _prepare(
        node_id: str, reward_node: GraphNode, state: State, default: Scorer | None
    ) -> tuple[RewardItem, Scorer]:
        scorer = reward_node.scorer if reward_node.scorer is not None else default
        if scorer is None or reward_node.reward_input is None:
            raise ExecutionError(f"reward node {reward_node.name!r} has no scorer")
        question, steps = reward_node.reward_input(state)
        return RewardItem(request_id=node_id, question=question, steps=tuple(steps)), scorer

    # -- what batch rules call ----------------------------------------------------------------
    def queue(self, key: Hashable) -> Queue | None:
        return self._queues.get(key)

    def _check(self, query_id: str) -> None:
        query = self._queries.get(query_id)
        if query is not None:
            query.rule.check(self, query.rule.key(query_id), query_id)

    def schedule_tick(self, key: Hashable) -> None:
        """One decision per loop tick, so the completions of one engine step share a batch."""
        queue = self._queues.get(key)
        if queue is not None and queue.items and not queue.tick_scheduled:
            queue.tick_scheduled = True
            asyncio.get_running_loop().call_soon(self._on_tick, key)

    def _on_tick(self, key: Hashable) -> None:
        queue = self._queues.get(key)
        if queue is not None:
            queue.tick_scheduled = False
            self._rules[key].on_tick(self, key)

    def fire_timer(self, key: Hashable) -> None:
        queue = self._queues.get(key)
        if queue is None:
            return
        queue.timer = None
        if queue.items:
            self._rules[key].on_timer(self, key)

    def flush(
        self,
        key: Hashable,
        select: Callable[[list[Pending]], tuple[list[Pending], list[Pending]]] | None = None,
    ) -> None:
        """Score the queue ``key`` now: all of it, or what ``select`` picks (the rest waits
        and gets a fresh decision next tick)."""
        queue = self._queues.get(key)
        if queue is None or not queue.items:
            return
        if queue.timer is not None:
            queue.timer.cancel()
            queue.timer = None
        batch, rest = (queue.items, []) if select is None else select(queue.items)
        queue.items = rest
        if rest:
            self.schedule_tick(key)
        if not batch:
            return
        for p in batch:  # in flight now: no longer "waiting" for the group rule
            p.queued = False
            query = self._queries.get(p.query_id)
            if p.counted and query is not None:
                query.pending_committed -= 1
        # Committed work first: its scores unblock the policy.
        batch = sorted(batch, key=lambda p: p.speculative)
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _drop_queue(self, key: Hashable) -> None:
        queue = self._queues.pop(key, None)
        if queue is not None and queue.timer is not None:
            queue.timer.cancel()

    # -- running batches ----------------------------------------------------------------------
    async def _run(self, pending: list[Pending]) -> None:
        groups: dict[int, list[Pending]] = {}
        for entry in pending:
            groups.setdefault(id(entry.scorer), []).append(entry)
        for group in groups.values():
            await self._score_group(group)

    async def _score_group(self, group: list[Pending]) -> None:
        live = [p for p in group if not p.future.done()]
        if not live:
            return
        try:
            self._record(live)
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

    def _record(self, live: list[Pending]) -> None:
        """One reward call in the metrics of each run that has items in it."""
        by_recorder: dict[int, tuple[MetricsRecorder, list[Pending]]] = {}
        for p in live:
            query = self._queries.get(p.query_id)
            if query is not None:
                by_recorder.setdefault(id(query.recorder), (query.recorder, []))[1].append(p)
        for recorder, items in by_recorder.values():
            recorder.reward_call(len(items), sum(p.tokens for p in items))
