"""The dispatcher's gates (``ClientRules``): every launch decision of a ToT query or a
LangGraph run is one of these, and each does what the client's rules say."""

from __future__ import annotations

import pytest
from test_dispatcher import Launcher

from spec_tot.executor import ClientRules, Dispatcher, Offer
from spec_tot.executor.step_curve import StepCurve


def _flat(capacity: int = 8) -> Dispatcher:
    return Dispatcher(capacity=capacity)


def test_unpriced_clients_launch_every_offer_at_once_up_to_their_cap() -> None:
    d = _flat(capacity=2)
    d.join("q", ClientRules(priced=False, max_sequences=3))
    for _ in range(2):
        d.committed_started()  # no room at all: an unpriced client ignores it
    run = Launcher(d)
    d.offer("q", [run.offer("q", f"n{i}") for i in range(5)])
    assert len(run.launched) == 3 and d.queued() == 0
    assert d.asks("q", "k", 10.0) == 0  # its cap is reached: no prediction either


def test_a_priced_clients_queue_never_passes_its_cap() -> None:
    d = _flat(capacity=8)
    d.join("q", ClientRules(max_sequences=2))
    run = Launcher(d)
    d.offer("q", [run.offer("q", f"n{i}") for i in range(5)])
    assert len(run.launched) == 2
    d.finished("q")
    d.offer("q", [run.offer("q", "late")])
    assert len(run.launched) == 3 and not d.steers("q")


def test_asks_is_the_room_its_cap_and_max_ask_allow() -> None:
    d = _flat(capacity=8)
    d.join("q", ClientRules(max_sequences=6, max_ask=4))
    assert d.asks("q", "k", 10.0) == 4
    for _ in range(6):
        d.committed_started()
    assert d.asks("q", "k", 10.0) == 2  # the backend's room now
    d.join("off", ClientRules(max_sequences=0))
    assert d.asks("off", "k", 10.0) == 0 and not d.steers("off")


def test_reaches_and_worth() -> None:
    d = _flat()
    d.join("q", ClientRules(max_level=2))
    d.join("u", ClientRules(priced=False))
    assert d.reaches("q", 2) and not d.reaches("q", 3) and d.reaches("other", 99)
    worthless = Offer("k", 1, 10.0, lambda _o: True, reward_s=1e9)
    assert not d.worth("q", worthless) and d.worth("u", worthless)


def test_try_start_holds_back_a_busy_process_and_full_caps() -> None:
    d = _flat()
    d.join("run", ClientRules(max_lag_s=0.005, max_cpu_share=float("inf")))
    offer = Offer("k", 1, 10.0, lambda _o: True)
    assert not d.try_start("run", offer, lag_s=0.01)  # its loop lags: no idle time
    assert not d.try_start("run", offer, caps=[(3, 3)])  # e.g. max_concurrency reached
    assert d.try_start("run", offer, lag_s=0.001, caps=[(2, 3), (0, None)])
    d.join("cpu", ClientRules(max_cpu_share=-1.0))  # any CPU use is too much
    assert not d.quiet("cpu") and not d.try_start("cpu", offer)


def test_grant_starts_what_the_room_allows() -> None:
    d = _flat(capacity=4)
    d.committed_started()
    assert d.grant("run", 5) == 3 and d.room() == 0 and d.speculative["run"] == 3
    assert d.grant("run", 1) == 0
    d.finished("run", 3)
    assert d.room() == 3


def test_slack_is_the_unused_share_of_the_engines_throughput() -> None:
    flat = StepCurve(8)  # the roofline: flat below saturation
    assert flat.slack(2, 8) == pytest.approx(0.75) and flat.slack(8, 8) == 0.0
    linear = StepCurve(8, prior={1: 1.0, 8: 8.0})  # every row costs: no throughput to gain
    assert linear.slack(2, 8) == pytest.approx(0.0, abs=1e-9)


def test_a_saving_counts_less_where_other_clients_fill_the_engine() -> None:
    d = Dispatcher(capacity=8, step_curve={1: 1.0, 8: 8.0})  # a saturated CPU engine
    d.join("a", ClientRules())
    offer = Offer("k", 1, 10.0, lambda _o: True)
    alone = d.value(offer, p=0.7)
    assert d.gain_share(0.0) == 1.0
    for client in "bcd":
        d.join(client, ClientRules())
    assert d.gain_share(0.0) == pytest.approx(0.25) and d.gain_share(1.0) == 1.0
    assert d.value(offer, p=0.7) < alone
    assert d.value(offer, p=1.0) > 0  # a sure hit still launches


def test_a_miss_is_charged_the_executors_cpu_per_request_run() -> None:
    from spec_tot.executor.cpu_meter import RunCpu

    now = [0.0]
    meter = RunCpu(clock=lambda: now[0])
    meter.ended()  # the first sample only marks the clock
    now[0] = 0.03
    meter.ended(3)  # 30 ms of CPU for three requests
    assert meter.per_run_s == pytest.approx(0.01)
    d = _flat()
    offer = Offer("k", 1, 10.0, lambda _o: True)
    before = d.value(offer, p=0.5)
    d.run_cpu.per_run_s = 0.004
    assert d.value(offer, p=0.5) == pytest.approx(before - 0.5 * 0.004)


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_sequences", -1), ("max_level", 1.5), ("max_ask", True), ("max_lag_s", "soon")],
)
def test_client_rules_name_the_field_they_refuse(field: str, value: object) -> None:
    from spec_tot.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        ClientRules(**{field: value})  # type: ignore[arg-type]
