"""OpenAI-compatible completions backend (vLLM, SGLang, others), plus vLLM PRM rewards.

- Generation: ``POST /v1/completions`` with ``prompt`` (text or token ids), ``n``,
  ``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed`` and, where not default,
  vLLM's extra ``top_k`` / ``stop_token_ids``. Streaming is SSE (``data: {choices: [{index,
  text (a delta), finish_reason}]}`` ... ``data: [DONE]``). There is no abort endpoint in this
  API: an abort or a cancelled caller *closes the connection*, which vLLM turns into an abort
  of the request. Partial text seen so far is returned with ``FinishReason.ABORT``.
- Rewards, ``reward="pooling"``: vLLM ``POST /pooling`` serving Qwen2.5-Math-PRM-7B
  (``Qwen2ForProcessRewardModel``: STEP pooling at the ``<extra_0>`` tag, 2 labels, softmax).
  Each input answers one ``[P(negative), P(positive)]`` row per step tag; the step score is
  P(positive). ``reward="generative"``: one greedy token with ``logprobs`` and the score is
  P(good token) (normalised against the bad token when one is given).
- Speculative decoding: the completions protocol returns no figure about it (neither
  OpenAI's nor vLLM's or SGLang's replies carry one). vLLM publishes it on its Prometheus
  ``GET /metrics``: the counters ``vllm:spec_decode_num_drafts_total``,
  ``vllm:spec_decode_num_draft_tokens_total`` and ``vllm:spec_decode_num_accepted_tokens_total``
  (older vLLM: the same names without ``_total``). ``server_speculation()`` reads and sums
  them over the workers: server-wide and cumulative since each server started (every
  client's requests), so a caller compares two readings.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from spec_tot.backends import GenerationBackend, RewardBackend, matches_prefix
from spec_tot.errors import BackendError, ConfigError
from spec_tot.requests import (
    Capabilities,
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RewardItem,
)

from ._common import (
    judge_probability,
    reward_texts,
    spread_scores,
    sse_events,
)
from ._http import EndpointPool, HttpConfig, query_key

__all__ = [
    "QWEN_PRM_TEMPLATE",
    "OpenAICompatBackend",
    "OpenAIConfig",
    "create_openai",
    "parse_vllm_speculation",
]

# vLLM's Prometheus counter names (without the ``_total`` suffix) -> this library's stat keys
_VLLM_SPEC = {
    "vllm:spec_decode_num_drafts": "num_verify_rows",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def parse_vllm_speculation(text: str) -> dict[str, float]:
    """The speculative-decoding counters in a Prometheus text page, summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_num_"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].removesuffix("_total")
        key = _VLLM_SPEC.get(name)
        if key is None:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


_DEFAULT_URLS = ("http://127.0.0.1:8000",)
_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}

# Qwen2.5-Math-PRM's chat layout; the steps are joined and ended by the step tag.
QWEN_PRM_TEMPLATE = (
    "<|im_start|>system\nPlease reason step by step, and put your final answer within "
    "\\boxed{{}}.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
    "<|im_start|>assistant\n{steps}<|im_end|><|endoftext|>"
)


@dataclass(frozen=True, slots=True)
class OpenAIConfig:
    urls: tuple[str, ...] = _DEFAULT_URLS
    model: str = "default"
    reward_model: str | None = None  # defaults to ``model``
    stream: bool = True
    reward: str = "pooling"
    step_tag: str = "<extra_0>"
    prm_template: str = QWEN_PRM_TEMPLATE
    judge_template: str = "{question}\n{steps}\nIs the last step correct? Answer:"
    good_token: str = " Yes"
    bad_token: str | None = " No"
    max_running_requests: int = 256
    saturation_batch: int = 64
    http: HttpConfig = field(default_factory=HttpConfig)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigError("urls", "give at least one server URL")
        if self.reward not in ("pooling", "generative"):
            raise ConfigError("reward", f"must be 'pooling' or 'generative', not {self.reward!r}")


@dataclass(eq=False)
class _Run:
    request: GenerateRequest
    texts: dict[int, str] = field(default_factory=dict)
    chunks: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, FinishReason] = field(default_factory=dict)
    prompt_tokens: int = 0
    aborted: bool = False
    task: asyncio.Task[None] | None = None

    def result(self) -> GenerateResult:
        comps = []
        for i in range(self.request.n):
            text = self.texts.get(i, "")
            reason = FinishReason.ABORT if self.aborted else self.reasons.get(i, FinishReason.STOP)
            tokens = self.chunks.get(i) or max(1, len(text) // 4) if text else 0
            comps.append(Completion(text, num_tokens=tokens, finish_reason=reason))
        return GenerateResult(self.request.request_id, tuple(comps), self.prompt_tokens)


class OpenAICompatBackend(GenerationBackend, RewardBackend):
    def __init__(self, config: OpenAIConfig, pool: EndpointPool | None = None) -> None:
        self.config = config
        self.pool = pool or EndpointPool(list(config.urls), config.http)
        self._runs: dict[str, _Run] = {}

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            prefix_abort=True,  # done here, by closing each matching connection
            prefix_cache=True,
            streaming=self.config.stream,
            saturation_batch=self.config.saturation_batch,
            max_running_requests=self.config.max_running_requests * len(self.pool.urls),
            name="openai",
        )

    @property
    def num_inflight(self) -> int:
        return len(self._runs)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.request_id in self._runs:
            raise BackendError("openai", f"duplicate in-flight request id {request.request_id!r}")
        run = _Run(request)
        self._runs[request.request_id] = run
        run.task = asyncio.create_task(self._call(run))
        try:
            await run.task  # a cancelled caller cancels this too: the connection closes
            return run.result()
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if run.aborted and (current is None or not current.cancelling()):
                return run.result()
            raise
        finally:
            self._runs.pop(request.request_id, None)

    async def abort(self, prefix: str) -> int:
        hit = [
            r
            for rid, r in self._runs.items()
            if matches_prefix(rid, prefix)
            and not r.aborted
            and r.task is not None
            and not r.task.done()
        ]
        for run in hit:
            run.aborted = True
            assert run.task is not None
            run.task.cancel()
        return len(hit)

    async def aclose(self) -> None:
        for run in list(self._runs.values()):
            if run.task is not None:
                run.task.cancel()
        await self.pool.aclose()

    async def server_speculation(self) -> dict[str, float]:
        """vLLM's speculative-decoding counters (module docstring), summed over workers, as
        ``num_verify_rows`` (drafts), ``num_draft_tokens`` and ``num_accepted_tokens``;
        empty when no worker publishes them."""
        totals: dict[str, float] = {}
        for url in self.pool.urls:
            async with self.pool.send("GET", "/metrics", only=url, budget=1) as (_, response):
                text = (await response.aread()).decode(errors="replace")
            for key, value in parse_vllm_speculation(text).items():
                totals[key] = totals.get(key, 0.0) + value
        return totals

    def _body(self, request: GenerateRequest) -> dict[str, Any]:
        s = request.sampling
        body: dict[str, Any] = {
            "model": self.config.model,
            "prompt": list(request.prompt_ids)
            if request.prompt_ids is not None
            else request.prompt,
            "n": request.n,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stream": self.config.stream,
        }
        if s.stop:
            body["stop"] = list(s.stop)
        if s.seed is not None:
            body["seed"] = s.seed
        if s.top_k != -1:
            body["top_k"] = s.top_k  # vLLM / SGLang extension
        if s.stop_token_ids:
            body["stop_token_ids"] = list(s.stop_token_ids)  # vLLM / SGLang extension
        return body

    def _take(self, run: _Run, payload: dict[str, Any], delta: bool) -> None:
        for choice in payload.get("choices") or []:
            i = int(choice.get("index", 0))
            text = str(choice.get("text") or "")
            run.texts[i] = run.texts.get(i, "") + text if delta else text
            if delta and text:
                run.chunks[i] = run.chunks.get(i, 0) + 1  # vLLM streams about a token a chunk
            if choice.get("finish_reason"):
                run.reasons[i] = _REASONS.get(str(choice["finish_reason"]), FinishReason.STOP)
        usage = payload.get("usage") or {}
        run.prompt_tokens = int(usage.get("prompt_tokens") or run.prompt_tokens)

    async def _call(self, run: _Run) -> None:
        key = query_key(run.request.request_id)
        body = self._body(run.request)
        loop = asyncio.get_running_loop()
        started = loop.time()

        def note(_url: str) -> None:
            nonlocal started
            started = loop.time()

        async with self.pool.send("POST", "/v1/completions", body, key=key, on_attempt=note) as (
            ep,
            response,
        ):
            where = ep.url + "/v1/completions"
            if self.config.stream:
                async for chunk in sse_events(response, where):
                    self._take(run, chunk, delta=True)
                # The pool learns speeds from the bodies it reads; a stream it never reads.
                tokens = max(run.chunks.values(), default=0)
                self.pool.observe(ep.url, tokens, loop.time() - started)
                return
            try:
                self._take(run, json.loads(await response.aread()), delta=False)
            except (httpx.HTTPError, ValueError) as exc:
                raise BackendError(where, f"bad or cut reply: {exc!r}") from exc

    # -- rewards -------------------------------------------------------------------------------
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


def create_openai(urls: Sequence[str] | None = None, **options: Any) -> OpenAICompatBackend:
    http = options.pop("http", None) or HttpConfig(
        **{k: options.pop(k) for k in list(options) if k in HttpConfig.__dataclass_fields__}
    )
    chosen = tuple(urls) if urls else _DEFAULT_URLS
    return OpenAICompatBackend(OpenAIConfig(urls=chosen, http=http, **options))
