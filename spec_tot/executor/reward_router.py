"""The reward router: branches waiting at reward nodes hand their items here; a ``BatchRule``
(``spec_tot.executor.reward_rules``) decides when each queue is scored, and the router runs the
batches, normalises the scores and hands each one back to its branch.

Scores are normalised to a tuple of per-step floats.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from spec_tot.backends import RewardBackend
from spec_tot.config import LazyVerification
from spec_tot.errors import ExecutionError
from spec_tot.executor.reward_calls import ScoreCalls
from spec_tot.executor.reward_rules import BatchRule, Pending, Queue
from spec_tot.executor.reward_scorer import Scorer
from spec_tot.graph_nodes import GraphNode, State
from spec_tot.metrics import MetricsRecorder
from spec_tot.requests import Capabilities, RewardItem

__all__ = ["RewardRouter", "calibrated_lv"]


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
    timeout_s: float | None = None
    # True while an early score would steer the query's speculation (predictions, pruning)
    steering: Callable[[], bool] = lambda: True
    # Committed branches that will reach the router (or end) and are not scored yet, and
    # those of them whose item waits in a queue (not yet in a batch being scored).
    expected: set[str] = field(default_factory=set)
    queued: set[str] = field(default_factory=set)

    @property
    def group_complete(self) -> bool:
        return bool(self.expected) and self.expected <= self.queued


class RewardRouter:
    """Shared by the queries on one event loop (no locks). Each query opens with its batch
    rule, its metrics recorder and its default scorer.

    Committed branches decide sibling groups: ``expect(node)`` when a committed branch
    starts (or a running speculative one is adopted before its score), ``release(node)``
    when it ends; both idempotent."""

    def __init__(self) -> None:
        self._queries: dict[str, _Query] = {}
        self._queues: dict[Hashable, Queue] = {}
        self._rules: dict[Hashable, BatchRule] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight: dict[Hashable, int] = {}  # queue key -> its batches being scored
        self._calls = ScoreCalls(self._query_info)
        self._unresolved: dict[str, Pending] = {}  # node id -> its item, until scored

    @property
    def item_s(self) -> float:
        """About what scoring one item costs (a reward call's latency per item)."""
        return self._calls.item_s

    # -- queries ------------------------------------------------------------------------------
    def open_query(
        self,
        query_id: str,
        rule: BatchRule,
        recorder: MetricsRecorder,
        default_scorer: Scorer | None,
        timeout_s: float | None = None,
        steering: Callable[[], bool] | None = None,
    ) -> None:
        """``steering()``: whether an early score of this query's items would steer its
        speculation now (lazy verification sends a lone committed item early only then)."""
        query = _Query(rule, recorder, default_scorer, timeout_s)
        if steering is not None:
            query.steering = steering
        self._queries[query_id] = query

    def group_complete(self, query_id: str) -> bool:
        query = self._queries.get(query_id)
        return query is not None and query.group_complete

    def urgent(self, query_id: str) -> bool:
        """A committed item of this query should not wait: its round is complete (the
        critical path runs through it), or its score would steer speculation now."""
        query = self._queries.get(query_id)
        return query is not None and (query.group_complete or query.steering())

    # -- committed branches -------------------------------------------------------------------
    def expect(self, query_id: str, node_id: str) -> None:
        """A committed branch (new, or a speculative one just adopted) will reach the router
        or end: it counts for its query's sibling group from now on, wherever it is."""
        query = self._queries.get(query_id)
        if query is None or node_id in query.expected:
            return
        query.expected.add(node_id)
        pending = self._unresolved.get(node_id)
        if pending is not None:
            pending.speculative = False
            if pending.queued:
                query.queued.add(node_id)
        self._check(query_id)

    def release(self, query_id: str, node_id: str) -> None:
        """The branch ended, or its score came back."""
        query = self._queries.get(query_id)
        if query is not None and node_id in query.expected:
            query.expected.discard(node_id)
            query.queued.discard(node_id)
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
        self._calls.forget(query_id)

    # -- scoring ------------------------------------------------------------------------------
    def prepare(
        self, query_id: str, node_id: str, reward_node: GraphNode, state: State
    ) -> tuple[RewardItem, Scorer]:
        """The item a branch at ``reward_node`` hands in, and who scores it."""
        query = self._queries.get(query_id)
        default = query.default if query is not None else None
        scorer = reward_node.scorer if reward_node.scorer is not None else default
        if scorer is None or reward_node.reward_input is None:
            raise ExecutionError(f"reward node {reward_node.name!r} has no scorer")
        question, steps = reward_node.reward_input(state)
        return RewardItem(request_id=node_id, question=question, steps=tuple(steps)), scorer

    async def score(
        self,
        query_id: str,
        item: RewardItem,
        scorer: Scorer,
        *,
        speculative: bool,
        node_name: str,
    ) -> tuple[float, ...]:
        """Queue ``item`` (its ``request_id`` is the node id) and wait for its checked
        per-step scores; a bad score raises ``ExecutionError`` naming ``node_name``."""
        query = self._queries[query_id]
        node_id = item.request_id
        loop = asyncio.get_running_loop()
        key = query.rule.key(query_id)
        pending = Pending(
            query_id,
            node_id,
            scorer,
            item,
            speculative and node_id not in query.expected,
            _tokens(scorer, item),
            loop.create_future(),
            loop.time(),
            key=key,
            node_name=node_name,
        )
        self._rules[key] = query.rule
        self._queues.setdefault(key, Queue()).items.append(pending)
        self._unresolved[node_id] = pending
        if not speculative:
            query.expected.add(node_id)
        if node_id in query.expected:
            query.queued.add(node_id)
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
            self.release(query_id, node_id)

    # -- what batch rules call ----------------------------------------------------------------
    def queue(self, key: Hashable) -> Queue | None:
        return self._queues.get(key)

    def batches_in_flight(self, key: Hashable) -> int:
        return self._inflight.get(key, 0)

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
            if query is not None:
                query.queued.discard(p.node_id)
        # Committed work first: its scores unblock the policy.
        batch = sorted(batch, key=lambda p: p.speculative)
        task = asyncio.get_running_loop().create_task(self._calls.run(batch))
        self._tasks.add(task)
        self._inflight[key] = self._inflight.get(key, 0) + 1
        task.add_done_callback(lambda t: self._batch_done(key, t))

    def _batch_done(self, key: Hashable, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._inflight[key] -= 1
        if not self._inflight[key]:
            del self._inflight[key]
        rule = self._rules.get(key)
        if rule is not None and key in self._queues:
            rule.on_batch_done(self, key)

    def _query_info(self, query_id: str) -> tuple[MetricsRecorder, float | None] | None:
        query = self._queries.get(query_id)
        return None if query is None else (query.recorder, query.timeout_s)

    def _drop_queue(self, key: Hashable) -> None:
        queue = self._queues.pop(key, None)
        if queue is not None and queue.timer is not None:
            queue.timer.cancel()
