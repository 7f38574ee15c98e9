"""Frozen executor configuration, validated at construction.

A mode is a named set of technique switches; every switch can also be set on its own, so
each ablation is one flag: ``ExecutorConfig(mode="full", speculation_overrides={"ep": False})``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from spec_tot.errors import ConfigError, UnknownNameError

__all__ = ["MODES", "ExecutorConfig", "LazyVerification", "Speculation"]

Speculate = Literal["off", "all", "ranked"]


@dataclass(frozen=True, slots=True)
class LazyVerification:
    """SpecScale LV: a reward batch runs when pending input tokens reach ``token_threshold``,
    when a sibling group is complete, when an item was deferred ``max_deferrals`` times, when
    the oldest item waited ``max_wait_s``, or when ``spec_flush`` speculative items wait.

    ``defer_speculative`` (beyond SpecScale): speculative items ride along in a batch only up
    to ``token_threshold`` (where the PRM's per-call cost is already paid) and otherwise wait
    for their branch to be confirmed, pruned or cancelled, or for the ``spec_flush`` backlog;
    the time and deferral rules count committed items only. A speculative step that is pruned
    before its turn is then never verified at all."""

    token_threshold: int = 2048
    max_deferrals: int = 6
    max_wait_s: float = 0.05
    spec_flush: int = 64
    defer_speculative: bool = True

    def __post_init__(self) -> None:
        for name in ("token_threshold", "max_deferrals", "spec_flush"):
            if getattr(self, name) < 1:
                raise ConfigError(f"lv.{name}", f"must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.max_wait_s) and self.max_wait_s > 0):
            raise ConfigError("lv.max_wait_s", f"must be > 0, got {self.max_wait_s}")
        if not isinstance(self.defer_speculative, bool):
            raise ConfigError(
                "lv.defer_speculative", f"must be True or False, got {self.defer_speculative!r}"
            )


@dataclass(frozen=True, slots=True)
class Speculation:
    """Technique switches.

    - ``speculate``: off; ``all`` (naive/SpecScale: continue every finished candidate at
      once, full width); ``ranked`` (SPEX T1: the policy's own ranked predictions).
    - ``budget`` (T2): a global speculative budget from the backend's saturation batch minus
      committed load, shared across queries by softmax(utility / ``tau``) with online hit
      rates; it also makes speculation back off as the engine saturates (``full``).
    - ``early_termination`` (T3, changes the search, opt-in): stop once >= ``et_min_answers``
      answers exist and the top answer's cumulative reward leads the runner-up's by
      ``et_alpha`` x the runner-up's mean weight.
    - ``ep``: strict early pruning (k-th best threshold, ties kept); ``ep_full_score``: the
      full-score shortcut (opt-in: can change which tied node is kept).
    - ``dedup`` (CD): backends that support it share forward passes of identical prefixes.
    - ``lv``: lazy verification settings, or None to score each completion at once.
    - ``adaptive``: lazy verification only while committed load fills the engine (off by
      default: on the CPU engine, where the PRM shares the cores, batched verification won
      even at low load). ``full`` adapts through T2: speculation only within the budget
      that committed load leaves.
    Lazy verification's token threshold defaults to the backend's measured reward-batch
    knee (``Capabilities.reward_batch_tokens``) unless ``lv`` is overridden.
    """

    speculate: Speculate = "off"
    budget: bool = False
    tau: float = 1.0
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

    def __post_init__(self) -> None:
        if self.speculate not in ("off", "all", "ranked"):
            raise ConfigError("speculate", f"must be off, all or ranked, got {self.speculate!r}")
        for name in ("tau", "et_alpha", "full_score"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(name, f"must be a finite number, got {value!r}")
        if not self.tau > 0:
            raise ConfigError("tau", f"must be > 0, got {self.tau}")
        if self.et_min_answers < 1:
            raise ConfigError("et_min_answers", f"must be >= 1, got {self.et_min_answers}")
        if self.et_alpha < 0:
            raise ConfigError("et_alpha", f"must be >= 0, got {self.et_alpha}")
        if self.max_speculative_per_query < 1:
            raise ConfigError("max_speculative_per_query", "must be >= 1")
        if self.round_rewards and self.speculate != "off":
            raise ConfigError("round_rewards", "speculative modes score as results arrive")


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
    """

    mode: str = "baseline"
    seed: int = 0
    max_concurrency: int = 32
    query_timeout_s: float | None = None
    goodput_deadline_s: float = 60.0
    max_nodes: int = 10_000
    speculation_overrides: Mapping[str, Any] = field(default_factory=dict)
    speculation: Speculation = field(init=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UnknownNameError("executor mode", self.mode, list(MODES))
        if self.max_concurrency < 1:
            raise ConfigError("max_concurrency", f"must be >= 1, got {self.max_concurrency}")
        if self.query_timeout_s is not None and not (
            math.isfinite(self.query_timeout_s) and self.query_timeout_s > 0
        ):
            raise ConfigError("query_timeout_s", f"must be > 0, got {self.query_timeout_s}")
        if not self.goodput_deadline_s > 0:
            raise ConfigError("goodput_deadline_s", f"must be > 0, got {self.goodput_deadline_s}")
        if self.max_nodes < 2:
            raise ConfigError("max_nodes", f"must be >= 2, got {self.max_nodes}")
        known = {f.name for f in fields(Speculation)}
        for key in self.speculation_overrides:
            if key not in known:
                raise ConfigError(f"speculation.{key}", f"unknown switch; known: {sorted(known)}")
        overrides = dict(self.speculation_overrides)
        lv = overrides.get("lv")
        if isinstance(lv, Mapping):
            try:
                overrides["lv"] = LazyVerification(**lv)
            except TypeError as exc:
                raise ConfigError("speculation.lv", str(exc)) from exc
        elif lv is not None and not isinstance(lv, LazyVerification):
            raise ConfigError(
                "speculation.lv", f"expected a dict, LazyVerification or None: {lv!r}"
            )
        if overrides.get("speculate", MODES[self.mode].speculate) != "off":
            overrides.setdefault("round_rewards", False)
        try:
            speculation = replace(MODES[self.mode], **overrides)
        except TypeError as exc:  # a value of the wrong type in a switch
            raise ConfigError("speculation_overrides", str(exc)) from exc
        object.__setattr__(self, "speculation", speculation)
