"""Plug-ins by name: ``"module:attr"`` targets, imported on first use, and the ones that
installed distributions declare as entry points."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Collection
from importlib.metadata import entry_points
from typing import Any

__all__ = ["declared", "load_target"]


def load_target(target: str) -> Any:
    """The object a ``"module:attr"`` (or ``"module:obj.attr [extra]"``) target names."""
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name.strip())
    for part in attr.split("[")[0].strip().split("."):
        obj = getattr(obj, part)
    return obj


def declared(group: str, built_in: Collection[str], *, warn: bool = False) -> dict[str, str]:
    """Name -> target of the entry points in ``group``; a plug-in cannot shadow a built-in
    name (skipped, with a warning when ``warn``)."""
    out: dict[str, str] = {}
    for point in entry_points(group=group):
        if point.name in built_in:
            if warn:
                warnings.warn(
                    f"entry point {point.value!r} ({group}) may not replace the built-in "
                    f"{point.name!r}; skipped",
                    stacklevel=3,
                )
            continue
        out[point.name] = point.value
    return out
