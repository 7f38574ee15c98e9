"""SGLang backend: an HTTP client of SGLang's native API (no ``import sglang``).

Read against SGLang 0.5.23's source (``srt/entrypoints/http_server.py``,
``srt/managers/io_struct.py`` ``GenerateReqInput``, ``tokenizer_manager.py``
``_handle_batch_request`` / ``abort_request``, ``scheduler.py`` ``abort_request``,
``entrypoints/v1_loads.py``) and checked against 0.5.10's frontend client. What this relies on:

- ``POST /generate`` takes ``text`` or ``input_ids`` (one prompt or a list), ``sampling_params``
  (one dict, or one per prompt), ``rid`` (one string, or one per prompt), ``stream``,
  ``priority``, ``return_logprob``, ``token_ids_logprob``. One prompt answers one object
  ``{text, output_ids, meta_info}``; a list answers a list in order. Streaming is SSE,
  ``data: {...}`` with cumulative text and, for a list, ``index``; it ends ``data: [DONE]``.
- Parallel samples (``n`` > 1) get *fresh* server rids (``regenerate_rid()``) and the request's
  own rid is dropped, so they cannot be aborted by any id the client knows. So this client
  never sends n > 1: each sample is its own prompt in a batched request with its own rid
  ``{request_id}#{serial}#{k}#`` (prefix-free: ``#`` ends every rid), and its own seed
  (``sample_seed``). The radix cache still shares the prompt's KV between them.
- ``POST /abort_request {"rid"}`` is a no-op unless ``rid`` is exactly a live request id; the
  scheduler then aborts every rid that *starts with* it (a raw string prefix). So this client
  tracks its own requests and aborts each live sample's exact rid itself: cancelling a
  subtree aborts every one of its samples, n = 1 or n > 1.
- ``GET /get_server_info`` (0.5.23 also ``/server_info``) holds ``max_running_requests``,
  ``max_total_num_tokens``, ``enable_priority_scheduling`` (a ``priority`` is only sent where
  it is on) and ``schedule_low_priority_values_first``.
- ``GET /v1/loads?include=core`` (0.5.10 and later) answers ``{"loads": [{"dp_rank",
  "num_running_reqs", "num_waiting_reqs", ...}]}``: read in the background by the pool's
  one queue reader (``http/queues.py``, which prefers ``/metrics`` where the server
  publishes it) for ``reported_load`` (every client's running + waiting requests, summed
  over workers) and the deadlines.
- ``POST /classify {"text": [...]}`` (a reward model under ``--is-embedding``) answers a list
  of ``{"embedding": [reward, ...]}``; the reward is a raw logit.
- Speculative decoding (``--speculative-algorithm`` EAGLE/NGRAM/...): each output's
  ``meta_info`` carries ``spec_verify_ct`` (verify passes of that request) and, in 0.5.x
  (``TokenizerManager._calculate_spec_decoding_metrics``), ``spec_accept_token_num`` and
  ``spec_draft_token_num`` (accepted and drafted tokens; drafted = passes x the server's
  draft length) beside ``spec_accept_rate`` / ``spec_accept_length``. ``stats()`` sums
  what the server reported, under the embedded engine's keys: ``num_verify_rows`` and
  ``num_decode_rows`` from ``spec_verify_ct``, ``num_decode_tokens`` from
  ``completion_tokens`` of those outputs, ``num_draft_tokens`` / ``num_accepted_tokens`` from
  the two counts (absent where an older server sends only ``spec_verify_ct``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
from collections.abc import Sequence
from typing import Any

from spec_tot.adapters.http import EndpointPool, query_key, split_http_options
from spec_tot.backends import GenerationBackend, RewardBackend, matches_prefix
from spec_tot.errors import BackendError, BackendTimeoutError, ConfigError
from spec_tot.requests import (
    Capabilities,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RewardItem,
)

from .config import DEFAULT_URLS, SGLangConfig
from .groups import Member, WireGroup, aborted_result
from .protocol import SGLANG_WIRE, parse_output, speculation_counts
from .rewards import SGLangScorer
from .wire import abort_samples, send_once, send_stream, wire_body

__all__ = ["SGLangBackend", "create_sglang"]


class SGLangBackend(GenerationBackend, RewardBackend):
    """SGLang's native API over an ``EndpointPool`` (the module docstring: what it relies
    on). A ``pool`` given is used as is (``protocol=SGLANG_WIRE``: budgeted deadlines)."""

    def __init__(self, config: SGLangConfig, pool: EndpointPool | None = None) -> None:
        self.config = config
        self.pool = pool or EndpointPool(list(config.urls), config.http, protocol=SGLANG_WIRE)
        self.scorer = SGLangScorer(self.pool, config)
        self._info: dict[str, Any] | None = None
        self._info_fetch: asyncio.Future[tuple[str, Any]] | None = None
        self._members: dict[str, Member] = {}
        self._groups: dict[str, WireGroup] = {}
        self._collecting: dict[Any, WireGroup] = {}
        self._serial = itertools.count(1)
        self._side: set[asyncio.Task[Any]] = set()
        self.counters: dict[str, float] = {"wire_requests": 0, "merged": 0, "server_aborts": 0}

    # -- contract ----------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        info = self._info or {}
        per_worker = int(info.get("max_running_requests") or 256)
        total = per_worker * len(self.pool.urls)
        return Capabilities(
            prefix_cache=True,
            engine_dedup=self.config.dedup,
            streaming=self.config.stream,
            saturation_batch=self.config.saturation_batch or total,
            max_running_requests=total,
            name="sglang",
            row_cost_known=self.config.row_cost_known,
            extra={
                "workers": float(len(self.pool.urls)),
                "max_total_num_tokens": float(info.get("max_total_num_tokens") or 0),
            },
        )

    @property
    def num_inflight(self) -> int:
        return len(self._members)

    def stats(self) -> dict[str, float]:
        attempts = sum(e.attempts for e in self.pool.endpoints.values())
        return {**{k: float(v) for k, v in self.counters.items()}, "http_attempts": attempts}

    def reported_load(self) -> float | None:
        return self.pool.reported_load()

    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        return await self.scorer.score(items)

    def progress(self, request_id: str) -> int:
        """Tokens streamed so far for a request (streaming mode), 0 when unknown."""
        member = self._members.get(request_id)
        if member is None:
            return 0
        group = next((g for g in self._groups.values() if member in g.members), None)
        if group is None:
            return 0
        span = range(member.offset, member.offset + member.request.n)
        return max((group.progress.get(i, 0) for i in span), default=0)

    async def server_info(self) -> dict[str, Any]:
        """``/get_server_info`` of one worker, cached; capabilities are sized from it. The
        first requests of a burst share one fetch (not one each)."""
        if self._info is None:
            if self._info_fetch is None or self._info_fetch.done():
                self._info_fetch = asyncio.ensure_future(self.pool.json("GET", "/get_server_info"))
            _, info = await asyncio.shield(self._info_fetch)
            self._info = info if isinstance(info, dict) else {}
        return self._info

    async def start(self) -> None:
        """Size ``capabilities`` from the server before a run reads them; best effort: an
        unreachable server keeps the default sizes (requests fail over on their own)."""
        if self._info is None:
            try:
                await self.server_info()
            except BackendError:
                self._info = None

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.request_id in self._members:
            raise BackendError("sglang", f"duplicate in-flight request id {request.request_id!r}")
        await self.start()
        self.pool.follow_load()
        member = Member(request, asyncio.get_running_loop().create_future())
        self._members[request.request_id] = member
        self._join(member)
        try:
            return await member.future
        except asyncio.CancelledError:
            member.future.cancel()
            self._maybe_stop(member)
            raise
        finally:
            self._members.pop(request.request_id, None)

    async def abort(self, prefix: str) -> int:
        hit = [
            m
            for rid, m in self._members.items()
            if matches_prefix(rid, prefix) and not m.future.done() and not m.aborted
        ]
        for member in hit:
            member.aborted = True
        for group in {
            id(g): g for g in self._groups.values() if any(m in hit for m in g.members)
        }.values():
            if all(m.aborted or m.future.done() for m in group.members):
                group.aborted = True
                if group.endpoint is not None:  # running: the server answers with partials
                    await self._abort_on_server(group, group.sample_rids())
                elif group.task is not None:  # never sent: nothing on the server
                    group.task.cancel()
                    for m in group.live():
                        m.future.set_result(aborted_result(m.request))
            else:  # others still want this wire request: stop only these members' samples
                gone = [m for m in group.live() if m.aborted]
                for m in gone:
                    m.future.set_result(aborted_result(m.request))
                if group.endpoint is not None:
                    await self._abort_on_server(group, group.sample_rids(gone))
        return len(hit)

    async def aclose(self) -> None:
        for group in list(self._groups.values()):
            if group.task is not None:
                group.task.cancel()
        tasks: list[asyncio.Future[Any]] = [g.task for g in self._groups.values() if g.task]
        if self._info_fetch is not None:
            self._info_fetch.cancel()
            tasks.append(self._info_fetch)
        await asyncio.gather(*tasks, *self._side, return_exceptions=True)
        await self.pool.aclose()

    # -- dedup and dispatch --------------------------------------------------------------------
    def _key(self, request: GenerateRequest) -> Any:
        sampling = dataclasses.replace(request.sampling, seed=None)
        return (
            request.prompt,
            request.prompt_ids,
            sampling,
            request.priority,
            query_key(request.request_id),
        )

    def _join(self, member: Member) -> None:
        merge = self.config.dedup and member.request.dedup
        key = self._key(member.request) if merge else object()
        group = self._collecting.get(key)
        if group is None or not group.open:
            wire = f"{member.request.request_id}#{next(self._serial)}#"
            group = WireGroup(key, wire)
            self._collecting[key] = group
            self._groups[wire] = group
            group.task = asyncio.create_task(self._run(group))
            # A task cancelled before its first step never runs its finally: clean up here.
            group.task.add_done_callback(functools.partial(self._forgotten, group))
        else:
            self.counters["merged"] += 1
        member.offset = group.n
        group.n += member.request.n
        group.members.append(member)

    def _forgotten(self, group: WireGroup, _task: asyncio.Task[None]) -> None:
        self._forget(group)

    def _forget(self, group: WireGroup) -> None:
        self._groups.pop(group.wire, None)
        if self._collecting.get(group.key) is group:
            del self._collecting[group.key]
        for m in group.live():  # never answered (cancelled early): answer as aborted
            m.future.set_result(aborted_result(m.request))

    def _maybe_stop(self, member: Member) -> None:
        """A cancelled caller: stop its wire request once nobody else waits for it."""
        for group in self._groups.values():
            if member in group.members and not group.live() and group.task is not None:
                group.task.cancel()

    async def _run(self, group: WireGroup) -> None:
        try:
            if self.config.dedup_window_s > 0:
                await asyncio.sleep(self.config.dedup_window_s)
            group.open = False
            if self._collecting.get(group.key) is group:
                del self._collecting[group.key]
            if not group.live():
                return
            body = wire_body(group, self.config, self._info or {})
            self.counters["wire_requests"] += 1
            try:
                incremental = bool((self._info or {}).get("stream_output"))
                outs = await (
                    send_stream(self.pool, group, body, incremental)
                    if self.config.stream
                    else send_once(self.pool, group, body)
                )
            except asyncio.CancelledError:
                if group.endpoint is not None and not group.aborted:
                    await asyncio.shield(self._abort_in_background(group))
                raise
            except BackendError as exc:
                if isinstance(exc, BackendTimeoutError) and group.endpoint is not None:
                    self._abort_in_background(group)  # given up: the server must stop too
                for m in group.live():
                    m.future.set_exception(exc)
                return
            if len(outs) != group.n:
                err = BackendError(
                    group.endpoint or "sglang", f"expected {group.n} outputs, got {len(outs)}"
                )
                for m in group.live():
                    m.future.set_exception(err)
                return
            for out, _ in outs:
                for key, value in speculation_counts(out.get("meta_info")).items():
                    self.counters[key] = self.counters.get(key, 0) + value
            meta = outs[0][0].get("meta_info") or {} if outs else {}
            for m in group.live():
                comps = [parse_output(o, ids) for o, ids in outs[m.offset : m.offset + m.request.n]]
                if m.aborted:
                    comps = [
                        dataclasses.replace(c, finish_reason=FinishReason.ABORT) for c in comps
                    ]
                m.future.set_result(
                    GenerateResult(
                        m.request.request_id,
                        tuple(comps),
                        prompt_tokens=int(meta.get("prompt_tokens", 0)),
                        cached_prompt_tokens=int(meta.get("cached_tokens", 0)),
                    )
                )
        finally:
            self._forget(group)

    def _abort_in_background(self, group: WireGroup) -> asyncio.Task[None]:
        job = asyncio.create_task(self._abort_on_server(group, group.sample_rids()))
        self._side.add(job)
        job.add_done_callback(self._side.discard)
        return job

    async def _abort_on_server(self, group: WireGroup, rids: Sequence[str]) -> None:
        """Abort each exact server rid on the worker that holds the wire request."""
        if group.endpoint is None or not rids:
            return
        self.counters["server_aborts"] += 1
        await abort_samples(self.pool, group.endpoint, rids)


def create_sglang(
    urls: Sequence[str] | None = None, router_url: str | None = None, **options: Any
) -> SGLangBackend:
    """Workers by URL (this client routes each query to one worker), or one SGLang router
    (the router balances; aborts still go through it)."""
    if router_url is not None and urls:
        raise ConfigError("router_url", "give urls or router_url, not both")
    chosen = [router_url] if router_url is not None else list(urls or DEFAULT_URLS)
    http = split_http_options(options)
    return SGLangBackend(SGLangConfig(urls=tuple(chosen), http=http, **options))
