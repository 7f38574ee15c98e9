"""Frozen executor configuration, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from spec_tot.errors import ConfigError, UnknownNameError

__all__ = ["MODES", "ExecutorConfig"]

# Executor modes implemented by this runtime. Speculative modes (naive, spex, specscale,
# full) are added with the speculative executor; asking for one before it exists is an error,
# never a silent fallback to baseline.
MODES: tuple[str, ...] = ("baseline",)


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    """How queries run.

    - ``mode``: executor mode (see ``MODES``).
    - ``seed``: base seed; every node's sampling seed derives from it and the node id, so a
      node's text does not depend on scheduling.
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
