"""The pieces of token speculation on their own: prompt lookup over a tree, the acceptance
estimates, the step-cost fit, KV reservation and rollback, the Game-of-24 drafter, the
engine options, and the figures in stats, run metrics and the run table."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_fixtures import make_engine, run_all, tiny_llama

from spec_tot.adapters.local.config import EngineConfig
from spec_tot.adapters.local.engine.block_manager import BlockManager
from spec_tot.adapters.local.engine.drafter import (
    DraftContext,
    HFDraftModel,
    NgramDrafter,
    load_drafter,
    tree_of,
)
from spec_tot.adapters.local.engine.sequence import Member, RequestState, Sequence
from spec_tot.adapters.local.engine.tokenspec import AcceptanceStats, StepCost
from spec_tot.errors import ConfigError
from spec_tot.graphs import game24_task as task
from spec_tot.graphs.game24 import PROGRAM, Game24Drafter
from spec_tot.metrics import MetricsRecorder
from spec_tot.requests import GenerateRequest, Priority, SamplingParams

__all__ = ["make_engine", "tiny_llama"]

torch.set_num_threads(1)


def _ctx(rid: str, tokens: list[int], prompt: int, limit: int = 8) -> DraftContext:
    return DraftContext(rid, tokens, prompt, limit)


def test_ngram_finds_own_prompt_and_sibling() -> None:
    drafter = NgramDrafter(max_n=3, min_n=2)
    own = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    assert list(drafter.propose(_ctx("q1/a", own, 5))) == [4, 5, 9, 9, 2, 3][:8]
    sibling = [1, 2, 7, 8, 6, 6, 7, 8]  # same tree (q1): its "7 8" is followed by "6 6"
    drafter.propose(_ctx("q1/b", sibling, 2))
    asker = [0, 0, 7, 8]
    assert list(drafter.propose(_ctx("q1/c", asker, 2, limit=3))) == [6, 6, 7]
    assert list(drafter.propose(_ctx("q2/c", [0, 0, 7, 8], 2))) == []  # another tree
    assert tree_of("q1/c/d") == "q1"
    drafter.forget()  # the engine's prefix-cache flush: nothing learnt survives it
    assert list(drafter.propose(_ctx("q1/c", asker, 2, limit=3))) == []


def test_ngram_never_proposes_its_own_open_suffix() -> None:
    drafter = NgramDrafter(max_n=2, min_n=2)
    tokens = [4, 5]
    assert list(drafter.propose(_ctx("t", tokens, 2))) == []
    tokens += [4, 5]  # now "4 5" occurred before, followed by "4"
    assert list(drafter.propose(_ctx("t", tokens, 2, limit=2))) == [4, 5]


def test_ngram_rejects_bad_sizes() -> None:
    with pytest.raises(ConfigError, match="ngram"):
        NgramDrafter(max_n=1, min_n=2)


def test_acceptance_learns_per_position_with_the_previous_as_prior() -> None:
    stats = AcceptanceStats(8)
    for _ in range(50):
        stats.record("good", drafted=8, accepted=8)
        stats.record("bad", drafted=4, accepted=0)
    good, bad = stats.q("good"), stats.q("bad")
    assert good[0] > 0.9 and good[7] > 0.6
    assert bad[0] < 0.1 and all(b <= a for a, b in itertools.pairwise(bad))
    fresh = AcceptanceStats(4)
    fresh.record("short", drafted=1, accepted=1)  # only position 0 seen: the rest follow it
    q = fresh.q("short")
    assert q[1] > 0.6 * q[0]


def test_step_cost_fits_measured_steps() -> None:
    cost = StepCost({1: 0.002, 8: 0.003, 32: 0.007})
    for i in range(400):
        rows, drafted, prompt = 1 + i % 32, (i * 7) % 50, (i * 13) % 40
        cost.observe(rows, drafted, prompt, 0.001 + 0.0001 * rows + 0.00003 * drafted)
    assert cost.per_token == pytest.approx(0.00003, rel=0.3)
    assert cost.predict(16, 0, 0) == pytest.approx(0.001 + 0.0016, rel=0.2)


def test_step_cost_prior_from_curve_alone() -> None:
    cost = StepCost({1: 0.002, 8: 0.004, 32: 0.010})
    assert cost.predict(8, 0, 0) == pytest.approx(0.004, rel=0.15)
    assert cost.per_token > 0


def _seq(tokens: list[int]) -> Sequence:
    params = SamplingParams()
    state = RequestState("r", params, tuple(tokens), Priority.COMMITTED, [None])
    return Sequence(
        1, list(tokens), len(tokens), params, Priority.COMMITTED, 1, [Member(state, 0, None)]
    )


def test_reserve_range_and_trim() -> None:
    bm = BlockManager(6, 4, True)
    seq = _seq(list(range(6)))
    bm.allocate(seq, 100)
    assert len(seq.block_table) == 2
    assert bm.reserve_range(seq, 6, 15) == 15  # positions 6..14: two more blocks
    assert len(seq.block_table) == 4
    assert bm.reserve_range(seq, 15, 40) == 24  # the pool runs dry: as far as it goes
    bm.trim(seq, 7)  # keep positions 0..6
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 4
    bm.deallocate(seq)
    assert bm.num_free_blocks == 6


def test_reserve_range_copies_shared_blocks() -> None:
    bm = BlockManager(8, 4, True)
    parent = _seq(list(range(6)))
    bm.allocate(parent, 100)
    child = _seq(list(range(6)))
    bm.fork(parent, child)
    assert bm.reserve_range(child, 6, 9) == 9
    assert child.block_table[1] != parent.block_table[1]  # the shared partial block copied
    assert bm.take_cow_pairs() == [(parent.block_table[1], child.block_table[1])]
    for s in (parent, child):
        bm.deallocate(s)
    assert bm.num_free_blocks == 8


def test_game24_forced_suffix() -> None:
    assert task.forced_suffix("4 4 6 8", "8/4=") == "2 (left: 2 4 6)"
    assert task.forced_suffix("4 4 6 8", "8/4=2 (le") == "ft: 2 4 6)"
    assert task.forced_suffix("2 8 -2", "8*(-2)=") == "-16 (left: -16 2)"
    assert task.forced_suffix("4 4 6 8", "8/4=3") is None  # departed from the forced text
    assert task.forced_suffix("4 4 6 8", "8/5=") is None  # 5 is not there
    assert task.forced_suffix("4 4 6 8", "8/4") is None  # no "=" yet
    for numbers in ("4 4 6 8", "1 3 5 13"):
        for step in task.legal_steps(numbers):  # every canonical step is its own forced form
            head, _, tail = step.partition("=")
            assert task.forced_suffix(numbers, head + "=") == tail


def test_game24_drafter_on_the_shipped_tokenizer() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(task.asset_dir("policy")))
    drafter = Game24Drafter(tok)
    prompt = tok.encode(task.prompt("4 4 6 8", ["8/4=2 (left: 2 4 6)"]))
    ids = prompt + tok.encode("6*4=", add_special_tokens=False)
    draft = drafter.propose(DraftContext("q/1", ids, len(prompt), 40))
    assert tok.decode(list(draft)) == "24 (left: 2 24)\n"
    assert len(drafter.propose(DraftContext("q/1", ids, len(prompt), 3))) == 3
    early = prompt + tok.encode("6*", add_special_tokens=False)
    assert list(drafter.propose(DraftContext("q/1", early, len(prompt), 40))) == []
    assert PROGRAM.backend_options("local")["drafter"] == "spec_tot.graphs.game24:game24_drafter"
    assert isinstance(load_drafter(PROGRAM.backend_options("local")["drafter"], tok), Game24Drafter)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"token_speculation": "yes"}, "token_speculation"),
        ({"max_draft_tokens": 0}, "max_draft_tokens"),
        ({"ngram_max": -1}, "ngram_max"),
        ({"ngram_min": 5, "ngram_max": 3}, "ngram_min"),
        ({"drafter": "no_colon"}, "drafter"),
        ({"draft_model": ""}, "draft_model"),
    ],
)
def test_config_errors_name_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig(model_config={}, **options)
    assert err.value.field == field


def test_the_cli_switch_reaches_the_engine_option() -> None:
    """``spec-tot run --backend-opt token_speculation=false`` is the CLI's off switch."""
    from spec_tot.cli._checks import parse_backend_options

    assert parse_backend_options(["token_speculation=false"], "local") == {
        "token_speculation": False
    }
    with pytest.raises(ConfigError, match="token_speculation"):
        parse_backend_options(["token_speculation=maybe"], "local")


def test_program_drafter_loads_by_name(make_engine: Any) -> None:
    engine = make_engine(drafter="spec_drafters:wrong_drafter")
    assert [d.name for d in engine.speculator.drafters] == ["wrong"]  # prompt lookup opt-in
    engine = make_engine(drafter="spec_drafters:wrong_drafter", ngram_max=4)
    assert [d.name for d in engine.speculator.drafters] == ["wrong", "ngram"]
    with pytest.raises(ConfigError, match="drafter"):
        make_engine(drafter="spec_drafters:no_such_factory")
    with pytest.raises(ConfigError, match="not a factory"):
        make_engine(drafter="spec_drafters:FreeCost")
    with pytest.raises(ConfigError, match="not a Drafter"):
        make_engine(drafter="builtins:str")


def test_prefix_cache_flush_forgets_the_drafters_history(make_engine: Any) -> None:
    engine = make_engine(ngram_max=4)  # prompt lookup is opt-in
    (ngram,) = [d for d in engine.speculator.drafters if isinstance(d, NgramDrafter)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request(GenerateRequest("q/a", params, prompt="a tree's first node"))
    run_all(engine)
    assert ngram._trees  # it learnt the tree's text
    assert engine.reset_prefix_cache()
    assert not ngram._trees and engine.block_manager.num_used_blocks == 0


def test_draft_model_seam(make_engine: Any, tiny_llama: Path) -> None:
    """A draft model identical to the target proposes what greedy decoding writes: every
    drafted token is accepted, and the output is plain decoding's."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    req = GenerateRequest("d", params, prompt="draft model seam")
    plain = make_engine(token_speculation=False)
    plain.add_request(req)
    want = run_all(plain)["d"].completions[0].token_ids
    spec = make_engine(draft_model=str(tiny_llama), ngram_max=0, max_draft_tokens=4)
    assert isinstance(spec.speculator.drafters[0], HFDraftModel)
    spec.add_request(req)
    assert run_all(spec)["d"].completions[0].token_ids == want
    st = spec.stats()
    assert st["num_draft_tokens_model"] > 0
    assert st["num_accepted_tokens_model"] == st["num_draft_tokens_model"]


def test_stats_are_plain_numbers(make_engine: Any) -> None:
    engine = make_engine()
    engine.add_request(
        GenerateRequest("s", SamplingParams(max_tokens=8, seed=1), prompt="abab abab")
    )
    run_all(engine)
    st = engine.stats()
    for key in ("num_draft_tokens", "num_accepted_tokens", "num_verify_rows", "num_decode_rows"):
        assert type(st[key]) is float
    engine.reset_counters()
    assert engine.stats()["num_decode_rows"] == 0


def test_run_metrics_and_table_carry_the_figures() -> None:
    from rich.console import Console

    from spec_tot.cli._report import RunOutcome, report

    metrics = MetricsRecorder().summary(wall_s=1.0)
    stats = {
        "num_draft_tokens": 40.0,
        "num_accepted_tokens": 30.0,
        "num_decode_rows": 20.0,
        "num_decode_tokens": 50.0,
    }
    m = metrics.with_backend_stats(stats)
    assert (m.draft_tokens, m.accepted_tokens) == (40, 30)
    assert m.acceptance_rate == 0.75 and m.tokens_per_step == 2.5
    assert metrics.with_backend_stats({}).acceptance_rate == 0.0
    row = {"mode": "full", "search": "rebase", "backend": "local", "concurrency": 1, "seed": 0}
    out = Console(width=250, record=True)
    report(
        [RunOutcome({**row, "metrics": {**m.to_dict(), "queries": 1}}, None)],
        None,
        out=out,
        err=Console(stderr=True),
        options_text="",
    )
    text = out.export_text()
    assert "tok/step" in text and "2.50" in text and "0.75" in text
