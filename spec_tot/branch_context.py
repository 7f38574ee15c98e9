"""The identity of the branch an LLM call runs in, carried by a context variable.

A runner that starts a task (a LangGraph node on a real or a speculative path) sets
``current_branch`` for it; asyncio tasks and LangChain's thread hand-offs copy the context,
so a chat model called anywhere inside the node sees it. ``ChatSpecTot`` reads it to give
each request a hierarchical id under the branch (a cancelled branch is aborted by prefix)
and the branch's priority (committed work first), and makes each request inside
``admit(backend, n)``: the runner learns which spec-tot backends the graph uses (their shared
speculation budget, ``spec_tot.executor.hub_for``), and a speculative branch holds a budget
sequence per sample while the request runs (waiting there for room if need be). Other chat
models ignore it and are cancelled with their asyncio task.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from spec_tot.requests import Priority

__all__ = ["BranchContext", "current_branch"]


@dataclass(eq=False)
class BranchContext:
    """``prefix``: the branch's request-id prefix (``run/step/node/n``); ``speculative``:
    True until a real step adopts the branch; ``loop``: the event loop the run (and its
    backends) live on, for calls made from worker threads."""

    prefix: str
    speculative: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    cancelled: bool = False
    # The runner's admission hook (see ``admit``); None outside a runner.
    admission: Callable[[Any, int], AbstractAsyncContextManager[None]] | None = None
    # Buffered stream-writer output of a speculative branch, replayed when it is adopted.
    custom: list[Any] = field(default_factory=list)
    _calls: itertools.count[int] = field(default_factory=itertools.count)
    _aborts: dict[int, Callable[[], Awaitable[Any]]] = field(default_factory=dict)

    @property
    def priority(self) -> Priority:
        return Priority.SPECULATIVE if self.speculative else Priority.COMMITTED

    def request_id(self) -> str:
        """A fresh id under the branch prefix, for one backend request."""
        return f"{self.prefix}/{next(self._calls)}"

    def admit(self, backend: Any, n: int = 1) -> AbstractAsyncContextManager[None]:
        """Wraps a chat model's request of ``n`` samples on ``backend`` (a
        ``GenerationBackend``): build and send the request inside it. Entering may wait for
        room on the backend's speculation budget while the branch is speculative (it goes
        on at once if the branch is adopted meanwhile: the request is committed work)."""
        if self.admission is None:
            return contextlib.nullcontext()
        return self.admission(backend, n)

    def on_cancel(self, owner: object, abort: Callable[[], Awaitable[Any]]) -> None:
        """Register ``owner``'s (a backend's) prefix abort, run if the branch is cancelled."""
        self._aborts.setdefault(id(owner), abort)

    async def abort(self) -> None:
        """Mark the branch cancelled and abort its backend requests by prefix."""
        self.cancelled = True
        for abort in list(self._aborts.values()):
            await abort()


current_branch: ContextVar[BranchContext | None] = ContextVar("spec_tot_branch", default=None)
