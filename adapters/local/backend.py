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

Lifecycle: the core starts on first use (``capabilities``, ``generate``, ``score``, ...).
If it dies (a crash, a kill, out of memory), every request in flight on it fails with a
``BackendError`` that says so, and the next call starts a fresh core. ``aclose`` stops it
(requests still in flight fail with "backend closed"); at interpreter exit it is stopped
too, and a core whose backend's process died exits by itself (``core_process.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
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

from .config import CoreOptions, EngineConfig, PrmConfig, resolve_device
from .delivery import Delivery
from .messages import (
    PROTOCOL,
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
    RewardInfo,
    Score,
    Start,
)
from .proc import CoreLink, ForkServer, default_threads, start_link
from .validate import RequestValidator

__all__ = ["LocalBackend"]


@dataclass(slots=True)
class _Slot:
    """One core: started on first use, started afresh after it died."""

    start: Start
    link: CoreLink | None = None
    validator: RequestValidator | None = None

    def current(self) -> CoreLink | None:
        link = self.link
        return link if link is not None and link.alive else None


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
        opts = self.options
        split = opts.process and _prm_apart(opts, engine, prm)
        threads: tuple[int | None, int | None] = (None, None)  # in-thread: the caller's own
        if opts.process:
            threads = (opts.threads,) * 2 if opts.threads else default_threads(split)

        def start(e: EngineConfig | None, p: PrmConfig | None) -> Start:
            count = threads[1] if e is None else threads[0]
            return Start(PROTOCOL, e, p, cache_dir, count, opts.hook)

        if split:
            self._policy: _Slot | None = _Slot(start(engine, None))
            self._reward: _Slot | None = _Slot(start(None, prm))
        else:
            shared = _Slot(start(engine, prm))
            self._policy = shared if engine is not None else None
            self._reward = shared if prm is not None else None
        self._slots = [s for s in {id(s): s for s in (self._policy, self._reward) if s}.values()]
        self._lock = threading.Lock()
        self._closed = False
        self._delivery = Delivery()
        self._tickets = itertools.count(1)
        self._inflight: dict[str, int] = {}
        self._tokenizers: dict[str, Any] = {}
        weakref.finalize(self, _close_all, self._slots)
        if opts.process and ForkServer.forks(opts):
            ForkServer.shared()  # warm it now: its imports overlap the caller's start-up

    # -- the core's lifecycle ---------------------------------------------------------------
    def _link(self, slot: _Slot) -> CoreLink:
        """``slot``'s running core, started now if there is none (blocking)."""
        link = slot.current()
        if link is not None:
            return link
        with self._lock:
            if self._closed:
                raise BackendError("local", "backend closed")
            link = slot.current()
            if link is None:
                link = start_link(slot.start, self.options, self._delivery.on_output, self._on_exit)
                policy = link.ready.policy
                slot.validator = _validator(policy) if policy is not None else None
                slot.link = link
                if slot is self._policy:
                    self._delivery.stats = dict(link.ready.stats)
            return link

    async def _alink(self, slot: _Slot | None, what: str) -> CoreLink:
        if slot is None or self._closed:
            raise BackendError("local", f"no {what} (closed, or not loaded)")
        link = slot.current()
        if link is None:
            link = await asyncio.to_thread(self._link, slot)
        return link

    def _on_exit(self, link: CoreLink, error: BaseException | None) -> None:
        if error is not None:
            error = BackendError(
                "local",
                f"{str(error).removeprefix('local: ')}; the requests in flight on it failed, "
                "and the next call starts a fresh engine",
            )
        self._delivery.fail_link(link, error or BackendError("local", "backend closed"))

    @property
    def engine(self) -> Any:
        """The ``LLMEngine`` itself with ``process=False`` (debugging); None in a process."""
        link = self._link(self._policy) if self._policy and not self.options.process else None
        return getattr(link, "core", None) and link.core.engine  # type: ignore[union-attr]

    @property
    def prm(self) -> Any:
        """The ``PrmScorer`` itself with ``process=False``; None in a process."""
        link = self._link(self._reward) if self._reward and not self.options.process else None
        return getattr(link, "core", None) and link.core.prm  # type: ignore[union-attr]

    @property
    def validator(self) -> RequestValidator | None:
        """The checks run here before a request is sent (None without a policy)."""
        if self._policy is None:
            return None
        self._link(self._policy)
        return self._policy.validator

    @property
    def policy(self) -> PolicyInfo | None:
        """The policy engine's limits (None without one); starts the core if needed."""
        return self._link(self._policy).ready.policy if self._policy else None

    @property
    def reward(self) -> RewardInfo | None:
        """The PRM's layout and limits (None without one); starts the core if needed."""
        return self._link(self._reward).ready.reward if self._reward else None

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer in this process (loaded on first use), None without one."""
        info = self.policy
        if info is None:
            return None
        engine = self.engine
        if engine is not None:
            return engine.tokenizer
        return self._tokenizer("policy", info.model, info.vocab_size)

    @property
    def reward_tokenizer(self) -> Any:
        info = self.reward
        if info is None:
            return None
        prm = self.prm
        return prm.tokenizer if prm is not None else self._tokenizer("prm", info.folder, 0)

    def render_chat(self, messages: Seq[Any]) -> str:
        """One prompt from chat messages (``{"role", "content"}`` dicts or LangChain
        messages) with the model's own chat template, its generation prompt appended;
        ``role: content`` lines when the model has no template. Give it as ``ChatSpecTot``'s
        ``to_prompt`` for an instruction-tuned model."""
        plain = [_role_content(m) for m in messages]
        tokenizer = self.tokenizer
        if getattr(tokenizer, "chat_template", None):
            return str(
                tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
            )
        return "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"

    def _tokenizer(self, role: str, folder: str | None, vocab_size: int) -> Any:
        tok = self._tokenizers.get(role)
        if tok is None:
            if folder is None:
                from .synthetic import PseudoTokenizer

                tok = PseudoTokenizer(vocab_size)
            else:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            self._tokenizers[role] = tok
        return tok

    async def check_health(self, timeout: float = 10.0) -> int:
        """Ping every core (starting any that is not running); the policy core's pid.
        A core that does not answer within ``timeout`` seconds is a ``BackendError``."""
        pid = 0
        for slot in self._slots:
            link = await self._alink(slot, "engine")
            try:
                pong = await asyncio.wait_for(self._call(link, Ping), timeout)
            except TimeoutError:
                raise BackendError("local", f"the engine (pid {link.pid}) did not answer") from None
            pid = pid or pong.pid
        return pid

    async def pool_report(self) -> PoolReport:
        """Where the KV blocks are, after every command sent before this call."""
        slot = self._policy or self._reward
        link = await self._alink(slot, "engine")
        pong = await self._call(link, Inspect)
        return pong.report  # type: ignore[no-any-return]

    # -- contract ---------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """``saturation_batch`` and the reward knee as measured (see ``calibrate.py``);
        ``extra`` adds the KV pool size and ``step_s_b{n}``, the measured full step time
        (seconds) at decode batch ``n``."""
        ready = self._link(self._policy).ready if self._policy else None
        knee = self._link(self._reward).ready.reward_knee if self._reward else None
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

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def running(self) -> bool:
        """Whether a core is up now (none before first use, after a crash, after close)."""
        return any(slot.current() is not None for slot in self._slots)

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
        link = await self._alink(self._policy, "policy engine")
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
        link = await self._alink(self._policy, "policy engine")
        ticket = self._admit(request, link)
        updates: asyncio.Queue[Any] = asyncio.Queue()
        self._delivery.expect(ticket, link, asyncio.get_running_loop(), updates)
        open_samples = set(range(request.n))
        try:
            if not link.send(Add(ticket, request, stream=True)):
                self._delivery.fail(ticket, BackendError("local", "the engine is gone"))
            while open_samples:
                item = await updates.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, StreamUpdate):
                    if item.index in open_samples:
                        if item.finished:
                            open_samples.discard(item.index)
                        yield item
                    continue
                for index, completion in enumerate(item.completions):  # aborted: the rest
                    if index in open_samples:
                        open_samples.discard(index)
                        yield _final_update(item.request_id, index, completion)
                open_samples.clear()
        finally:
            if open_samples:
                link.send(Cancel(request.request_id))
            self._inflight.pop(request.request_id, None)
            self._delivery.forget(ticket)

    async def abort(self, prefix: str) -> int:
        link = self._policy.current() if self._policy and not self._closed else None
        if link is None:  # no core running: nothing in flight
            return 0
        return int((await self._call(link, lambda call: Abort(call, prefix))).value or 0)

    async def flush(self) -> None:
        """Wait until the core has handled every command sent before this call."""
        link = self._policy.current() if self._policy and not self._closed else None
        if link is not None:
            await self._call(link, Flush)

    async def flush_prefix_cache(self) -> bool:
        """Drop the engine's prefix cache while it is idle; False (nothing done) while
        requests run or wait."""
        if self._policy is None or self._closed:
            return False
        link = await self._alink(self._policy, "policy engine")
        return bool((await self._call(link, FlushPrefixCache)).value)

    def count_tokens(self, text: str) -> int:
        tokenizer = self.tokenizer
        if tokenizer is None:
            return max(1, len(text) // 4)
        return max(1, len(tokenizer.encode(text)))

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
        link = await self._alink(self._reward, "PRM (pass prm_path)")
        reply = await self._call(link, lambda call: Score(call, list(items)))
        return [tuple(s) for s in reply.scores]

    async def classify(self, texts: Seq[str | Seq[int]]) -> list[float]:
        """The PRM's reward of each raw text (``PrmScorer.classify``)."""
        link = await self._alink(self._reward, "PRM (pass prm_path)")
        rows = [t if isinstance(t, str) else list(t) for t in texts]
        reply = await self._call(link, lambda call: Classify(call, rows))
        return list(reply.rewards)

    async def aclose(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
        await asyncio.to_thread(_close_all, self._slots)

    async def _call(self, link: CoreLink, make: Any) -> Any:
        """Send the command ``make(call_id)`` and await its answer (an error raises)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        call = self._delivery.expect_call(link, loop, fut)
        if not link.send(make(call)):
            self._delivery.fail_call(call, BackendError("local", "the engine is gone"))
        return await fut


def _validator(info: PolicyInfo) -> RequestValidator:
    return RequestValidator(
        None, info.vocab_size, info.max_len, info.max_num_seqs, info.max_prompt_chars
    )


def _close_all(slots: list[_Slot]) -> None:
    for slot in slots:
        link = slot.link
        if link is not None and link.alive:
            link.close()


_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


def _role_content(message: Any) -> dict[str, str]:
    if isinstance(message, dict):
        return {"role": str(message["role"]), "content": str(message.get("content") or "")}
    role = _ROLES.get(getattr(message, "type", ""), "user")
    return {"role": role, "content": str(getattr(message, "content", ""))}


def _final_update(request_id: str, index: int, completion: Completion) -> StreamUpdate:
    return StreamUpdate(request_id, index, completion.token_ids, completion.text, completion)


def _prm_apart(opts: CoreOptions, engine: EngineConfig | None, prm: PrmConfig | None) -> bool:
    """Whether the PRM gets a core process of its own (``CoreOptions.prm_process``; None:
    yes on CPU, no when either model runs on CUDA)."""
    if engine is None or prm is None:
        return False
    if opts.prm_process is not None:
        return opts.prm_process
    return not any(resolve_device(c.device).startswith("cuda") for c in (engine, prm))
