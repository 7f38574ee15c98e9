"""Frozen executor configuration, validated at construction.

A mode is a named set of technique switches; every switch can also be set on its own, so
each ablation is one flag: ``ExecutorConfig(mode="full", speculation_overrides={"ep": False})``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from spec_tot.errors import ConfigError, UnknownNameError

__all__ = ["MODES", "ExecutorConfig", "LazyVerification", "Speculation"]

Speculate = Literal["off", "all", "ranked"]


def _integer(name: str, value: Any, minimum: int) -> None:
    # bool is an int subclass: ``max_nodes=True`` must not mean 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")


def _number(name: str, value: Any, *, low: float | None = None, strict: bool = False) -> None:
    """A finite real number, ``> low`` (``strict``) or ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(name, f"must be finite, got {value!r}")
    if low is not None and (value <= low if strict else value < low):
        raise ConfigError(name, f"must be {'>' if strict else '>='} {low}, got {value}")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(name, f"must be True or False, got {value!r}")


@dataclass(frozen=True, slots=True)
class LazyVerification:
    """SpecScale LV, a batching rule that never delays the critical path: a committed item
    goes at once while the reward model is idle; otherwise a reward batch runs when pending
    input tokens (speculative items count) reach ``token_threshold``, when a sibling group is
    complete, when an item was deferred ``max_deferrals`` times, when the oldest item waited
    ``max_wait_s``, or when ``spec_flush`` speculative items wait. Speculative items ride in
    the same batches as committed ones, so a speculative step is usually scored before it is
    adopted (its score is off the critical path).

    ``idle_flush=False`` (ablation): committed items wait for the rules above too, as in
    SpecScale's LV.

    ``defer_speculative`` (opt-in): speculative items ride along in a batch only up to
    ``token_threshold`` and otherwise wait for their branch to be confirmed, pruned or
    cancelled, or for the ``spec_flush`` backlog; the time and deferral rules count committed
    items only. A speculative step that is pruned before its turn is then never verified."""

    token_threshold: int = 2048
    max_deferrals: int = 6
    max_wait_s: float = 0.05
    spec_flush: int = 64
    defer_speculative: bool = False
    idle_flush: bool = True

    def __post_init__(self) -> None:
        for name in ("token_threshold", "max_deferrals", "spec_flush"):
            _integer(f"lv.{name}", getattr(self, name), 1)
        _number("lv.max_wait_s", self.max_wait_s, low=0, strict=True)
        for name in ("defer_speculative", "idle_flush"):
            _flag(f"lv.{name}", getattr(self, name))


@dataclass(frozen=True, slots=True)
class Speculation:
    """Technique switches.

    - ``speculate``: off; ``all`` (naive/SpecScale: continue every finished candidate at
      once, full width); ``ranked`` (SPEX T1: the policy's own ranked predictions).
    - ``budget`` (T2): the backend's one dispatcher (``spec_tot.executor.dispatcher``)
      launches every query's predicted children in order of expected value (hit rates
      learnt per policy and level, against the step-time cost measured on the backend)
      while there is room below its saturation batch; speculation backs off as the engine
      saturates (``full``).
    - ``early_termination`` (T3, changes the search, opt-in): stop once >= ``et_min_answers``
      answers exist and the top answer's cumulative reward leads the runner-up's by
      ``et_alpha`` x the runner-up's mean weight.
    - ``ep``: strict early pruning (k-th best threshold, ties kept); ``ep_full_score``: the
      full-score shortcut (opt-in: can change which tied node is kept).
    - ``dedup`` (CD): backends that support it share forward passes of identical prefixes.
    - ``lv``: lazy verification settings, or None to score each completion at once.
    - ``max_spec_depth`` (T1's k): the most levels below the committed frontier speculation
      may chain (through speculative nodes and nodes whose reward is pending, on provisional
      rewards); under T2 each level's learnt hit rate decides within it.
    - ``adaptive``: lazy verification only while committed load fills the engine (off by
      default: on the CPU engine, where the PRM shares the cores, batched verification won
      even at low load). ``full`` adapts through T2: speculation only within the budget
      that committed load leaves.
    Lazy verification's token threshold defaults to the backend's measured reward-batch
    knee (``Capabilities.reward_batch_tokens``) unless ``lv`` is overridden.
    """

    speculate: Speculate = "off"
    budget: bool = False
    early_termination: bool = False
    et_min_answers: int = 4
    et_alpha: float = 1.0
    ep: bool = False
    ep_full_score: bool = False
    full_score: float = 1.0
    dedup: bool = False
    lv: LazyVerification | None = None
    adaptive: bool = False
    round_rewards: bool = True  # baseline: one reward batch per round (search-and-learn)
    max_speculative_per_query: int = 64
    max_spec_depth: int = 6

    def __post_init__(self) -> None:
        if self.speculate not in ("off", "all", "ranked"):
            raise ConfigError("speculate", f"must be off, all or ranked, got {self.speculate!r}")
        for name in _FLAGS:
            _flag(name, getattr(self, name))
        _number("et_alpha", self.et_alpha, low=0)
        _number("full_score", self.full_score)
        _integer("et_min_answers", self.et_min_answers, 1)
        _integer("max_speculative_per_query", self.max_speculative_per_query, 1)
        _integer("max_spec_depth", self.max_spec_depth, 1)
        if self.lv is not None and not isinstance(self.lv, LazyVerification):
            raise ConfigError("lv", f"expected a LazyVerification or None, got {self.lv!r}")
        if self.round_rewards and self.speculate != "off":
            raise ConfigError("round_rewards", "speculative modes score as results arrive")


_FLAGS = (
    "budget",
    "early_termination",
    "ep",
    "ep_full_score",
    "dedup",
    "adaptive",
    "round_rewards",
)

MODES: dict[str, Speculation] = {
    "baseline": Speculation(),
    # The honest control for every speculative speedup: computation dedup (CD) alone, no
    # speculation, reward rounds as in baseline. Dedup is worth 1.2-1.4x on Game of 24.
    "dedup": Speculation(dedup=True),
    "naive": Speculation(speculate="all", round_rewards=False),
    "spex": Speculation(speculate="ranked", budget=True, round_rewards=False),
    "specscale": Speculation(
        speculate="all", ep=True, dedup=True, lv=LazyVerification(), round_rewards=False
    ),
    "full": Speculation(
        speculate="ranked",
        budget=True,
        ep=True,
        dedup=True,
        lv=LazyVerification(),
        round_rewards=False,
    ),
}


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    """How queries run.

    - ``mode``: a name in ``MODES``; ``speculation_overrides`` changes single switches.
    - ``seed``: base seed; every node's sampling seed derives from it and the node id, so a
      node's text does not depend on scheduling or mode.
    - ``max_concurrency``: queries in flight at once in ``batch``/``abatch``.
    - ``query_timeout_s``: per-query deadline (None: none).
    - ``goodput_deadline_s``: a correct answer counts towards goodput only within it.
    - ``max_nodes``: safety bound on tree size per query.
    - ``hit_rates``: a JSON file where the backend's speculation hit rates are kept between
      runs (``spec_tot.executor.hit_rate_store``): added to what the dispatcher has learnt
      when a batch starts, written back when it ends. None: every process learns afresh.
    """

    mode: str = "baseline"
    seed: int = 0
    max_concurrency: int = 32
    query_timeout_s: float | None = None
    goodput_deadline_s: float = 60.0
    max_nodes: int = 10_000
    hit_rates: str | None = None
    speculation_overrides: Mapping[str, Any] = field(default_factory=dict)
    speculation: Speculation = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise UnknownNameError("executor mode", str(self.mode), list(MODES))
        _integer("seed", self.seed, -(2**63))
        _integer("max_concurrency", self.max_concurrency, 1)
        if self.query_timeout_s is not None:
            _number("query_timeout_s", self.query_timeout_s, low=0, strict=True)
        _number("goodput_deadline_s", self.goodput_deadline_s, low=0, strict=True)
        _integer("max_nodes", self.max_nodes, 2)
        if isinstance(self.hit_rates, os.PathLike):
            object.__setattr__(self, "hit_rates", os.fspath(self.hit_rates))
        rates = self.hit_rates
        if rates is not None and (not isinstance(rates, str) or not rates):
            raise ConfigError("hit_rates", f"must be a file path or None, got {self.hit_rates!r}")
        if not isinstance(self.speculation_overrides, Mapping):
            raise ConfigError(
                "speculation_overrides", f"must be a dict, got {self.speculation_overrides!r}"
            )
        known = {f.name for f in fields(Speculation)}
        for key in self.speculation_overrides:
            if key not in known:
                raise ConfigError(f"speculation.{key}", f"unknown switch; known: {sorted(known)}")
        overrides = dict(self.speculation_overrides)
        lv = overrides.get("lv")
        if isinstance(lv, Mapping):
            allowed = {f.name for f in fields(LazyVerification)}
            for key in lv:
                if key not in allowed:
                    raise ConfigError(f"lv.{key}", f"unknown setting; known: {sorted(allowed)}")
            overrides["lv"] = LazyVerification(**lv)
        elif lv is not None and not isinstance(lv, LazyVerification):
            raise ConfigError(
                "speculation.lv", f"expected a dict, LazyVerification or None: {lv!r}"
            )
        if overrides.get("speculate", MODES[self.mode].speculate) != "off":
            overrides.setdefault("round_rewards", False)
        try:
            speculation = replace(MODES[self.mode], **overrides)
        except ConfigError as exc:  # name where the value came from
            raise ConfigError(f"speculation.{exc.field}", str(exc).split(": ", 1)[1]) from exc
        object.__setattr__(self, "speculation", speculation)
