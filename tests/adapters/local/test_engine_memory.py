"""A long-running engine does not grow with the queries it served: the C heap is trimmed
after work, and every cache it keeps is bounded by size, not only by count
(issue 35, item 8; the 5,000-query curve is ``benchmarks/rss_curve.py``)."""

from __future__ import annotations

import gc
import tracemalloc

import torch
from engine_fixtures import make_engine, run_all, tiny_llama

from spec_tot.adapters.local.core.heap import HeapTrimmer
from spec_tot.adapters.local.engine.drafter import NgramDrafter
from spec_tot.adapters.local.engine.prm import prefix_keys
from spec_tot.drafting import DraftContext
from spec_tot.requests import GenerateRequest, SamplingParams

__all__ = ["make_engine", "tiny_llama"]

torch.set_num_threads(1)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trimmer_trims_after_work_when_idle_at_most_once_a_gap() -> None:
    calls: list[int] = []
    clock = _Clock()
    heap = HeapTrimmer(interval_s=10.0, idle_gap_s=1.0, clock=clock, trim=calls.append)
    clock.now = 5.0
    assert not heap.maybe_trim(idle=True)  # nothing ran: nothing to give back
    heap.worked()
    assert heap.maybe_trim(idle=True) and calls == [0]
    heap.worked()
    clock.now = 5.5
    assert not heap.maybe_trim(idle=True)  # a search idles many times a second
    clock.now = 6.5
    assert heap.maybe_trim(idle=True) and heap.trims == 2


def test_trimmer_under_steady_load_trims_every_interval() -> None:
    calls: list[int] = []
    clock = _Clock()
    heap = HeapTrimmer(interval_s=10.0, idle_gap_s=1.0, clock=clock, trim=calls.append)
    for t in range(1, 26):
        clock.now = float(t)
        heap.worked()
        heap.maybe_trim(idle=False)
    assert len(calls) == 3  # at once, then 10 s and 20 s later


def test_trimmer_without_glibc_does_nothing() -> None:
    heap = HeapTrimmer(libc=False)
    heap.worked()
    assert not heap.available and not heap.maybe_trim(idle=True)


def test_trimmer_finds_glibc_malloc_trim_here() -> None:
    heap = HeapTrimmer()  # Linux CI: glibc
    heap.worked()
    assert heap.available and heap.maybe_trim(idle=True)


def test_prefix_keys_are_the_digest_of_each_prefix() -> None:
    ids = list(range(100, 160))
    keys = prefix_keys(ids, [9, 19, 59])
    assert keys == [prefix_keys(ids[: t + 1], [t])[0] for t in (9, 19, 59)]
    assert prefix_keys(ids, [59, 9]) == [keys[2], keys[0]]  # out of order: same keys
    other = [*ids[:15], 7, *ids[16:]]
    assert prefix_keys(other, [9, 19]) == [keys[0], prefix_keys(other, [19])[0]]
    assert prefix_keys(other, [19]) != [keys[1]]
    assert all(len(k) == 16 for k in keys)


def _propose(drafter: NgramDrafter, tree: str, tokens: list[int]) -> list[int]:
    return list(drafter.propose(DraftContext(f"{tree}/n", tokens, 2, 4)))


def test_ngram_index_is_bounded_over_all_trees_and_keeps_the_live_one() -> None:
    drafter = NgramDrafter(max_n=3, min_n=2, max_trees=1000, max_total_entries=2000)
    live = [1, 2, 3, 4, 5, 6, 1, 2]
    for q in range(200):  # 200 finished queries of 120 distinct tokens each
        tokens = [1000 + 7 * q + i for i in range(120)]
        _propose(drafter, f"q{q}", tokens)
        assert _propose(drafter, "live", live) == [3, 4, 5, 6]
    entries = sum(len(t.entries) for t in drafter._trees.values())
    assert entries <= 2000 + 2 * 120  # the bound, plus the tree indexed last
    assert len(drafter._trees) < 20


def test_a_long_run_holds_no_more_python_memory_per_query(make_engine) -> None:
    """800 requests, each of a new tree with its own prompt (the main job's shape): after a
    warm-up that fills the bounded caches, the next 400 add no Python memory beyond noise.
    The leak this guards against (1-2 MB per 100 queries in the issue) would add 4-8 MB."""
    engine = make_engine(ngram_max=3, ngram_min=2, num_kv_blocks=512)
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=1)

    def wave(start: int) -> None:
        for i in range(start, start + 50):
            prompt = f"{i:05d} " + "".join("abcdefgh"[(i * 7 + k) % 8] for k in range(40))
            engine.add_request(GenerateRequest(f"q{i}/a", params, prompt=prompt, n=2))
        run_all(engine)

    tracemalloc.start()  # from the start: frees of untraced blocks would not count
    try:
        for start in range(0, 400, 50):
            wave(start)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for start in range(400, 800, 50):
            wave(start)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1_000_000, f"{grown} bytes more after 400 more requests"


def test_an_idle_core_wakes_for_the_trim_still_due() -> None:
    calls: list[int] = []
    clock = _Clock()
    heap = HeapTrimmer(idle_gap_s=1.0, clock=clock, trim=calls.append)
    assert heap.due_in() is None  # nothing ran: wait as long as it takes
    heap.worked()
    assert heap.maybe_trim(idle=True)
    heap.worked()  # a last bit of work right after: too soon to trim again
    clock.now = 0.25
    assert not heap.maybe_trim(idle=True) and heap.due_in() == 0.75
    clock.now = 1.0
    assert heap.maybe_trim(idle=True) and heap.due_in() is None and len(calls) == 2
