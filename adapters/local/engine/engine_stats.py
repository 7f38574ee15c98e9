"""The engine's counters and the ``stats()`` it reports (peak KV blocks, steps by kind,
dedup savings, stage times, CUDA graph use, token speculation)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .tokenspec import SpecCounters

__all__ = ["StepCounters", "engine_stats", "reset_engine_counters"]


@dataclass
class StepCounters:
    """What the engine's steps have done since start (or the last reset)."""

    num_steps: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_mixed_steps: int = 0
    num_aborted_requests: int = 0
    num_failed_requests: int = 0
    num_computed_prompt_tokens: int = 0
    num_forward_rows: int = 0
    peak_kv_blocks_used: int = 0
    peak_running_seqs: int = 0
    step_seconds: float = 0.0  # wall time inside step(): scheduling, forward, sampling

    def record_step(self, num_rows: int, num_decode: int, blocks_used: int, running: int) -> None:
        self.num_steps += 1
        decode_only = num_decode == num_rows
        self.num_decode_steps += decode_only
        self.num_prefill_steps += num_decode == 0
        self.num_mixed_steps += not decode_only and num_decode > 0
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, blocks_used)
        self.peak_running_seqs = max(self.peak_running_seqs, running)

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, type(getattr(self, f.name))(0))

    def as_stats(self) -> dict[str, float]:
        # per emitted step batch: plain attribute reads, not asdict's deep copies
        return {name: float(getattr(self, name)) for name in _NAMES}


_NAMES = tuple(f.name for f in dataclasses.fields(StepCounters))


def reset_engine_counters(engine: Any) -> None:
    """Zero every counter of ``engine`` and its parts (after start-up calibration: its
    steps are not the caller's)."""
    engine.counters.reset()
    engine.post.num_generated_tokens = engine.post.num_forks = 0
    engine.intake.num_requests = engine.intake.num_merged_requests = 0
    engine.intake.num_prompt_tokens = 0
    engine.block_manager.num_prefix_hit_blocks = engine.block_manager.num_cow_copies = 0
    engine.scheduler.num_preemptions = 0
    if engine.speculator is not None:
        engine.speculator.reset_counters()
    if engine.runner.graphs is not None:
        engine.runner.graphs.reset_counters()
    engine.clock.reset()
    engine.runner.gpu.reset()


def engine_stats(engine: Any) -> dict[str, float]:
    """``LLMEngine.stats()``: every counter of the engine and its parts, as floats."""
    bm, counters = engine.block_manager, engine.counters
    generated = engine.post.num_generated_tokens
    out = counters.as_stats()
    out.update(
        num_requests=float(engine.intake.num_requests),
        num_merged_requests=float(engine.intake.num_merged_requests),
        num_prompt_tokens=float(engine.intake.num_prompt_tokens),
        num_generated_tokens=float(generated),
        num_forks=float(engine.post.num_forks),
        peak_kv_blocks=float(counters.peak_kv_blocks_used),
        num_total_blocks=float(bm.num_total_blocks),
        num_free_blocks=float(bm.num_free_blocks),
        num_prefix_hit_blocks=float(bm.num_prefix_hit_blocks),
        num_cached_prompt_tokens=float(bm.num_prefix_hit_blocks * bm.block_size),
        num_cow_copies=float(bm.num_cow_copies),
        num_preemptions=float(engine.scheduler.num_preemptions),
        num_running=float(len(engine.scheduler.running)),
        num_waiting=float(engine.scheduler.num_waiting),
        num_dedup_saved_tokens=float(generated - counters.num_forward_rows),
    )
    out.update(engine.clock.as_stats("stage_"))
    out["stage_gpu_forward_s"] = engine.runner.gpu.seconds
    graphs = engine.runner.graphs
    if graphs is not None:
        g = graphs.stats()
        out.update(
            num_graph_steps=float(g.graph_steps),
            num_eager_steps=float(g.eager_steps),
            num_graphs_captured=float(g.graphs_captured),
            num_graph_padded_tokens=float(g.padded_tokens),
            graph_capture_s=engine.graph_capture_seconds,
        )
    spec = engine.speculator
    out.update(spec.counters.as_stats() if spec is not None else SpecCounters().as_stats())
    return out
