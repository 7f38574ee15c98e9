"""Running reward batches: one scorer call per group of items, each item's score checked
and handed back alone. A call shared by several queries that fails, or runs far longer than
calls do (a hanging scorer), is split: each query is scored alone, so only the query whose
items are bad waits or fails (a hanging call is cancelled before its items are sent again,
and once nobody waits for it).

A sync scorer runs in a thread that cannot be cancelled, so its calls never mix queries: a
batch is scored one call per query, and a query's next call waits for its previous one. A
call that blocks then holds only its own query, which ends at its deadline (its late result
discarded); its items are never sent again, and the other queries never wait for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from spec_tot.errors import ExecutionError
from spec_tot.executor.reward_rules import Pending
from spec_tot.executor.reward_scorer import call_scorer, check_score, is_sync_scorer, score_range
from spec_tot.metrics import MetricsRecorder

__all__ = ["ScoreCalls"]

# A shared call that runs longer than this many times a typical call (and at least
# _MIN_HANG_S, at most a quarter of the shortest deadline among its queries) is split.
_HANG_FACTOR = 8.0
_MIN_HANG_S = 0.05
# Before any call has finished there is no typical call: a run's first shared batch (every
# query's first items, while the engine prefills them all) is slow, not hung. Splitting it
# at _MIN_HANG_S scored a whole wave twice (REST-MCTS* at 16 in flight: 56 items).
_COLD_HANG_S = 2.0

QueryInfo = Callable[[str], "tuple[MetricsRecorder, float | None] | None"]


class ScoreCalls:
    def __init__(self, query_info: QueryInfo) -> None:
        """``query_info(query_id)``: the query's metrics recorder and deadline, or None once
        it has ended."""
        self._query_info = query_info
        self._calls: dict[asyncio.Task[list[Any]], list[Pending]] = {}
        self._latency: float | None = None  # moving average of a call's latency
        self.item_s = 0.0  # moving average of a call's latency per item it scored
        self._turns: dict[str, asyncio.Lock] = {}  # query -> its sync scorer calls, in turn

    def forget(self, query_id: str) -> None:
        """``query_id`` ended: its items' futures are cancelled, and a call that nobody waits
        for any more (a hanging scorer of a timed-out query) is cancelled."""
        for call, items in list(self._calls.items()):
            for p in items:
                if p.query_id == query_id:
                    p.future.cancel()
            if all(p.future.done() for p in items):
                call.cancel()
        self._turns.pop(query_id, None)

    async def run(self, pending: list[Pending]) -> None:
        groups: dict[int, list[Pending]] = {}
        for entry in pending:
            groups.setdefault(id(entry.scorer), []).append(entry)
        if len(groups) == 1:
            await self._score_group(pending)
        else:  # one slow scorer must not hold another's items
            await asyncio.gather(*(self._score_group(g) for g in groups.values()))

    async def _score_group(self, group: list[Pending]) -> None:
        """Score ``group`` (one scorer): in one call, or, for a sync scorer, one call per
        query, each after that query's previous call."""
        live = [p for p in group if not p.future.done()]
        if not live:
            return
        queries = sorted({p.query_id for p in live})
        if is_sync_scorer(live[0].scorer):
            if len(queries) > 1:
                await self._split(live, queries)
                return
            async with self._turns.setdefault(queries[0], asyncio.Lock()):
                live = [p for p in live if not p.future.done()]  # its query may have ended
                if live:
                    await self._call(live, queries)
            return
        await self._call(live, queries)

    async def _call(self, live: list[Pending], queries: list[str]) -> None:
        """One scorer call for ``live``; a shared (async) call that hangs or fails is split."""
        recorders = self._record(live)
        for recorder in recorders:
            recorder.reward_started()
        try:
            await self._call_timed(live, queries)
        finally:
            for recorder in recorders:
                recorder.reward_finished()

    async def _call_timed(self, live: list[Pending], queries: list[str]) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        info = self._query_info(queries[0]) if len(queries) == 1 else None
        timeout = info[1] if info is not None else None
        call = loop.create_task(call_scorer(live[0].scorer, [p.item for p in live], timeout))
        self._calls[call] = live
        try:
            if len(queries) > 1:
                limit = self._hang_after(queries, len(live))
                done, _ = await asyncio.wait({call}, timeout=limit)
                if not done:
                    # End the hung call before its items are sent again: a scorer that is a
                    # model (the policy judging itself) keys its requests by item, and the
                    # same request twice in flight is refused.
                    call.cancel()
                    await asyncio.wait({call}, timeout=limit)
                if not done or call.exception() is not None:
                    await self._split(live, queries)
                    return
            scores = await call
        except asyncio.CancelledError:
            if call.cancelled() and not _cancelling():
                return  # every item's query ended (``forget``): nobody waits
            raise
        except Exception as exc:
            for p in live:
                if not p.future.done():
                    error = ExecutionError(
                        f"reward node {p.node_name!r}: {type(exc).__name__}: {exc}"
                    )
                    p.future.set_exception(error)
            return
        finally:
            self._calls.pop(call, None)
            if not call.done():
                call.cancel()  # its items were scored apart (or their queries ended)
        elapsed = loop.time() - started
        self._latency = elapsed if self._latency is None else 0.8 * self._latency + 0.2 * elapsed
        per_item = elapsed / len(live)
        self.item_s = per_item if not self.item_s else 0.8 * self.item_s + 0.2 * per_item
        for p, value in zip(live, scores, strict=True):
            if p.future.done():
                continue
            try:
                p.future.set_result(check_score(value, p.item, score_range(p.scorer)))
            except ValueError as exc:
                p.future.set_exception(ExecutionError(f"reward node {p.node_name!r}: {exc}"))

    async def _split(self, live: list[Pending], queries: list[str]) -> None:
        await asyncio.gather(
            *(self._score_group([p for p in live if p.query_id == q]) for q in queries)
        )

    def _hang_after(self, queries: list[str], items: int) -> float:
        """How long a shared call of ``items`` may run before its items are scored per
        query: well past what calls of its size take (a large lazy-verification batch is
        slower than the calls before it, not hung), and well within the queries' own
        deadlines."""
        if self._latency is None:
            limit = _COLD_HANG_S
        else:
            limit = max(_MIN_HANG_S, _HANG_FACTOR * max(self._latency, self.item_s * items))
        infos = [self._query_info(qid) for qid in queries]
        deadlines = [i[1] for i in infos if i is not None and i[1] is not None]
        return min(limit, min(deadlines) / 4) if deadlines else limit

    def _record(self, live: list[Pending]) -> list[MetricsRecorder]:
        """One reward call in the metrics of each run that has items in it; those runs'
        recorders."""
        by_recorder: dict[int, tuple[MetricsRecorder, list[Pending]]] = {}
        for p in live:
            info = self._query_info(p.query_id)
            if info is not None:
                by_recorder.setdefault(id(info[0]), (info[0], []))[1].append(p)
        for recorder, items in by_recorder.values():
            recorder.reward_call(len(items), sum(p.tokens for p in items))
        return [recorder for recorder, _ in by_recorder.values()]


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
