"""Typed field readers for JSON request bodies: each bad value is a ``ConfigError`` naming
the field (``sampling_params.top_p``, ``input_ids[3]``), which the routes answer as a 400."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from spec_tot.errors import ConfigError
from spec_tot.requests import check_text

__all__ = [
    "Inert",
    "check_known",
    "opt_bool",
    "opt_float",
    "opt_int",
    "opt_str",
    "stop_strings",
    "token_ids",
]

_MISSING = object()


def opt_int(
    body: Mapping[str, Any],
    key: str,
    field: str,
    default: Any,
    lo: int | None = None,
    hi: int | None = None,
) -> Any:
    """An integer (never a bool or a float), or ``default`` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"expected an integer, got {_kind(value)}")
    if lo is not None and value < lo:
        raise ConfigError(field, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(field, f"must be <= {hi}, got {value}")
    return value


def opt_float(body: Mapping[str, Any], key: str, field: str, default: Any) -> Any:
    """A finite number, or ``default`` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(field, f"expected a number, got {_kind(value)}")
    if not math.isfinite(value):
        raise ConfigError(field, f"must be finite, got {value}")
    return float(value)


def opt_bool(body: Mapping[str, Any], key: str, field: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(field, f"expected true or false, got {_kind(value)}")
    return value


def opt_str(body: Mapping[str, Any], key: str, field: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ConfigError(field, f"expected a string, got {_kind(value)}")
    return value


def stop_strings(value: Any, field: str) -> tuple[str, ...]:
    """``stop``: one string or a list of non-empty strings (null or [] for none)."""
    if value is None or value == "":
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ConfigError(field, f"expected a string or a list of strings, got {_kind(value)}")
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{field}[{i}]", "expected a non-empty string")
        check_text(item, f"{field}[{i}]")
    return tuple(items)


def token_ids(
    value: Any, field: str, vocab_size: int, *, allow_empty: bool = False
) -> tuple[int, ...]:
    """A list of token ids, each within the vocabulary."""
    if not isinstance(value, list):
        raise ConfigError(field, f"expected a list of token ids, got {_kind(value)}")
    if not value and not allow_empty:
        raise ConfigError(field, "is empty")
    for i, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise ConfigError(f"{field}[{i}]", f"expected a token id, got {_kind(tok)}")
        if not 0 <= tok < vocab_size:
            raise ConfigError(f"{field}[{i}]", f"{tok} is outside the vocabulary [0, {vocab_size})")
    return tuple(value)


class Inert:
    """A parameter spec-tot serve does not implement: accepted only at a value that changes
    nothing (SGLang's default, which clients such as SGLang's frontend always send), else a
    400 naming it. Never silently ignored."""

    def __init__(self, *allowed: Any) -> None:
        self.allowed = allowed

    def check(self, value: Any, field: str) -> None:
        if any(value == ok and type(value) is type(ok) for ok in self.allowed) or value is None:
            return
        shown = " or ".join(repr(a) for a in self.allowed) or "null"
        raise ConfigError(field, f"not implemented by spec-tot serve (only {shown} is accepted)")


def check_known(
    body: Mapping[str, Any], known: set[str], inert: Mapping[str, Inert], prefix: str = ""
) -> None:
    """Every key is one the route reads or an inert one at a harmless value; anything else is
    a 400 naming it (a misspelt parameter must not pass as a default)."""
    for key, value in body.items():
        field = f"{prefix}{key}"
        if key in inert:
            inert[key].check(value, field)
        elif key not in known:
            raise ConfigError(field, "unknown parameter")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
