"""RunMetrics and MetricsRecorder: exact keys, JSON-able, and figures consistent with the run."""

from __future__ import annotations

import json
import math

import pytest

from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.graphs.toy import compile_toy
from spec_tot.metrics import METRIC_KEYS, MetricsRecorder, QueryRecord, RunMetrics
from spec_tot.tree import NodeStatus

EXTRAS = {
    "draft_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "tokens_per_step",
    "failed",
    "cancelled",
    "speculative_nodes",
    "speculative_hits",
    "reward_items",
    "nodes",
    "executor_cpu_s",
    "executor_cpu_us_per_token",
    "generation_pending_s",
    "reward_pending_s",
    "peak_rss_mb",
    "useful_tokens_per_s",
}
BEAM = {"search": "beam", "search_params": {"n": 4, "width": 2}}


def record(
    qid: str,
    *,
    status: str = "ok",
    solved: bool = True,
    latency: float = 1.0,
    tokens: int = 10,
    wasted: int = 0,
    nodes: int = 3,
) -> QueryRecord:
    return QueryRecord(qid, status, solved, latency, tokens, wasted, nodes)


async def _mixed_run() -> tuple[ScriptedBackend, object]:
    backend = ScriptedBackend(ScriptedConfig(fail_reward_questions=("puzzle q2",)))
    app = compile_toy(backend=backend, **BEAM)
    queries = [{"question": f"puzzle q{i}", "query_id": f"q{i}", "target": "24"} for i in range(5)]
    return backend, await app.arun_batch(queries)


async def test_to_dict_has_exactly_the_documented_keys_and_is_json() -> None:
    _, batch = await _mixed_run()
    data = batch.metrics.to_dict()  # type: ignore[attr-defined]
    assert set(data) == set(METRIC_KEYS) | EXTRAS
    assert len(METRIC_KEYS) == len(set(METRIC_KEYS)) == 16
    assert list(data)[: len(METRIC_KEYS)] == list(METRIC_KEYS)  # documented order first
    text = json.dumps(data)
    assert json.loads(text) == data
    for key, value in data.items():
        assert type(value) in (int, float), (key, type(value))  # no numpy scalars leak out


async def test_metrics_match_the_run() -> None:
    backend, batch = await _mixed_run()
    m = batch.metrics  # type: ignore[attr-defined]
    results = batch.results  # type: ignore[attr-defined]
    nodes = [n for r in results for n in r.tree.nodes() if n.parent is not None]
    assert m.queries == 5
    assert m.solved == sum(r.solved for r in results)
    status = {r.query_id: r.status for r in results}
    assert status == {"q0": "ok", "q1": "ok", "q2": "failed", "q3": "ok", "q4": "ok"}
    assert 0 < m.solved <= 4
    assert m.accuracy == pytest.approx(m.solved / m.queries)
    assert m.failed == 1 and m.cancelled == 0
    assert m.output_tokens == sum(n.num_tokens for n in nodes) == backend.num_generated_tokens
    cancelled = [n for n in nodes if n.status is NodeStatus.CANCELLED]
    assert cancelled  # q2's candidates were generated, then failed at the reward
    assert m.wasted_tokens == sum(n.num_tokens for n in cancelled) > 0
    assert m.wasted_tokens < m.output_tokens
    assert m.nodes == len(nodes)
    assert m.reward_calls == backend.num_score_calls
    scored = [n for n in nodes if n.status is NodeStatus.SCORED]
    assert m.reward_items == len(scored) + len(cancelled)  # q2's batch was sent, then failed
    assert m.reward_batch_tokens_mean > 0
    assert m.peak_inflight >= 1
    assert m.peak_inflight <= backend.peak_inflight
    assert 0 < m.latency_p50_s <= m.latency_p99_s <= m.wall_s
    assert m.latency_p99_s <= max(r.latency_s for r in results) + 1e-9
    assert m.queries_per_s == pytest.approx(m.queries / m.wall_s)
    assert m.tokens_per_s == pytest.approx(m.output_tokens / m.wall_s)
    assert m.goodput == pytest.approx(m.solved / m.wall_s)  # all within the 60 s deadline
    assert m.spec_hit_rate == 0.0 and m.speculative_nodes == 0  # baseline never speculates
    assert m.peak_kv_blocks == 0  # the scripted backend has no KV cache
    # where the time went from the executor's side: some with calls out, none past the run
    assert 0 < m.generation_pending_s <= m.wall_s + 1e-9
    assert 0 < m.reward_pending_s <= m.wall_s + 1e-9


def test_empty_summary_is_all_zero_and_finite() -> None:
    m = MetricsRecorder().summary(wall_s=0.0)
    data = m.to_dict()
    assert all(math.isfinite(v) for v in data.values())
    assert m.queries == 0 and m.accuracy == 0.0
    assert m.latency_p50_s == m.latency_p99_s == 0.0
    assert m.reward_batch_tokens_mean == 0.0 and m.spec_hit_rate == 0.0
    assert m.wall_s > 0  # clamped, so the rates never divide by zero


def test_recorder_inflight_peak_and_reward_calls() -> None:
    rec = MetricsRecorder()
    for _ in range(3):
        rec.request_started()
    rec.request_finished()
    rec.request_started()
    rec.request_finished()
    rec.request_finished()
    assert rec.inflight == 1
    assert rec.peak_inflight == 3
    rec.reward_call(4, 100)
    rec.reward_call(2, 20)
    m = rec.summary(wall_s=2.0)
    assert m.peak_inflight == 3
    assert m.reward_calls == 2 and m.reward_items == 6
    assert m.reward_batch_tokens_mean == pytest.approx(60.0)


def test_summary_counts_statuses_latency_and_goodput() -> None:
    rec = MetricsRecorder(goodput_deadline_s=2.0)
    rec.query_finished(record("a", latency=1.0, tokens=10))
    rec.query_finished(record("b", latency=3.0, tokens=20))  # solved, but past the deadline
    rec.query_finished(record("c", status="failed", solved=False, latency=0.5, wasted=5))
    rec.query_finished(record("d", status="timeout", solved=False, latency=9.0))
    rec.query_finished(record("e", status="cancelled", solved=False, latency=0.1))
    rec.speculative_nodes, rec.speculative_hits = 8, 6
    m = rec.summary(peak_kv_blocks=17, wall_s=4.0)
    assert m.queries == 5 and m.solved == 2
    assert m.accuracy == pytest.approx(0.4)
    assert m.failed == 1 and m.cancelled == 2  # timeout counts as cancelled
    assert m.goodput == pytest.approx(1 / 4.0)
    assert m.output_tokens == 60 and m.wasted_tokens == 5
    assert m.tokens_per_s == pytest.approx(15.0)
    assert m.queries_per_s == pytest.approx(1.25)
    assert m.latency_p50_s == pytest.approx(1.0)
    assert 3.0 < m.latency_p99_s <= 9.0
    assert m.spec_hit_rate == pytest.approx(0.75)
    assert m.peak_kv_blocks == 17
    assert m.nodes == 15


def test_run_metrics_is_frozen() -> None:
    m = MetricsRecorder().summary(wall_s=1.0)
    assert isinstance(m, RunMetrics)
    with pytest.raises(AttributeError):
        m.queries = 3  # type: ignore[misc]
