"""Checks of a policy's parameters, raised at construction as ``ConfigError`` naming the
parameter (``width``, ``vote``, ...)."""

from __future__ import annotations

import math

from spec_tot.errors import ConfigError
from spec_tot.policies.ranking import Vote
from spec_tot.tree import Aggregation

__all__ = [
    "check_aggregation",
    "check_beam_shape",
    "check_finite",
    "check_nonnegative",
    "check_positive",
    "check_positive_float",
    "check_range",
    "check_vote",
]


def check_positive(name: str, value: int) -> None:
    # bool is an int subclass: reject it so ``width=True`` does not silently mean 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if value < 1:
        raise ConfigError(name, f"must be >= 1, got {value}")


def check_positive_float(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(name, f"must be a number > 0, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(name, f"must be finite, got {value!r}")


def check_nonnegative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(name, f"must be a number >= 0, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(name, f"must be finite, got {value!r}")


def check_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value!r}")


def check_range(name: str, value: float, low: float, high: float) -> None:
    """``low <= value <= high`` (finite)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigError(name, f"must be a number in [{low}, {high}], got {value!r}")


def check_vote(value: str) -> Vote:
    if value not in ("majority", "weighted", "best"):
        raise ConfigError("vote", f"must be 'majority', 'weighted' or 'best', got {value!r}")
    return value  # type: ignore[return-value]


def check_aggregation(value: str) -> Aggregation:
    if value not in ("last", "min", "prod"):
        raise ConfigError("aggregation", f"must be 'last', 'min' or 'prod', got {value!r}")
    return value  # type: ignore[return-value]


def check_beam_shape(n: int, width: int) -> None:
    """``n`` samples a round expanded ``width`` at a time: n // width >= 1 kept nodes."""
    check_positive("n", n)
    check_positive("width", width)
    if width > n:
        raise ConfigError("width", f"must be <= n ({n}) so that n // width >= 1, got {width}")
