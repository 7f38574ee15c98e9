"""Rewards over an OpenAI-compatible server: vLLM's ``/pooling`` (a process reward model's
step scores) or a generative judge's P(good token) on ``/v1/completions``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spec_tot.adapters.http import EndpointPool, query_key
from spec_tot.adapters.http.scoring import judge_probability, reward_texts, spread_scores
from spec_tot.errors import BackendError
from spec_tot.requests import RewardItem

from .config import OpenAIConfig

__all__ = ["OpenAIScorer"]


@dataclass(frozen=True)
class OpenAIScorer:
    """``RewardBackend.score`` for the OpenAI-compatible backend, over its pool."""

    pool: EndpointPool
    config: OpenAIConfig

    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        if not items:
            return []
        key = query_key(items[0].request_id)
        if self.config.reward == "pooling":
            return await self._pooling(items, key)
        return await self._judge(items, key)

    async def _pooling(self, items: Sequence[RewardItem], key: str) -> list[tuple[float, ...]]:
        tag = self.config.step_tag
        texts = [
            self.config.prm_template.format(
                question=item.question, steps="".join(s + tag for s in item.steps)
            )
            for item in items
        ]
        body = {"model": self.config.reward_model or self.config.model, "input": texts}
        url, value = await self.pool.json("POST", "/pooling", body, key=key)
        rows = sorted((value or {}).get("data") or [], key=lambda d: int(d.get("index", 0)))
        if len(rows) != len(items):
            raise BackendError(url + "/pooling", f"{len(rows)} results for {len(items)} inputs")
        out: list[tuple[float, ...]] = []
        for item, row in zip(items, rows, strict=True):
            steps = row.get("data") or []
            scores = tuple(float(s[-1]) if isinstance(s, list) else float(s) for s in steps)
            if len(scores) != len(item.steps):
                raise BackendError(
                    url + "/pooling",
                    f"{len(scores)} step scores for {len(item.steps)} steps "
                    f"(is the step tag {tag!r} one token?)",
                )
            out.append(scores)
        return out

    async def _judge(self, items: Sequence[RewardItem], key: str) -> list[tuple[float, ...]]:
        prompts, spans = reward_texts(items, self.config.judge_template, per_step=True)
        if not prompts:
            return [() for _ in items]
        model = self.config.reward_model or self.config.model
        body = {
            "model": model,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": 20,
            "stream": False,
        }
        url, value = await self.pool.json("POST", "/v1/completions", body, key=key)
        choices = sorted((value or {}).get("choices") or [], key=lambda c: int(c["index"]))
        if len(choices) != len(prompts):
            raise BackendError(
                url + "/v1/completions", f"{len(choices)} choices for {len(prompts)} prompts"
            )
        probs = []
        for choice in choices:
            # logprobs.top_logprobs: per output position, {token text: logprob}.
            top = ((choice.get("logprobs") or {}).get("top_logprobs") or [{}])[0] or {}
            probs.append(judge_probability(top, self.config.good_token, self.config.bad_token))
        return spread_scores(probs, spans, items, per_step=True)
