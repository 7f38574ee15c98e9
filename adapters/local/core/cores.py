"""The engine cores behind one ``LocalBackend``: when they start, restart and stop.

A backend has one core (policy and PRM together) or two (the PRM apart: ``prm_process``).
``await CoreSet.start()`` starts them; a call that finds its core dead (a crash, a kill,
out of memory) starts a fresh one, off the event loop. What a core reported when it came
up (``Ready``: limits, calibration) is kept, so reading it is cheap and needs no core.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spec_tot.errors import BackendError

from ..config import CoreOptions, EngineConfig, PrmConfig, resolve_device
from ..engine.validate import RequestValidator
from .fork_server import ForkServer
from .messages import PROTOCOL, PolicyInfo, Ready, Start
from .proc import CoreLink, OnOutput, default_threads, start_link

__all__ = ["CoreSet", "CoreSlot"]

_NOT_STARTED = "not started: `await backend.start()` first (spec-tot's apps and executor do)"


@dataclass(slots=True)
class CoreSlot:
    """One core: started by ``CoreSet.start`` or on first use, afresh after it died."""

    start: Start
    link: CoreLink | None = None
    ready: Ready | None = None  # what the latest core reported: kept after it stops
    validator: RequestValidator | None = None

    def current(self) -> CoreLink | None:
        link = self.link
        return link if link is not None and link.alive else None

    def last_ready(self) -> Ready:
        if self.ready is None:
            raise BackendError("local", _NOT_STARTED)
        return self.ready


class CoreSet:
    """The policy's and the PRM's cores (one shared core, or one each)."""

    def __init__(
        self,
        engine: EngineConfig | None,
        prm: PrmConfig | None,
        options: CoreOptions,
        cache_dir: str | None,
        on_output: OnOutput,
        on_exit: Callable[[CoreLink, BaseException], None],
        on_ready: Callable[[CoreSlot], None],
    ) -> None:
        """``on_output`` gets each core's outputs; ``on_exit`` the error that fails the
        requests in flight on a core that stopped; ``on_ready`` a slot whose core came up."""
        self.options = options
        self._on_output, self._on_exit, self._on_ready = on_output, on_exit, on_ready
        split = options.process and _prm_apart(options, engine, prm)
        threads: tuple[int | None, int | None] = (None, None)  # in-thread: the caller's own
        if options.process:
            threads = (
                (options.threads,) * 2
                if options.threads
                else default_threads(split, options.caller_core)
            )

        def start(e: EngineConfig | None, p: PrmConfig | None) -> Start:
            count = threads[1] if e is None else threads[0]
            return Start(PROTOCOL, e, p, cache_dir, count, options.hook)

        self.policy: CoreSlot | None
        self.reward: CoreSlot | None
        if split:
            self.policy, self.reward = CoreSlot(start(engine, None)), CoreSlot(start(None, prm))
        else:
            shared = CoreSlot(start(engine, prm))
            self.policy = shared if engine is not None else None
            self.reward = shared if prm is not None else None
        self.slots = [s for s in {id(s): s for s in (self.policy, self.reward) if s}.values()]
        self._lock = threading.Lock()
        self.closed = False
        weakref.finalize(self, _close_all, self.slots)
        if options.process and ForkServer.forks(options):
            ForkServer.shared()  # warm it now: its imports overlap the caller's start-up

    async def start(self) -> None:
        """Start every core not running (off the event loop); idempotent."""
        for slot in self.slots:
            await self.alink(slot, "engine")

    def link(self, slot: CoreSlot) -> CoreLink:
        """``slot``'s running core, started now if there is none (blocking)."""
        link = slot.current()
        if link is not None:
            return link
        with self._lock:
            if self.closed:
                raise BackendError("local", "backend closed")
            link = slot.current()
            if link is None:
                link = start_link(slot.start, self.options, self._on_output, self._exited)
                policy = link.ready.policy
                slot.validator = _validator(policy) if policy is not None else None
                slot.link, slot.ready = link, link.ready
                self._on_ready(slot)
            return link

    def _exited(self, link: CoreLink, error: BaseException | None) -> None:
        if error is not None:
            error = BackendError(
                "local",
                f"{str(error).removeprefix('local: ')}; the requests in flight on it failed, "
                "and the next call starts a fresh engine",
            )
        self._on_exit(link, error or BackendError("local", "backend closed"))

    def first_ready(self, slot: CoreSlot) -> Ready:
        """What ``slot``'s core reported, starting it (blocking) if it never ran."""
        if slot.ready is None:
            self.link(slot)
        return slot.last_ready()

    async def alink(self, slot: CoreSlot | None, what: str) -> CoreLink:
        if slot is None or self.closed:
            raise BackendError("local", f"no {what} (closed, or not loaded)")
        link = slot.current()
        if link is None:
            link = await asyncio.to_thread(self.link, slot)
        return link

    def running_link(self, slot: CoreSlot | None) -> CoreLink | None:
        """``slot``'s core if one runs now (None: none, or the backend is closed)."""
        return slot.current() if slot is not None and not self.closed else None

    def in_thread(self, slot: CoreSlot | None) -> Any:
        """The in-thread core object (``process=False``), None in a child process or
        before the core started."""
        if slot is None or self.options.process:
            return None
        return getattr(slot.current(), "core", None)

    @property
    def running(self) -> bool:
        return any(slot.current() is not None for slot in self.slots)

    async def aclose(self) -> None:
        if self.closed:
            return
        with self._lock:
            self.closed = True
        await asyncio.to_thread(_close_all, self.slots)


def _validator(info: PolicyInfo) -> RequestValidator:
    return RequestValidator(
        None, info.vocab_size, info.max_len, info.max_num_seqs, info.max_prompt_chars
    )


def _close_all(slots: list[CoreSlot]) -> None:
    for slot in slots:
        link = slot.link
        if link is not None and link.alive:
            link.close()


def _prm_apart(opts: CoreOptions, engine: EngineConfig | None, prm: PrmConfig | None) -> bool:
    """Whether the PRM gets a core process of its own (``CoreOptions.prm_process``; None:
    yes on CPU, no when either model runs on CUDA)."""
    if engine is None or prm is None:
        return False
    if opts.prm_process is not None:
        return opts.prm_process
    return not any(resolve_device(c.device).startswith("cuda") for c in (engine, prm))
