"""Live requests of ``spec-tot serve`` and SGLang's abort rules over them.

Every sample runs as its own engine request under a private id (``serve-<serial>``: never a
prefix of another, whatever ids clients choose), so aborting one sample stops only that one.
Clients know samples by rid. ``abort(rid)`` follows SGLang 0.5.23 (``tokenizer_manager.py``
``abort_request`` then ``scheduler.py``): nothing happens unless ``rid`` is exactly a live rid;
then every live rid that starts with it (a raw string prefix) is aborted. A request with
n > 1 stays live under its own rid too, so aborting it stops all its samples.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import replace

from spec_tot.errors import ConfigError
from spec_tot.requests import GenerateRequest, GenerateResult

from ..backend import LocalBackend
from .schema import GenerateBatch

__all__ = ["LiveRequests", "run_samples"]


class LiveRequests:
    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend
        self._serial = itertools.count(1)
        self._live: dict[str, list[str]] = {}  # client rid -> engine ids

    @property
    def num_running(self) -> int:
        return len({e for ids in self._live.values() for e in ids})

    def claim(self, batch: GenerateBatch) -> list[GenerateRequest]:
        """Engine requests for the batch's samples, registered under their rids."""
        rids = [s.rid for s in batch.samples]
        names = set(rids) | set(batch.item_rids)
        for rid in sorted(names):
            if rid in self._live:
                raise ConfigError("rid", f"{rid!r} is already running")
        out = []
        for sample in batch.samples:
            engine_id = f"serve-{next(self._serial)}"
            self._live[sample.rid] = [engine_id]
            out.append(replace(sample.request, request_id=engine_id))
        for item in batch.item_rids:
            if item not in self._live:  # n > 1: the request's own rid names its samples
                prefix = item + "_"
                self._live[item] = [
                    e.request_id
                    for s, e in zip(batch.samples, out, strict=True)
                    if s.rid.startswith(prefix)
                ]
        return out

    def release(self, batch: GenerateBatch) -> None:
        for rid in {s.rid for s in batch.samples} | set(batch.item_rids):
            self._live.pop(rid, None)

    async def abort(self, rid: str) -> list[str]:
        if rid not in self._live:
            return []  # SGLang ignores an rid that is not live
        hit = sorted(r for r in self._live if r.startswith(rid))
        await self._abort_engine({e for r in hit for e in self._live[r]})
        return hit

    async def abort_all(self) -> list[str]:
        hit = sorted(self._live)
        await self._abort_engine({e for ids in self._live.values() for e in ids})
        return hit

    async def _abort_engine(self, engine_ids: set[str]) -> None:
        for engine_id in sorted(engine_ids):
            await self.backend.abort(engine_id)


async def run_samples(
    backend: LocalBackend, requests: Sequence[GenerateRequest]
) -> list[GenerateResult]:
    """Run every sample; the first that fails (a request the engine refuses) aborts the
    others and raises, so a bad batch leaves nothing running."""
    tasks = [asyncio.create_task(backend.generate(r)) for r in requests]
    try:
        _done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
        if failed is not None:
            for task, request in zip(tasks, requests, strict=True):
                if not task.done():
                    await backend.abort(request.request_id)
            await asyncio.gather(*pending, return_exceptions=True)
            raise failed.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()  # the caller went away: the backend aborts each in the engine
        await asyncio.gather(*tasks, return_exceptions=True)
