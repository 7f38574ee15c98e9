"""Speculation hit rates kept between runs (``ExecutorConfig.hit_rates``).

The dispatcher learns per slot how often a launched speculative node is adopted, and how
much of the saving it expected an adopted one realised (``HitRates``). A run of a few
queries ends before it has learnt much: at one query in flight, four Game of 24 queries last
about 0.4 s, and each run started at the prior. Like the engine's step-time calibration,
what a run learnt is kept in a small JSON file and added to the next run's counts; the
counts' window (``HitRates``) keeps recent runs in charge. The gain loops' states per load
(``GainLoops.snapshot``: caps, probes, the epoch under way) are kept in the same file: the
next run goes on where this one ended, rather than starting again at the capacity.

The file is written whole and atomically, so concurrent runs never read half of one; the
last run to end wins. A file that exists but is not a hit-rate file is refused, never
overwritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spec_tot.errors import ConfigError
from spec_tot.executor.offers import Slot, SlotCounts

__all__ = ["load_gain_loops", "load_hit_rates", "save_hit_rates"]

_FORMAT = "spec-tot hit rates"
_VERSION = 1
Counts = dict[Slot, SlotCounts]
LoopStates = Mapping[int, Mapping[str, Any]]  # clients' bucket -> its gain loop's state


def load_hit_rates(path: str | os.PathLike[str]) -> Counts:
    """The counts per slot from ``path`` (``HitRates.snapshot``); empty when there is no
    such file yet."""
    file = Path(path)
    try:
        text = file.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError("hit_rates", f"cannot read {file}: {exc.strerror or exc}") from exc
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    counts = _counts_of(payload)
    if counts is None:
        raise ConfigError(
            "hit_rates",
            f"{file} is not a spec-tot hit-rate file; name another file or delete this one",
        )
    return counts


def load_gain_loops(path: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """The gain loops' states kept in the hit-rate file at ``path`` (empty when there are
    none, or the file is missing; ``load_hit_rates`` refuses a file that is not one)."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    entries = payload.get("gain_loop") if isinstance(payload, dict) else None
    states: dict[int, dict[str, Any]] = {}
    for entry in entries if isinstance(entries, list) else []:
        ok = isinstance(entry, dict) and type(entry.get("clients")) is int
        if ok and isinstance(entry.get("state"), dict):
            states[entry["clients"]] = entry["state"]
    return states


def save_hit_rates(
    path: str | os.PathLike[str], counts: Counts, loops: LoopStates | None = None
) -> None:
    """Write ``counts`` and the gain loops' states (``loops``) to ``path`` whole (a write
    that fails only costs the next run its head start: a warning, not an error)."""
    file = Path(path)
    slots = [
        {"kind": kind, "level": level, "band": band, **dict(zip(_COUNTS, figures, strict=True))}
        for (kind, level, band), figures in sorted(counts.items())
    ]
    payload: dict[str, Any] = {"format": _FORMAT, "version": _VERSION, "slots": slots}
    if loops:
        payload["gain_loop"] = [{"clients": b, "state": dict(state)} for b, state in loops.items()]
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, file)
    except OSError as exc:
        warnings.warn(f"hit rates not kept in {file}: {exc.strerror or exc}", stacklevel=2)
        with contextlib.suppress(OSError):  # no temp file, or no folder to hold one
            tmp.unlink(missing_ok=True)


_COUNTS = ("launched", "hits", "measured", "realised")


def _counts_of(payload: Any) -> Counts | None:
    """The counts of a well-formed payload, None for anything else."""
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        return None
    if payload.get("version") != _VERSION:
        return {}  # an older layout: learnt again rather than misread
    slots = payload.get("slots")
    if not isinstance(slots, list):
        return None
    counts: Counts = {}
    for slot in slots:
        try:
            kind, level, band = slot["kind"], slot["level"], slot["band"]
            launched, hits, measured, realised = (float(slot[name]) for name in _COUNTS)
        except (KeyError, TypeError, ValueError):
            return None
        if not isinstance(kind, str) or not isinstance(level, int) or not isinstance(band, int):
            return None
        if not (0 <= hits <= launched < float("inf") and 0 <= realised <= measured):
            return None
        counts[kind, level, band] = (launched, hits, measured, realised)
    return counts
