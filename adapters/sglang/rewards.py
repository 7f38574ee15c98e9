"""SGLang reward scoring: a reward model's logit over ``/classify``, or a generative judge's
P(good token) from one greedy token on ``/generate``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spec_tot.adapters.http import EndpointPool, query_key
from spec_tot.adapters.http.scoring import judge_probability, reward_texts, sigmoid, spread_scores
from spec_tot.errors import BackendError
from spec_tot.requests import RewardItem

from .config import SGLangConfig

__all__ = ["SGLangScorer"]


@dataclass(frozen=True)
class SGLangScorer:
    """``RewardBackend.score`` for SGLang, over the backend's pool."""

    pool: EndpointPool
    config: SGLangConfig

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
