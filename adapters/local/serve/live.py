"""Live requests of ``spec-tot serve`` and SGLang's abort rules over them.

Every sample runs as its own engine request under a private, hierarchical id
(``serve/<request>/<prompt>/<sample>``: whatever ids clients choose, one HTTP request's
samples are exactly the engine ids under ``serve/<request>``), so aborting one sample stops
only that one, and a whole request stops with one prefix abort: the engine scans its
requests once, where one abort per sample scanned them once per sample (12,288 samples of
three stalled streams once took 17 s to leave the engine).

Clients know samples by rid. ``abort(rid)`` follows SGLang 0.5.23 (``tokenizer_manager.py``
``abort_request`` then ``scheduler.py``): nothing happens unless ``rid`` is exactly a live
rid; then every live rid that starts with it (a raw string prefix) is aborted. A request
with n > 1 stays live under its own rid too, so aborting it stops all its samples.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import replace

from spec_tot.backends import matches_prefix
from spec_tot.errors import ConfigError
from spec_tot.requests import GenerateRequest, GenerateResult

from ..backend import LocalBackend
from .schema import GenerateBatch

__all__ = ["LiveRequests", "engine_prefix", "run_samples"]


def engine_prefix(requests: Sequence[GenerateRequest]) -> str:
    """The longest ``/``-path prefix of every request's id: one engine abort of it stops
    them all (their ids are private and unique, so it covers nothing else)."""
    paths = [r.request_id.split("/") for r in requests]
    common = paths[0]
    for path in paths[1:]:
        k = 0
        while k < min(len(common), len(path)) and common[k] == path[k]:
            k += 1
        common = common[:k]
    return "/".join(common)


def _outermost(prefixes: Iterable[str]) -> list[str]:
    """``prefixes`` without those another one already covers (``a/b`` under ``a``)."""
    kept: list[str] = []
    for prefix in sorted(set(prefixes)):
        if not any(matches_prefix(prefix, k) for k in kept):
            kept.append(prefix)
    return kept


class LiveRequests:
    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend
        self._serial = itertools.count(1)
        self._live: dict[str, str] = {}  # client rid -> the engine id prefix it stops
        self._samples: dict[str, int] = {}  # engine prefix of a live batch -> its samples

    @property
    def num_running(self) -> int:
        """Samples of the batches claimed and not yet released."""
        return sum(self._samples.values())

    def claim(self, batch: GenerateBatch) -> list[GenerateRequest]:
        """Engine requests for the batch's samples, registered under their rids."""
        rids = [s.rid for s in batch.samples]
        names = set(rids) | set(batch.item_rids)
        for rid in sorted(names):
            if rid in self._live:
                raise ConfigError("rid", f"{rid!r} is already running")
        base = f"serve/{next(self._serial)}"
        n = len(batch.samples) // max(1, len(batch.item_rids))  # prompt-major: n per prompt
        out = []
        for k, sample in enumerate(batch.samples):
            engine_id = f"{base}/{k // n}/{k % n}"
            self._live[sample.rid] = engine_id
            out.append(replace(sample.request, request_id=engine_id))
        for i, item in enumerate(batch.item_rids):
            if item not in self._live:  # n > 1: the request's own rid names its samples
                self._live[item] = f"{base}/{i}"
        self._samples[base] = len(out)
        return out

    def release(self, batch: GenerateBatch) -> None:
        for rid in {s.rid for s in batch.samples} | set(batch.item_rids):
            engine_id = self._live.pop(rid, None)
            if engine_id is not None:
                self._samples.pop("/".join(engine_id.split("/")[:2]), None)

    async def abort(self, rid: str) -> list[str]:
        if rid not in self._live:
            return []  # SGLang ignores an rid that is not live
        hit = sorted(r for r in self._live if r.startswith(rid))
        await self._abort_engine(self._live[r] for r in hit)
        return hit

    async def abort_all(self) -> list[str]:
        hit = sorted(self._live)
        await self._abort_engine(self._live.values())
        return hit

    async def _abort_engine(self, prefixes: Iterable[str]) -> None:
        for prefix in _outermost(prefixes):
            await self.backend.abort(prefix)


async def run_samples(
    backend: LocalBackend, requests: Sequence[GenerateRequest]
) -> list[GenerateResult]:
    """Run every sample; the first that fails (a request the engine refuses) aborts the
    others and raises, so a bad batch leaves nothing running; a caller that goes away
    (cancelled) aborts them all with one prefix abort."""
    tasks = [asyncio.create_task(backend.generate(r)) for r in requests]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        if any(not t.done() for t in tasks):
            await backend.abort(engine_prefix(requests))  # one pass over the engine
        for task in tasks:
            if not task.done():
                task.cancel()  # the backend drops what is left of each
        await asyncio.gather(*tasks, return_exceptions=True)
