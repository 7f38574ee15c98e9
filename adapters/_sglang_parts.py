"""Pieces of the SGLang backend kept apart to keep ``sglang.py`` readable: output
parsing, the merged-request bookkeeping, and reward scoring over ``/classify`` or a
generative judge on ``/generate``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spec_tot.errors import BackendError
from spec_tot.requests import Completion, FinishReason, GenerateRequest, GenerateResult, RewardItem

from ._common import judge_probability, reward_texts, sigmoid, spread_scores
from ._http import EndpointPool, query_key

__all__ = ["Member", "SGLangLoads", "SGLangRewards", "WireGroup", "parse_output"]

_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def parse_output(out: dict[str, Any], ids: Sequence[int] | None = None) -> Completion:
    """One SGLang output object -> Completion (``ids`` overrides incremental stream ids)."""
    meta = out.get("meta_info") or {}
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    token_ids = tuple(ids if ids is not None else out.get("output_ids") or ())
    return Completion(
        text=str(out.get("text", "")),
        token_ids=token_ids,
        num_tokens=int(meta.get("completion_tokens", len(token_ids))),
        finish_reason=_REASONS.get(str(kind), FinishReason.STOP),
    )


@dataclass(eq=False)
class Member:
    """One caller's request inside a wire request."""

    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    offset: int = 0
    aborted: bool = False


@dataclass(eq=False)
class WireGroup:
    """One wire request: identical pending requests merged into one with n = sum of n."""

    key: Any
    wire: str
    members: list[Member] = field(default_factory=list)
    n: int = 0
    endpoint: str | None = None
    task: asyncio.Task[None] | None = None
    open: bool = True
    aborted: bool = False
    progress: dict[int, int] = field(default_factory=dict)  # sample -> tokens so far
    rids: list[str] = field(default_factory=list)  # one server rid per sample, once sent

    def live(self) -> list[Member]:
        return [m for m in self.members if not m.future.done()]

    def sample_rids(self, members: Sequence[Member] | None = None) -> list[str]:
        """The server rids of these members' samples (all samples by default)."""
        if members is None:
            return list(self.rids)
        return [r for m in members for r in self.rids[m.offset : m.offset + m.request.n]]


class SGLangRewards:
    """``RewardBackend.score`` for SGLang; the backend supplies ``pool`` and ``config``."""

    pool: EndpointPool
    config: Any

    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        if not items:
            return []
        judge = self.config.reward == "generative"
        per_step = judge or self.config.reward_per_step
        suffix = self.config.judge_suffix if judge else ""
        texts, spans = reward_texts(items, self.config.reward_template, per_step, suffix)
        key = query_key(items[0].request_id)
        values = await (self._judge(texts, key) if judge else self._classify(texts, key))
        return spread_scores(values, spans, items, per_step)

    async def _classify(self, texts: list[str], key: str) -> list[float]:
        url, value = await self.pool.json("POST", "/classify", {"text": texts}, key=key)
        rows = value if isinstance(value, list) else [value]
        if len(rows) != len(texts):
            raise BackendError(url + "/classify", f"{len(rows)} rewards for {len(texts)} texts")
        raw = [float(r["embedding"][0]) for r in rows]  # a reward head's raw logit
        if self.config.reward_sigmoid:
            return [sigmoid(v) for v in raw]
        return [min(1.0, max(0.0, v)) for v in raw]

    async def _judge(self, texts: list[str], key: str) -> list[float]:
        good, bad = self.config.good_token_id, self.config.bad_token_id
        body = {
            "text": texts,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "token_ids_logprob": [t for t in (good, bad) if t is not None],
        }
        url, value = await self.pool.json("POST", "/generate", body, key=key)
        rows = value if isinstance(value, list) else [value]
        if len(rows) != len(texts):
            raise BackendError(url + "/generate", f"{len(rows)} outputs for {len(texts)} texts")
        scores = []
        for row in rows:
            # meta_info.output_token_ids_logprobs: per output position, [logprob, id, text].
            first = (row.get("meta_info") or {}).get("output_token_ids_logprobs") or [[]]
            logprobs = {int(e[1]): float(e[0]) for e in first[0] or []}
            scores.append(judge_probability(logprobs, good, bad))
        return scores


class SGLangLoads:
    """``reported_load`` for SGLang: ``GET /v1/loads?include=core`` (SGLang 0.5.10 to 0.5.23:
    ``{"loads": [{"num_running_reqs", "num_waiting_reqs", ...}]}``, one row per DP rank) read
    from every worker in the background; the backend supplies ``pool`` and ``config``."""

    pool: EndpointPool
    config: Any
    _loads: dict[str, float]  # worker URL -> running + waiting it last reported
    _poller: asyncio.Task[None] | None

    def reported_load(self) -> float | None:
        """Running + waiting requests the workers last reported on ``/v1/loads`` (every
        client's), summed; None until a worker has answered."""
        return sum(self._loads.values()) if self._loads else None

    def _start_polling(self) -> None:
        if self._poller is None and self.config.load_poll_s > 0:
            self._poller = asyncio.create_task(self._poll_loads())

    async def _poll_loads(self) -> None:
        while True:
            for url in self.pool.urls:
                try:
                    _, value = await self.pool.json("GET", "/v1/loads?include=core", only=url)
                    loads = value.get("loads") if isinstance(value, dict) else None
                    self._loads[url] = float(
                        sum(
                            int(d.get("num_running_reqs", 0)) + int(d.get("num_waiting_reqs", 0))
                            for d in loads or ()
                        )
                    )
                except (BackendError, AttributeError, TypeError, ValueError):
                    self._loads.pop(url, None)  # unknown now: never a stale figure
            await asyncio.sleep(self.config.load_poll_s)
