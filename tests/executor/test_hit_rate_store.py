"""Speculation hit rates kept between runs (``ExecutorConfig.hit_rates``): a run starts with
what earlier runs learnt, writes back what it learnt, and never reads or overwrites a file
that is not a hit-rate file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spec_helpers import LatencyBackend, inputs, make_app

from spec_tot import cli
from spec_tot.cli._checks import hit_rate_file
from spec_tot.config import ExecutorConfig
from spec_tot.errors import ConfigError
from spec_tot.executor import hub_for
from spec_tot.executor.hit_rate_store import load_hit_rates, save_hit_rates
from spec_tot.executor.offers import HitRates


def test_counts_round_trip_and_a_missing_file_is_an_empty_start(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "rates.json"
    assert load_hit_rates(path) == {}
    counts = {("rebase", 1, 0): (16.0, 12.0, 10.0, 2.5), ("beam", 3, 2): (2.0, 0.0, 0.0, 0.0)}
    save_hit_rates(path, counts)
    assert load_hit_rates(path) == counts
    assert [p.name for p in path.parent.iterdir()] == ["rates.json"]  # no temp file left


@pytest.mark.parametrize(
    "text",
    ["id,question\n1,2 3 4 5\n", '{"format": "other"}', '{"format": "spec-tot hit rates", '
     '"version": 1, "slots": [{"kind": "k", "level": 1, "band": 0, "launched": 1, "hits": 5, '
     '"measured": 0, "realised": 0}]}'],
)  # fmt: skip
def test_a_file_that_is_not_a_hit_rate_file_is_refused_and_kept(tmp_path: Path, text: str) -> None:
    path = tmp_path / "data.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"data\.csv is not a spec-tot hit-rate file") as caught:
        load_hit_rates(path)
    assert caught.value.field == "hit_rates"
    assert path.read_text() == text


def test_an_unwritable_file_warns_and_the_run_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="hit rates not kept in"):
        save_hit_rates(blocker / "rates.json", {("k", 1, 0): (1.0, 1.0, 0.0, 0.0)})


def test_merged_counts_add_and_halve_past_the_window() -> None:
    rates = HitRates()
    rates.merge({("k", 1, 0): (3.0, 2.0, 2.0, 0.5)})
    assert rates.rate(("k", 1, 0)) == pytest.approx(3 / 5)
    assert rates.realised(("k", 1, 0)) == pytest.approx(1.5 / 3)
    rates.merge({("k", 1, 0): (1000.0, 1000.0, 1000.0, 100.0)})
    launched, hits, measured, realised = rates.snapshot()[("k", 1, 0)]
    assert launched <= 512 and hits <= launched and realised <= measured
    assert rates.rate(("k", 1, 0)) > 0.99
    assert rates.realised(("k", 1, 0)) == pytest.approx(0.1, abs=0.01)


def test_the_config_names_a_bad_hit_rate_path() -> None:
    assert ExecutorConfig(hit_rates=Path("x.json")).hit_rates == "x.json"
    for bad in (3, ""):
        with pytest.raises(ConfigError) as caught:
            ExecutorConfig(hit_rates=bad)  # type: ignore[arg-type]
        assert caught.value.field == "hit_rates"


async def test_a_run_starts_with_what_the_last_one_learnt(tmp_path: Path) -> None:
    path = tmp_path / "rates.json"
    first = LatencyBackend(gen_latency=lambda _rid: 0.002, reward_latency=lambda _rid: 0.004)
    await make_app(first, "rebase", "full", hit_rates=str(path)).abatch(inputs("a", "b"))
    learnt = load_hit_rates(path)
    assert learnt and sum(c[0] for c in learnt.values()) > 0
    assert sum(c[2] for c in learnt.values()) > 0  # head starts measured
    second = LatencyBackend(gen_latency=lambda _rid: 0.002, reward_latency=lambda _rid: 0.004)
    app = make_app(second, "rebase", "full", hit_rates=str(path))
    hub_for(second).recall_hit_rates(str(path))  # what the batch does first
    assert hub_for(second).dispatcher.rates.snapshot() == learnt
    await app.abatch(inputs("c"))
    after = load_hit_rates(path)
    assert sum(c[0] for c in after.values()) >= sum(c[0] for c in learnt.values())


async def test_without_a_file_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    backend = LatencyBackend(gen_latency=lambda _rid: 0.002)
    await make_app(backend, "rebase", "full").abatch(inputs("a"))
    assert list(tmp_path.iterdir()) == []


def test_the_cli_keeps_one_file_per_program_search_and_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPEC_TOT_CACHE_DIR", str(tmp_path))
    a = hit_rate_file("auto", "game24", "rebase", "local", {}, {"width": 4})
    b = hit_rate_file("auto", "game24", "rebase", "local", {}, {"width": 8})
    assert a != b and Path(a or "").parent == tmp_path / "hit_rates"
    assert hit_rate_file("off", "game24", "rebase", "local") is None
    assert hit_rate_file("mine.json", "game24", "rebase", "local") == "mine.json"


def test_the_cli_refuses_a_foreign_file_before_a_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "24.csv"
    data.write_text("id,puzzle\n")
    code = cli.run_cli(["run", "--queries", "1", "--hit-rates", str(data)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --hit-rates: /") and "24.csv" in err
    assert data.read_text() == "id,puzzle\n"


def test_the_cli_writes_the_file_it_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rates.json"
    argv = ["run", "--backend", "scripted", "--queries", "2", "--mode", "full"]
    assert cli.run_cli([*argv, "--hit-rates", str(path)]) == 0
    assert json.loads(path.read_text())["format"] == "spec-tot hit rates"
    capsys.readouterr()
