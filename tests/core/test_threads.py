"""Sync twins of async runs (``spec_tot._private.threads``): the coroutine or stream run on a
worker thread sees the caller's context variables, so a branch's identity survives a sync
call made inside a running loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextvars import ContextVar

from spec_tot._private.threads import iterate_in_thread, run_sync
from spec_tot.adapters.scripted import ScriptedBackend
from spec_tot.branch_context import BranchContext, current_branch
from spec_tot.chat_spec_tot import ChatSpecTot

_probe: ContextVar[str | None] = ContextVar("probe", default=None)


async def _read() -> str | None:
    return _probe.get()


async def _reads() -> AsyncIterator[str | None]:
    yield _probe.get()


async def test_the_worker_thread_fallback_sees_the_callers_context() -> None:
    token = _probe.set("caller")
    try:
        assert run_sync(_read()) == "caller"  # a loop runs: a worker thread
        assert list(iterate_in_thread(_reads())) == ["caller"]
    finally:
        _probe.reset(token)


async def test_sync_chat_calls_in_an_async_node_keep_the_branch_prefix() -> None:
    model = ChatSpecTot(backend=ScriptedBackend(), seed=1)
    branch = BranchContext(prefix="run/1/node/0", loop=asyncio.get_running_loop())
    token = current_branch.set(branch)
    try:
        reply = model.invoke("hi")  # on the branch's own loop: the worker-thread fallback
        chunks = list(model.stream("hi"))
    finally:
        current_branch.reset(token)
    assert reply.response_metadata["request_id"].startswith("run/1/node/0/")
    assert chunks[-1].response_metadata["request_id"].startswith("run/1/node/0/")
