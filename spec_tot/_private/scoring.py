"""Reward batching for the baseline schedule.

Branches of one query wait at their reward node; the query's batch is scored in one call
(per scorer) once every live unscored branch of the query is waiting, which is exactly a
search-and-learn round. Scores are normalised to a tuple of per-step floats.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spec_tot._private.compiled import maybe_await
from spec_tot.backends import RewardBackend
from spec_tot.errors import ExecutionError
from spec_tot.graph import GraphNode, State
from spec_tot.metrics import MetricsRecorder
from spec_tot.requests import RewardItem

__all__ = ["RewardRouter", "call_scorer"]

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


def _tokens(scorer: Scorer, item: RewardItem) -> int:
    if isinstance(scorer, RewardBackend):
        return scorer.count_item_tokens(item)
    return max(1, len(item.question) // 4 + len(item.text) // 4)


@dataclass(slots=True)
class _Pending:
    scorer: Scorer
    item: RewardItem
    future: asyncio.Future[tuple[float, ...]]


@dataclass(slots=True)
class _QueryBatch:
    unscored: int = 0
    pending: list[_Pending] = field(default_factory=list)


class RewardRouter:
    """Per-query round batching of reward calls (shared by all queries of a run)."""

    def __init__(self, default_scorer: Scorer | None, recorder: MetricsRecorder) -> None:
        self._default = default_scorer
        self._recorder = recorder
        self._queries: dict[str, _QueryBatch] = {}
        self._flushes: set[asyncio.Task[None]] = set()

    def segment_started(self, query_id: str) -> None:
        self._queries.setdefault(query_id, _QueryBatch()).unscored += 1

    def segment_ended_unscored(self, query_id: str) -> None:
        batch = self._queries.get(query_id)
        if batch is not None:
            batch.unscored -= 1
            self._maybe_flush(batch)

    def forget(self, query_id: str) -> None:
        batch = self._queries.pop(query_id, None)
        if batch is not None:
            for pending in batch.pending:
                pending.future.cancel()

    async def score(
        self, query_id: str, node_id: str, reward_node: GraphNode, state: State
    ) -> tuple[float, ...]:
        scorer = reward_node.scorer if reward_node.scorer is not None else self._default
        if scorer is None or reward_node.reward_input is None:
            raise ExecutionError(f"reward node {reward_node.name!r} has no scorer")
        question, steps = reward_node.reward_input(state)
        item = RewardItem(request_id=node_id, question=question, steps=tuple(steps))
        future: asyncio.Future[tuple[float, ...]] = asyncio.get_running_loop().create_future()
        batch = self._queries.setdefault(query_id, _QueryBatch())
        batch.pending.append(_Pending(scorer, item, future))
        self._maybe_flush(batch)
        try:
            return await future
        finally:
            batch.unscored -= 1
            self._maybe_flush(batch)

    def _maybe_flush(self, batch: _QueryBatch) -> None:
        if not batch.pending or len(batch.pending) < batch.unscored:
            return
        pending, batch.pending = batch.pending, []
        task = asyncio.get_running_loop().create_task(self._flush(pending))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self, pending: list[_Pending]) -> None:
        groups: dict[int, list[_Pending]] = {}
        for entry in pending:
            groups.setdefault(id(entry.scorer), []).append(entry)
        for group in groups.values():
            live = [p for p in group if not p.future.done()]
            if not live:
                continue
            scorer = live[0].scorer
            items = [p.item for p in live]
            try:
                self._recorder.reward_call(len(items), sum(_tokens(scorer, i) for i in items))
                scores = await call_scorer(scorer, items)
            except Exception as exc:
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, value in zip(live, scores, strict=True):
                if not p.future.done():
                    p.future.set_result(value)
