"""One SGLang wire request: its ``/generate`` body (one prompt per sample, each with its own
rid and seed), sending it whole or streamed, and aborting its samples where it runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from spec_tot.adapters.http import EndpointPool, query_key, sse_events
from spec_tot.errors import BackendError
from spec_tot.requests import Priority
from spec_tot.seeds import sample_seed

from .config import SGLangConfig
from .groups import WireGroup

__all__ = ["abort_samples", "send_once", "send_stream", "wire_body"]

Output = tuple[dict[str, Any], list[int] | None]  # an output object, its streamed ids


def wire_body(group: WireGroup, config: SGLangConfig, info: dict[str, Any]) -> dict[str, Any]:
    """One prompt per sample, each with its own rid and seed (never ``n`` > 1: see the
    backend module's docstring); a lone sample goes as a single request. Sets ``group.rids``.
    ``info``: the server's ``/get_server_info`` (whether it takes priorities)."""
    req = group.members[0].request
    s = req.sampling
    base: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "max_new_tokens": s.max_tokens,
    }
    if s.stop:
        base["stop"] = list(s.stop)
    if s.stop_token_ids:
        base["stop_token_ids"] = list(s.stop_token_ids)
    params: list[dict[str, Any]] = []
    group.rids = []
    for m in group.members:
        seed = m.request.sampling.seed if config.forward_seed else None
        for k in range(m.request.n):
            params.append(base if seed is None else {**base, "sampling_seed": sample_seed(seed, k)})
            group.rids.append(f"{group.wire}{len(group.rids)}#")
    single = group.n == 1
    prompt: Any = list(req.prompt_ids) if req.prompt_ids is not None else req.prompt
    body: dict[str, Any] = {
        "input_ids" if req.prompt_ids is not None else "text": prompt
        if single
        else [prompt] * group.n,
        "sampling_params": params[0] if single else params,
        "rid": group.rids[0] if single else group.rids,
        "stream": config.stream,
    }
    if info.get("enable_priority_scheduling"):
        # Ours: lower runs first. SGLang's default runs *higher* values first.
        low_first = bool(info.get("schedule_low_priority_values_first"))
        body["priority"] = (
            int(req.priority) if low_first else (int(Priority.SPECULATIVE) - int(req.priority))
        )
    return body


def _route(group: WireGroup) -> str:
    return query_key(group.members[0].request.request_id)


def _where(group: WireGroup) -> Callable[[str], None]:
    def note(url: str) -> None:
        group.endpoint = url

    return note


async def send_once(pool: EndpointPool, group: WireGroup, body: dict[str, Any]) -> list[Output]:
    """Send ``body`` and read the whole reply: one output object per sample, in order."""
    async with pool.send(
        "POST", "/generate", body, key=_route(group), on_attempt=_where(group)
    ) as (endpoint, response):
        try:
            value = json.loads(await response.aread())
        except (httpx.HTTPError, ValueError) as exc:
            raise BackendError(endpoint.url + "/generate", f"bad reply: {exc!r}") from exc
    outs = value if isinstance(value, list) else [value]
    return [(o, None) for o in outs]


async def send_stream(
    pool: EndpointPool, group: WireGroup, body: dict[str, Any], incremental: bool
) -> list[Output]:
    """Send ``body`` streamed, noting each sample's progress in ``group.progress``; the last
    event of each sample (and its ids, gathered, when the server sends only new ids:
    ``incremental``, SGLang's ``--stream-output``)."""
    latest: dict[int, dict[str, Any]] = {}
    ids: dict[int, list[int]] = {}
    loop = asyncio.get_running_loop()
    started = loop.time()

    def note(url: str) -> None:
        nonlocal started
        group.endpoint, started = url, loop.time()

    async with pool.send("POST", "/generate", body, key=_route(group), on_attempt=note) as (
        endpoint,
        response,
    ):
        async for chunk in sse_events(response, endpoint.url + "/generate"):
            index = int(chunk.get("index", 0))
            latest[index] = chunk
            if incremental:
                ids.setdefault(index, []).extend(chunk.get("output_ids") or ())
            meta = chunk.get("meta_info") or {}
            group.progress[index] = int(meta.get("completion_tokens", 0))
        # The pool learns speeds from the bodies it reads; a stream it never reads.
        pool.observe(endpoint.url, max(group.progress.values(), default=0),
                     loop.time() - started)  # fmt: skip
    return [(latest[i], ids.get(i) if incremental else None) for i in sorted(latest)]


async def abort_samples(pool: EndpointPool, url: str, rids: Sequence[str]) -> None:
    """Abort each exact server rid on the worker ``url`` (best effort: a dead worker has
    nothing left to abort)."""
    results = await asyncio.gather(
        *(pool.json("POST", "/abort_request", {"rid": r}, only=url) for r in rids),
        return_exceptions=True,
    )
    del results
