"""Running a batch of queries on one backend: each query gets its controller, the batch its
metrics, and every query the backend's shared reward router and speculation dispatcher (its
``BackendHub``: one per backend, whatever the app, batch or call).

Seeds follow ``spec_tot.seeds``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from spec_tot._private.compiled import CompiledGraph
from spec_tot.backends import GenerationBackend
from spec_tot.config import ExecutorConfig
from spec_tot.events import EventSink
from spec_tot.executor.context import QueryContext
from spec_tot.executor.controller import QueryController, record_for
from spec_tot.executor.dispatcher import Dispatcher
from spec_tot.executor.hub import BackendHub, QueryInput
from spec_tot.executor.reward_router import RewardRouter, calibrated_lv
from spec_tot.executor.reward_rules import BatchRule, EagerRule, LazyRule, RoundRule
from spec_tot.graph_nodes import State
from spec_tot.metrics import MetricsRecorder
from spec_tot.policies.base import SearchPolicy
from spec_tot.results import BatchResult, ToTResult
from spec_tot.seeds import query_seed
from spec_tot.tree import SearchTree

__all__ = ["RunSpec", "run_queries"]


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What a batch needs of a compiled app."""

    graph: CompiledGraph
    policy_factory: Callable[[], SearchPolicy]
    backend: GenerationBackend
    hub: BackendHub  # the backend's (looked up once per call, by the caller)
    reward: Any  # the default scorer (RewardBackend, callable or None)
    config: ExecutorConfig
    answer_fn: Callable[[State], str | None]
    check: Callable[[State, str | None], bool] | None


def _batch_rule(run_spec: RunSpec, dispatcher: Dispatcher) -> BatchRule:
    config = run_spec.config
    spec = config.speculation
    if spec.round_rewards:
        return RoundRule()
    if spec.lv is None:
        return EagerRule()
    caps = run_spec.backend.capabilities
    lv = calibrated_lv(spec.lv, config.speculation_overrides.get("lv"), caps)
    capacity = caps.saturation_batch
    busy = None
    if spec.adaptive:
        busy = lambda: dispatcher.committed >= capacity  # noqa: E731
    # Loaded: committed work fills half the engine's saturation batch. LV's time rules then
    # rest (an early score only steers speculation, worth little then).
    saturated = lambda: 2 * dispatcher.committed >= capacity  # noqa: E731
    return LazyRule(lv, busy, saturated)


async def run_queries(
    run_spec: RunSpec,
    queries: Sequence[QueryInput],
    *,
    max_concurrency: int,
    on_result: Callable[[ToTResult], None] | None = None,
    on_event: EventSink | None = None,
    release: Callable[[str], None] | None = None,
) -> BatchResult:
    """Run ``queries`` concurrently (at most ``max_concurrency`` at once); one's failure
    never stops the others. ``release(query_id)`` is called as each one ends."""
    config = run_spec.config
    recorder = MetricsRecorder(goodput_deadline_s=config.goodput_deadline_s)
    hub = run_spec.hub
    hub.recall_hit_rates(config.hit_rates)  # a bad file is refused before any query starts
    dispatcher, router = hub.dispatcher, hub.router()
    rule = _batch_rule(run_spec, dispatcher)
    limit = asyncio.Semaphore(max_concurrency)

    async def one(query: QueryInput) -> ToTResult:
        try:
            async with limit:
                result = await _run_one(
                    run_spec, query, recorder, router, rule, dispatcher, on_event=on_event
                )
        finally:
            if release is not None:
                release(query.query_id)
        if on_result is not None:
            on_result(result)
        return result

    loop = asyncio.get_running_loop()
    started, cpu_started = loop.time(), time.thread_time()
    results = await asyncio.gather(*(one(q) for q in queries))
    wall = loop.time() - started
    # CPU of the event-loop thread: the executor's own cost (engines run elsewhere).
    recorder.executor_cpu_s = time.thread_time() - cpu_started
    hub.keep_hit_rates(config.hit_rates)
    peak_kv = int(run_spec.backend.stats().get("peak_kv_blocks", 0))
    return BatchResult(list(results), recorder.summary(peak_kv_blocks=peak_kv, wall_s=wall))


def _controller(
    run_spec: RunSpec,
    query: QueryInput,
    tree: SearchTree,
    recorder: MetricsRecorder,
    router: RewardRouter,
    rule: BatchRule,
    dispatcher: Dispatcher,
    on_event: EventSink | None,
) -> QueryController:
    """The query's controller, its context built and its reward routing opened."""
    config = run_spec.config
    ctx = QueryContext(
        graph=run_spec.graph,
        tree=tree,
        policy=run_spec.policy_factory(),
        backend=run_spec.backend,
        rewards=router,
        recorder=recorder,
        config=config,
        answer_fn=run_spec.answer_fn,
        seed=query_seed(config.seed, query.seed_key),
        dispatcher=dispatcher,
        on_event=on_event,
    )
    controller = QueryController(ctx)
    router.open_query(
        query.query_id,
        rule,
        recorder,
        run_spec.reward,
        config.query_timeout_s,
        steering=controller.steering,
    )
    return controller


async def _run_one(
    run_spec: RunSpec,
    query: QueryInput,
    recorder: MetricsRecorder,
    router: RewardRouter,
    rule: BatchRule,
    dispatcher: Dispatcher,
    *,
    on_event: EventSink | None,
) -> ToTResult:
    state, query_id, config = query.state, query.query_id, run_spec.config
    tree = SearchTree(query_id, str(state["question"]), state)
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, answer, truncated = "ok", None, False
    errors: tuple[str, ...] = ()
    try:
        parts = (recorder, router, rule, dispatcher, on_event)
        controller = _controller(run_spec, query, tree, *parts)
        async with asyncio.timeout(config.query_timeout_s):
            outcome = await controller.run()
        answer, errors, truncated = outcome.answer, outcome.errors, outcome.truncated
        if answer is None and errors:
            status = "failed"
    except TimeoutError:
        status = "timeout"
        errors = (f"query {query_id} exceeded {config.query_timeout_s}s",)
    except asyncio.CancelledError:
        recorder.query_finished(record_for(tree, "cancelled", False, loop.time() - started))
        raise
    except Exception as exc:
        status, errors = "failed", (f"{query_id}: {type(exc).__name__}: {exc}",)
    text = answer.text if answer is not None else None
    solved = bool(run_spec.check(state, text)) if run_spec.check is not None and text else False
    record = record_for(tree, status, solved, loop.time() - started)
    recorder.query_finished(record)
    return ToTResult(
        query_id=query_id,
        answer=text,
        score=answer.score if answer is not None else None,
        solved=solved,
        status=status,
        tree=tree,
        latency_s=record.latency_s,
        errors=tuple(errors),
        truncated=truncated,
        votes=dict(answer.votes) if answer is not None else {},
    )
