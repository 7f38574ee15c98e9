"""LocalBackend: the embedded engine behind the async backend contracts.

The engine core (scheduler, model runner, block manager, sampler, PRM: ``core.py``) runs
in a child process by default, so the caller's Python (the executor, the search) never
holds the GIL the engine needs; ``CoreOptions(process=False)`` runs it on a worker thread
of this process instead. Either way this object only queues typed commands
(``messages.py``) and routes the core's per-step output batches to the futures and stream
queues of its callers, on their own event loops (``loop.call_soon_threadsafe``); nothing
here waits for the engine on an event loop.

Requests are checked here before they are sent (types, ids in the vocabulary, lengths,
text capped by characters: ``RequestValidator.check_request`` with the limits the core
reported), so a bad one costs the engine nothing; the core tokenises and checks the rest.

Lifecycle (``cores.py``): ``await backend.start()`` starts the core; a request starts it
too, off the event loop. Properties (``capabilities``, ``tokenizer``, ``policy``) only read
what the core reported, so they are cheap and need a started backend. If it dies (a
crash, a kill, out of memory), every request in flight on it fails with a ``BackendError``
that says so, and the next call starts a fresh core. ``aclose`` stops it
(requests still in flight fail with "backend closed"); at interpreter exit it is stopped
too, and a core whose backend's process died exits by itself (``core_process.py``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from typing import Any

from spec_tot.backends import GenerationBackend, RewardBackend
from spec_tot.errors import BackendError, ConfigError
from spec_tot.requests import (
    Capabilities,
    Completion,
    GenerateRequest,
    GenerateResult,
    RewardItem,
    StreamUpdate,
)

from .config import CoreOptions, EngineConfig, PrmConfig
from .core.cores import CoreSet, CoreSlot
from .core.delivery import Delivery, Unread
from .core.messages import (
    Abort,
    Add,
    Cancel,
    Classify,
    Flush,
    FlushPrefixCache,
    Inspect,
    Ping,
    PolicyInfo,
    PoolReport,
    Ready,
    RewardInfo,
    Score,
)
from .core.proc import CoreLink
from .engine.validate import RequestValidator
from .texts import LocalTexts, render_chat

__all__ = ["LocalBackend"]


class LocalBackend(GenerationBackend, RewardBackend):
    def __init__(
        self,
        engine: EngineConfig | None,
        prm: PrmConfig | None = None,
        *,
        options: CoreOptions | None = None,
        cache_dir: str | None = None,
    ) -> None:
        if engine is None and prm is None:
            raise ConfigError("policy_path", "give a policy model, a PRM, or both")
        self.options = options or CoreOptions()
        self._delivery = Delivery()
        on = self._delivery
        self._cores = CoreSet(
            engine, prm, self.options, cache_dir, on.on_output, on.fail_link, self._on_ready
        )
        self._policy, self._reward = self._cores.policy, self._cores.reward
        self._texts = LocalTexts(  # an in-thread core's tokenizers are reused, not reloaded
            lambda: self.policy,
            lambda: self.reward,
            lambda role: getattr(self.engine if role == "policy" else self.prm, "tokenizer", None),
        )
        self._tickets = itertools.count(1)
        self._inflight: dict[str, int] = {}

    # -- the cores' lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine cores (policy, PRM) and wait until they are ready; idempotent.
        Properties (``capabilities``, ``tokenizer``, ``policy``, ...) read what the cores
        reported, so they need a started backend; requests start it themselves."""
        await self._cores.start()

    def _on_ready(self, slot: CoreSlot) -> None:
        if slot is self._policy and slot.ready is not None:
            self._delivery.stats = dict(slot.ready.stats)

    @property
    def engine(self) -> Any:
        """The ``LLMEngine`` itself with ``process=False`` (debugging); None in a process."""
        core = self._cores.in_thread(self._policy)
        return None if core is None else core.engine

    @property
    def prm(self) -> Any:
        """The ``PrmScorer`` itself with ``process=False``; None in a process."""
        core = self._cores.in_thread(self._reward)
        return None if core is None else core.prm

    @property
    def validator(self) -> RequestValidator | None:
        """The checks run here before a request is sent (None without a policy)."""
        if self._policy is None:
            return None
        self._policy.last_ready()
        return self._policy.validator

    @property
    def policy(self) -> PolicyInfo | None:
        """The policy engine's limits (None without one)."""
        return self._policy.last_ready().policy if self._policy else None

    @property
    def reward(self) -> RewardInfo | None:
        """The PRM's layout and limits (None without one)."""
        return self._reward.last_ready().reward if self._reward else None

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer in this process (loaded on first use), None without one."""
        return self._texts.tokenizer()

    @property
    def reward_tokenizer(self) -> Any:
        return self._texts.reward_tokenizer()

    def render_chat(self, messages: Seq[Any]) -> str:
        """One prompt from chat messages (``{"role", "content"}`` dicts or LangChain
        messages) with the model's own chat template, its generation prompt appended;
        ``role: content`` lines when the model has no template. Give it as ``ChatSpecTot``'s
        ``to_prompt`` for an instruction-tuned model."""
        return render_chat(self.tokenizer, messages)

    async def check_health(self, timeout: float = 10.0) -> int:
        """Ping every core (starting any that is not running); the policy core's pid.
        A core that does not answer within ``timeout`` seconds is a ``BackendError``."""
        pid = 0
        for slot in self._cores.slots:
            link = await self._cores.alink(slot, "engine")
            try:
                pong = await asyncio.wait_for(self._call(link, Ping), timeout)
            except TimeoutError:
                raise BackendError("local", f"the engine (pid {link.pid}) did not answer") from None
            pid = pid or pong.pid
        return pid

    async def pool_report(self) -> PoolReport:
        """Where the KV blocks are, after every command sent before this call."""
        link = await self._cores.alink(self._policy or self._reward, "engine")
        pong = await self._call(link, Inspect)
        return pong.report  # type: ignore[no-any-return]

    # -- contract ---------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """``saturation_batch`` and the reward knee as measured (see ``calibrate.py``);
        ``extra`` adds the KV pool size and ``step_s_b{n}``, the measured full step time
        (seconds) at decode batch ``n``. The one property that starts a core that never
        ran (blocking): the backend contract reads it synchronously; ``await start()``
        first keeps that off the event loop."""
        ready = self._cores.first_ready(self._policy) if self._policy else None
        knee = self._cores.first_ready(self._reward).reward_knee if self._reward else None
        return _capabilities(ready, knee)

    @property
    def closed(self) -> bool:
        return self._cores.closed

    @property
    def running(self) -> bool:
        """Whether a core is up now (none before first use, after a crash, after close)."""
        return self._cores.running

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def _admit(self, request: GenerateRequest, link: CoreLink) -> int:
        if not isinstance(request, GenerateRequest):
            raise ConfigError("request", f"must be a GenerateRequest, got {type(request).__name__}")
        if request.request_id in self._inflight:
            raise ConfigError("request_id", f"{request.request_id!r} is already in flight")
        assert self._policy is not None and self._policy.validator is not None  # internal
        self._policy.validator.check_request(request)  # cheap checks, no tokenizing
        ticket = next(self._tickets)
        self._inflight[request.request_id] = ticket
        return ticket

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        try:
            return await self._generate(request)
        except Unread:  # its core died before reading it: nothing ran, a fresh core takes it
            return await self._generate(request)

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        link = await self._cores.alink(self._policy, "policy engine")
        ticket = self._admit(request, link)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerateResult] = loop.create_future()
        self._delivery.expect(ticket, link, loop, fut)
        try:
            if not link.send(Add(ticket, request)):
                self._delivery.fail(ticket, BackendError("local", "the engine is gone"))
            return await fut
        except asyncio.CancelledError:
            # a cancelled caller leaves nothing behind: abort exactly this id in the engine
            link.send(Cancel(request.request_id))
            raise
        finally:
            self._inflight.pop(request.request_id, None)
            self._delivery.forget(ticket)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamUpdate]:
        """Per-token updates of every sample of ``request``; the last update of a sample
        carries its ``Completion``. Closing the iterator early aborts the request: at once
        when the consuming task is cancelled or the iterator is ``aclose()``d (wrap it in
        ``contextlib.aclosing`` to leave a loop with ``break``), else when it is collected."""
        link = await self._cores.alink(self._policy, "policy engine")
        ticket = self._admit(request, link)
        updates: asyncio.Queue[Any] = asyncio.Queue()
        self._delivery.expect(ticket, link, asyncio.get_running_loop(), updates)
        open_samples = set(range(request.n))
        try:
            if not link.send(Add(ticket, request, stream=True)):
                self._delivery.fail(ticket, BackendError("local", "the engine is gone"))
            while open_samples:
                for update in _updates_of(await updates.get(), open_samples):
                    yield update
        finally:
            if open_samples:
                link.send(Cancel(request.request_id))
            self._inflight.pop(request.request_id, None)
            self._delivery.forget(ticket)

    async def abort(self, prefix: str) -> int:
        link = self._cores.running_link(self._policy)
        if link is None:  # no core running: nothing in flight
            return 0
        return int((await self._call(link, lambda call: Abort(call, prefix))).value or 0)

    async def flush(self) -> None:
        """Wait until the core has handled every command sent before this call."""
        link = self._cores.running_link(self._policy)
        if link is not None:
            await self._call(link, Flush)

    async def flush_prefix_cache(self) -> bool:
        """Drop every content cache while idle, so that a run after it computes what a cold
        engine would: the engine's prefix cache, its drafters' history of earlier
        sequences, the PRM's cached scores and prefixes. False (something was not flushed)
        while requests run or wait."""
        if self._cores.closed:
            return False
        done = True
        for slot in self._cores.slots:
            link = await self._cores.alink(slot, "engine")
            done = bool((await self._call(link, FlushPrefixCache)).value) and done
        return done

    def count_tokens(self, text: str) -> int:
        return self._texts.count_tokens(text)

    def count_item_tokens(self, item: RewardItem) -> int:
        """Tokens scoring ``item`` computes (``RewardInfo.item_tokens``)."""
        info = self.reward
        if info is None:
            return max(1, round(len(item.text) * 0.25))
        return info.item_tokens(item)

    def stats(self) -> dict[str, float]:
        """The policy core's counters, with the PRM's stage times (``prm_*``: from the PRM's
        own core when it runs apart, else from the policy core's)."""
        out = dict(self._delivery.reward_stats)
        if self._policy:
            out.update(self._delivery.stats)
        return out

    async def score(self, items: Seq[RewardItem]) -> list[tuple[float, ...]]:
        link = await self._cores.alink(self._reward, "PRM (pass prm_path)")
        reply = await self._call(link, lambda call: Score(call, list(items)))
        return [tuple(s) for s in reply.scores]

    async def classify(self, texts: Seq[str | Seq[int]]) -> list[float]:
        """The PRM's reward of each raw text (``PrmScorer.classify``)."""
        link = await self._cores.alink(self._reward, "PRM (pass prm_path)")
        rows = [t if isinstance(t, str) else list(t) for t in texts]
        reply = await self._call(link, lambda call: Classify(call, rows))
        return list(reply.rewards)

    async def aclose(self) -> None:
        await self._cores.aclose()

    async def _call(self, link: CoreLink, make: Any) -> Any:
        """Send the command ``make(call_id)`` and await its answer (an error raises)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        call = self._delivery.expect_call(link, loop, fut)
        if not link.send(make(call)):
            self._delivery.fail_call(call, BackendError("local", "the engine is gone"))
        return await fut


def _capabilities(ready: Ready | None, knee: tuple[int, float] | None) -> Capabilities:
    policy = ready.policy if ready else None
    extra = {
        "num_kv_blocks": float(policy.num_kv_blocks if policy else 0),
        "block_size": float(policy.block_size if policy else 0),
    }
    if ready is not None:
        extra.update({f"step_s_b{b}": t for b, t in ready.step_curve.items()})
    return Capabilities(
        abort=True,
        prefix_abort=True,
        prefix_cache=True,
        engine_dedup=True,
        streaming=True,
        saturation_batch=max(1, ready.saturation_batch if ready else 0),
        max_running_requests=policy.max_num_seqs if policy else 1,
        reward_batch_tokens=knee[0] if knee else None,
        reward_batch_s=knee[1] if knee else None,
        name="local",
        extra=extra,
    )


def _updates_of(item: Any, open_samples: set[int]) -> list[StreamUpdate]:
    """What one delivered item gives a stream: an update of a sample still open, or, for a
    result (the request ended, aborted), the final update of every sample still open."""
    if isinstance(item, BaseException):
        raise item
    if isinstance(item, StreamUpdate):
        if item.index not in open_samples:
            return []
        if item.finished:
            open_samples.discard(item.index)
        return [item]
    out = [
        _final_update(item.request_id, index, completion)
        for index, completion in enumerate(item.completions)
        if index in open_samples
    ]
    open_samples.clear()
    return out


def _final_update(request_id: str, index: int, completion: Completion) -> StreamUpdate:
    return StreamUpdate(request_id, index, completion.token_ids, completion.text, completion)
