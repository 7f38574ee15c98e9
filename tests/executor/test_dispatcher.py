"""SPEX T2's one rule (``spec_tot.executor.dispatcher``): room never overbooked, candidates
of every client in one queue by expected value, freed room wakes it, hit rates learnt per
(kind, level), the step-cost curve learnt from traffic turning low-odds speculation off."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_tot.executor import Dispatcher, Offer
from spec_tot.executor.dispatcher import HitRates, StepCurve


class Launcher:
    """Launch callbacks that start one sequence of ``client`` on ``dispatcher``."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.launched: list[tuple[str, str]] = []

    def offer(self, client: str, name: str, kind: str = "k", level: int = 1) -> Offer:
        def launch(_offer: Offer) -> bool:
            self.dispatcher.started(client)
            self.launched.append((client, name))
            return True

        return Offer(kind, level, 10.0, launch)


def test_offers_launch_up_to_the_room_and_wait_for_freed_room() -> None:
    d = Dispatcher(capacity=4)
    for _ in range(2):
        d.committed_started()
    run = Launcher(d)
    d.offer("a", [run.offer("a", f"a{i}") for i in range(5)])
    assert len(run.launched) == 2 and d.room() == 0
    assert d.queued() == 3
    d.finished("a")  # freed room wakes the queue: no polling
    assert len(run.launched) == 3 and d.room() == 0
    d.committed_finished()
    assert len(run.launched) == 4
    for _ in range(6):  # committed past saturation: nothing launches, room never negative
        d.committed_started()
    d.finished("a")
    assert len(run.launched) == 4


def test_a_new_offer_supersedes_the_clients_queued_ones() -> None:
    d = Dispatcher(capacity=1)
    d.committed_started()
    run = Launcher(d)
    d.offer("a", [run.offer("a", "old")])
    d.offer("a", [run.offer("a", "new")])
    d.committed_finished()
    assert run.launched == [("a", "new")]
    d.offer("a", [])  # an empty offer withdraws the client's queued ones
    d.offer("b", [])
    assert d.queued() == 0


def test_the_most_valuable_candidate_of_any_client_goes_first() -> None:
    d = Dispatcher(capacity=1)
    for _ in range(6):  # the "good" kind's guesses are adopted, the "bad" kind's not
        d.rates.launched(("good", 1, 3))
        d.rates.hit(("good", 1, 3))
        d.rates.launched(("bad", 1, 3))
    d.committed_started()
    run = Launcher(d)
    d.offer("q1", [run.offer("q1", "bad", kind="bad")])
    d.offer("q2", [run.offer("q2", "good", kind="good")])
    d.committed_finished()
    assert run.launched == [("q2", "good")]
    assert not d.try_start("q3", run.offer("q3", "x", kind="bad"))  # no room left


def test_try_start_yields_to_queued_candidates_worth_more() -> None:
    d = Dispatcher(capacity=2)
    for _ in range(6):
        d.rates.launched(("good", 1, 3))
        d.rates.hit(("good", 1, 3))
    run = Launcher(d)
    d.committed_started()
    d.committed_started()
    d.offer("tree", [run.offer("tree", "good", kind="good")])  # queued: no room
    d.committed_finished()  # room for one: the queued, better candidate takes it
    assert run.launched == [("tree", "good")]
    assert not d.try_start("graph", run.offer("graph", "x", kind="new"))
    d.committed_finished()
    assert d.try_start("graph", run.offer("graph", "x", kind="new"))


def test_a_launch_that_is_no_longer_wanted_takes_no_room() -> None:
    d = Dispatcher(capacity=2)
    d.offer("a", [Offer("k", 1, 5.0, lambda o: False), Offer("k", 1, 5.0, lambda o: False)])
    assert d.room() == 2 and d.launches == 0 and d.queued() == 0


def test_an_offer_learns_in_its_kind_level_and_confidence_band() -> None:
    low = Offer("beam", 2, 1.0, lambda o: True, confidence=0.1)
    assert low.slot == ("beam", 2, 0)
    assert Offer("beam", 20, 1.0, lambda o: True, confidence=7.0).slot == ("beam", 8, 3)
    d = Dispatcher(capacity=4)
    for _ in range(5):
        d.offer("q", [low])
        d.hit(low)
        d.finished("q") if d.speculative.get("q") else None
    assert d.rates.rate(low.slot) > 0.8 and d.rates.rate(("beam", 2, 3)) == 0.5


def test_hit_rates_per_kind_and_level_with_a_window() -> None:
    rates = HitRates()
    assert rates.rate(("beam", 1, 3)) == 0.5  # Beta(1, 1) prior
    for _ in range(4):
        rates.launched(("beam", 1, 3))
        rates.hit(("beam", 1, 3))
        rates.launched(("beam", 2, 3))
    assert rates.rate(("beam", 1, 3)) == pytest.approx(5 / 6)
    assert rates.rate(("beam", 2, 3)) == pytest.approx(1 / 6)
    assert rates.rate(("rebase", 1, 3)) == 0.5
    for _ in range(2000):  # counts halve: the rate follows what happens now
        rates.launched(("beam", 1, 3))
    assert rates.rate(("beam", 1, 3)) < 0.05
    assert max(c[0] for c in rates.counts.values()) <= 512


def test_a_steep_measured_curve_stops_low_odds_speculation() -> None:
    """On an engine whose step time grows with every row (compute-bound, as the CPU engine
    is), a kind that misses costs more than it saves: the dispatcher launches none of it,
    and still launches a kind that hits."""
    d = Dispatcher(capacity=64)
    for rows in (1, 2, 4, 8, 16, 32):
        for _ in range(3):
            d.curve.observe(rows, seconds=0.01 * rows, tokens=1)  # linear in rows
    for _ in range(40):
        d.rates.launched(("miss", 1, 3))
        d.rates.launched(("hit", 1, 3))
        d.rates.hit(("hit", 1, 3))
    for _ in range(8):
        d.committed_started()
    run = Launcher(d)
    d.offer("a", [run.offer("a", "m", kind="miss"), run.offer("a", "h", kind="hit")])
    assert run.launched == [("a", "h")]
    assert d.queued() == 1  # kept: the load may change
    flat = Dispatcher(capacity=64)  # a flat curve (memory-bound GPU): misses cost ~nothing
    for rows in (1, 2, 4, 8, 16, 32):
        flat.curve.observe(rows, seconds=0.01, tokens=1)
    flat.rates.counts.update(d.rates.counts)
    for _ in range(8):
        flat.committed_started()
    run = Launcher(flat)
    flat.offer("a", [run.offer("a", "m", kind="miss")])
    assert run.launched == [("a", "m")]


def test_step_curve_shape_before_and_after_samples() -> None:
    curve = StepCurve(saturation=8)
    assert curve.step_s(4) == 1.0 and curve.step_s(16) == 2.0  # the roofline's shape
    assert curve.marginal_s(4) == 0.0 and curve.marginal_s(16) > 0.0
    curve.observe(1, seconds=0.02, tokens=2)
    curve.observe(16, seconds=0.8, tokens=20)
    assert curve.step_s(1) == pytest.approx(0.01)
    assert curve.marginal_s(4) > 0.0  # measured between buckets 1 and 16
    curve.observe(4, seconds=float("nan"), tokens=3)  # no sample from nonsense
    curve.observe(4, seconds=1.0, tokens=0)
    assert set(curve.scale) == {0, 4}


def test_a_calibrated_step_curve_prices_rows_below_saturation() -> None:
    """On a compute-bound engine (a CPU) every row costs: the calibrated curve, not the
    roofline's flat shape, is the prior, and a miss below saturation is not free."""
    calibrated = {1: 0.002, 16: 0.005, 32: 0.0065}
    curve = StepCurve(saturation=47, prior=calibrated)
    assert curve.measured  # seconds from the start
    assert curve.step_s(1) == pytest.approx(0.002) and curve.step_s(16) == pytest.approx(0.005)
    assert curve.step_s(24) == pytest.approx(0.00575)  # between points
    assert curve.step_s(64) == pytest.approx(0.0095)  # the last slope, extended
    assert curve.marginal_s(20) == pytest.approx(0.0015 / 16)
    assert StepCurve(saturation=47).marginal_s(20) == 0.0  # the roofline calls it free
    curve.observe(16, seconds=0.1, tokens=10)  # a sample rescales the curve near it
    assert curve.step_s(16) == pytest.approx(0.01)
    loaded = Dispatcher(capacity=47, step_curve=calibrated)
    for _ in range(16):
        loaded.committed_started()
    offer = Offer("k", 1, 10.0, lambda _: True)
    hit_share = loaded.rates.rate(offer.slot) * 10.0 * loaded.curve.step_s(17)
    assert 0.0 < loaded.value(offer) < hit_share  # the miss's rows are priced


def test_step_curve_of_reads_the_reported_calibration() -> None:
    from spec_tot.executor.hub import step_curve_of

    extra = {"step_s_b1": 0.002, "step_s_b16": 0.005, "num_kv_blocks": 64.0, "step_s_bx": 1.0}
    assert step_curve_of(extra) == {1: 0.002, 16: 0.005}


def test_reported_load_counts_other_clients() -> None:
    d = Dispatcher(capacity=8, load=lambda: 5.0)
    d.started("a", 2)  # this process's speculation is part of the reported load
    assert d.committed == 3 and d.room() == 3
    full = Dispatcher(capacity=4, load=lambda: 4.0)
    run = Launcher(full)
    full.offer("a", [run.offer("a", "x")])
    assert run.launched == []


async def test_wait_room_wakes_when_room_frees() -> None:
    d = Dispatcher(capacity=1)
    d.started("a")
    waiter = asyncio.ensure_future(d.wait_room())
    await asyncio.sleep(0)
    assert not waiter.done()
    d.finished("a")
    await asyncio.wait_for(waiter, 1.0)
    await d.wait_room()  # room now: returns at once


def test_superseded_entries_do_not_pile_up() -> None:
    """Each event re-offers; the heap stays within a constant of the live offers."""
    d = Dispatcher(capacity=1)
    d.committed_started()
    run = Launcher(d)
    for round_ in range(500):
        for q in range(8):
            d.offer(f"q{q}", [run.offer(f"q{q}", f"{round_}") for _ in range(3)])
    assert d.queued() == 24
    assert len(d._queue._heap) <= 64 + 4 * 24 + 3


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 16),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["offer", "try", "finish", "commit", "uncommit", "hit", "forget"]),
            st.sampled_from(["a", "b", "c"]),
            st.integers(0, 6),
        ),
        max_size=40,
    ),
)
def test_speculation_never_overbooks_under_any_sequence(
    capacity: int, ops: list[tuple[str, str, int]]
) -> None:
    d = Dispatcher(capacity=capacity)
    run = Launcher(d)
    for op, q, n in ops:
        if op == "offer":
            d.offer(q, [run.offer(q, str(i)) for i in range(n)])
        elif op == "try" and d.try_start(q, run.offer(q, "t")):
            d.started(q)
        elif op == "finish" and d.speculative.get(q, 0):
            d.finished(q)
        elif op == "commit":
            d.committed_started()
        elif op == "uncommit" and d.local_committed:
            d.committed_finished()
        elif op == "hit":
            d.hit(run.offer(q, "h"))
        elif op == "forget":
            d.forget(q)
        assert 0.0 < d.rates.rate(("k", 1, 3)) < 1.0
        # each launch needs room below the saturation batch: speculation never overbooks
        assert sum(d.speculative.values()) <= capacity
        assert d.speculating == sum(d.speculative.values())  # the kept total stays exact


def test_could_pay_values_a_kind_at_its_best_odds() -> None:
    """Before predicting, a client asks whether any offer of its kind could pay now: at the
    kind's best slot (even odds for a kind not tried). Where a step grows in proportion to
    the rows, a miss costs about a hit's saving: even odds with a reward cost cannot pay,
    sure hits still do; on a flat curve even odds pay (with no reward cost)."""
    linear = Dispatcher(capacity=64, step_curve={1: 0.001, 8: 0.008, 64: 0.064})
    flat = Dispatcher(capacity=64, step_curve={1: 0.001, 64: 0.0012})
    for d in (linear, flat):
        for _ in range(16):
            d.committed_started()
    assert not linear.could_pay("new", 10.0, reward_s=0.05)
    assert flat.could_pay("new", 10.0)
    sure = Offer("sure", 1, 10.0, lambda _: True)
    for _ in range(60):
        linear.rates.launched(sure.slot)
        linear.rates.hit(sure.slot)
    assert linear.could_pay("sure", 10.0, reward_s=0.05)


def test_falling_samples_do_not_make_rows_free() -> None:
    """Samples are keyed by the rows at a request's start and the load moves during its
    life: per-token seconds can come out falling with rows. The calibrated shape still
    prices one more row."""
    curve = StepCurve(saturation=64, prior={1: 0.001, 64: 0.005})
    curve.observe(8, seconds=0.05, tokens=10)  # 5 ms a token at 8 rows
    curve.observe(32, seconds=0.03, tokens=10)  # 3 ms at 32
    assert curve.step_s(32) < curve.step_s(8)
    assert curve.marginal_s(16) > 0.0


def test_a_miss_is_priced_at_the_load_it_lives_through() -> None:
    """A launch in a trough between rounds runs on into the next round's peak: its miss is
    priced at the rows committed requests usually start at, when that is more than now."""
    calibrated = {1: 0.001, 8: 0.0013, 32: 0.003}
    steady, peaky = (Dispatcher(capacity=32, step_curve=calibrated) for _ in range(2))
    for _ in range(24):  # peaky's rounds start 24 requests at once, then drain
        peaky.committed_started()
    for _ in range(22):
        peaky.committed_finished()
    steady.committed_started()
    steady.committed_started()
    assert steady.rows() == peaky.rows() == 2 and peaky.rows_seen > 10
    offer = Offer("k", 1, 20.0, lambda _: True)
    assert peaky.value(offer, 0.5) < steady.value(offer, 0.5)
    assert peaky.value(offer, 1.0) == pytest.approx(steady.value(offer, 1.0))  # hits: as now


def test_a_hit_is_valued_at_the_share_of_its_saving_hits_realise() -> None:
    """A hit adopted soon after it started saved only its head start: the slot learns the
    share hits realise, and its offers are valued at it (misses are priced as before)."""
    d = Dispatcher(capacity=32, step_curve={1: 0.001, 32: 0.003})
    offer = Offer("k", 1, 20.0, lambda _: True)
    whole = d.value(offer, 1.0)
    assert d.saving_s(offer) == pytest.approx(whole)  # one client: every saved second counts
    for _ in range(30):
        d.rates.launched(offer.slot)
        d.hit(offer, 0.25)
    assert d.rates.realised(offer.slot) == pytest.approx((7.5 + 1) / 31)
    assert d.value(offer, 1.0) == pytest.approx(whole * (7.5 + 1) / 31)
    d.hit(offer, 7.0)  # a share above one (the load rose) counts as one whole saving
    assert d.rates.realised(offer.slot) == pytest.approx((8.5 + 1) / 32)
    other = Offer("k", 2, 20.0, lambda _: True)
    d.hit(other)  # unmeasured (a LangGraph task): the share keeps its prior
    assert d.rates.realised(other.slot) == 1.0
