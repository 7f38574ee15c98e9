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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from spec_tot.adapters.http import (
    Endpoint,
    EndpointPool,
    query_key,
    split_http_options,
    sse_events,
)
from spec_tot.backends import GenerationBackend, RewardBackend, matches_prefix
from spec_tot.errors import BackendError
from spec_tot.requests import (
    Capabilities,
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RewardItem,
    TokenLogprob,
)

from .chat import ServedChat
from .config import DEFAULT_URLS, OpenAIConfig
from .logprobs import logprobs_asked, parse_logprobs
from .protocol import OPENAI_WIRE, parse_vllm_speculation
from .rewards import OpenAIScorer

__all__ = ["OpenAICompatBackend", "create_openai"]


@dataclass(eq=False)
class _Run:
    request: GenerateRequest
    texts: dict[int, str] = field(default_factory=dict)
    chunks: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, FinishReason] = field(default_factory=dict)
    logprobs: dict[int, tuple[TokenLogprob, ...]] = field(default_factory=dict)
    prompt_tokens: int = 0
    aborted: bool = False
    task: asyncio.Task[None] | None = None

    def reset(self) -> None:
        """Forget a cut-off attempt's output."""
        for part in (self.texts, self.chunks, self.reasons, self.logprobs):
            part.clear()

    def result(self) -> GenerateResult:
        comps = []
        for i in range(self.request.n):
            text = self.texts.get(i, "")
            reason = FinishReason.ABORT if self.aborted else self.reasons.get(i, FinishReason.STOP)
            tokens = self.chunks.get(i) or max(1, len(text) // 4) if text else 0
            comps.append(
                Completion(
                    text, num_tokens=tokens, finish_reason=reason, logprobs=self.logprobs.get(i, ())
                )
            )
        return GenerateResult(self.request.request_id, tuple(comps), self.prompt_tokens)


class OpenAICompatBackend(GenerationBackend, RewardBackend):
    def __init__(self, config: OpenAIConfig, pool: EndpointPool | None = None) -> None:
        self.config = config
        self.pool = pool or EndpointPool(list(config.urls), config.http, protocol=OPENAI_WIRE)
        self.scorer = OpenAIScorer(self.pool, config)
        self._runs: dict[str, _Run] = {}
        self.chat = ServedChat(self.pool, config.model, config.tokenizer)

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer from the ``tokenizer`` folder, None without one."""
        return self.chat.tokenizer

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Chat messages as one prompt in the served model's chat template (``chat.py``)."""
        return self.chat.render(messages)

    async def start(self) -> None:
        await self.chat.learn()
        self.pool.follow_load()

    def reported_load(self) -> float | None:
        """Every client's running + waiting requests as the servers publish them (vLLM's
        ``/metrics``), summed over workers: the dispatcher's committed load."""
        return self.pool.reported_load()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            prefix_abort=True,  # done here, by closing each matching connection
            prefix_cache=True,
            streaming=self.config.stream,
            saturation_batch=self.config.saturation_batch,
            max_running_requests=self.config.max_running_requests * len(self.pool.urls),
            name="openai",
            row_cost_known=self.config.row_cost_known,
        )

    @property
    def num_inflight(self) -> int:
        return len(self._runs)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.request_id in self._runs:
            raise BackendError("openai", f"duplicate in-flight request id {request.request_id!r}")
        self.pool.follow_load()  # the dispatcher's load, from the first request on
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
            "stream": self._streams(request),
        }
        if body["stream"]:  # the prompt's token count comes in a last usage chunk
            body["stream_options"] = {"include_usage": True}
        asked = logprobs_asked(s, self.tokenizer)
        if asked is not None:
            body["logprobs"] = asked
        if s.stop:
            body["stop"] = list(s.stop)
        if s.seed is not None and self.config.forward_seed:
            body["seed"] = s.seed
        if s.top_k != -1:
            body["top_k"] = s.top_k  # vLLM / SGLang extension
        if s.stop_token_ids:
            body["stop_token_ids"] = list(s.stop_token_ids)  # vLLM / SGLang extension
        return body

    def _streams(self, request: GenerateRequest) -> bool:
        # logprobs come whole in one reply (a judge's one token needs no stream)
        return self.config.stream and not request.sampling.wants_logprobs

    def _take(self, run: _Run, payload: dict[str, Any], delta: bool) -> None:
        for choice in payload.get("choices") or []:
            i = int(choice.get("index", 0))
            text = str(choice.get("text") or "")
            if not delta and choice.get("logprobs"):
                sampling = run.request.sampling
                run.logprobs[i] = parse_logprobs(choice["logprobs"], sampling, self.tokenizer)
            run.texts[i] = run.texts.get(i, "") + text if delta else text
            if delta and text:
                run.chunks[i] = run.chunks.get(i, 0) + 1  # vLLM streams about a token a chunk
            if choice.get("finish_reason"):
                run.reasons[i] = FinishReason.from_wire(choice["finish_reason"])
        usage = payload.get("usage") or {}
        run.prompt_tokens = int(usage.get("prompt_tokens") or run.prompt_tokens)

    async def _call(self, run: _Run) -> None:
        """One generation. A reply cut by the connection is sent once more (the pool's
        ``resend_cut``: sampling keeps no state on the server, so a second try is a fresh
        one and the cut text is dropped)."""
        body = self._body(run.request)
        loop = asyncio.get_running_loop()
        started = loop.time()

        def note(_url: str) -> None:
            nonlocal started
            started = loop.time()

        async def consume(ep: Endpoint, response: httpx.Response) -> None:
            run.reset()  # a resent reply starts over
            where = ep.url + "/v1/completions"
            if body["stream"]:
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

        key = query_key(run.request.request_id)
        await self.pool.call("POST", "/v1/completions", body, consume, resend_cut=True,
                             key=key, on_attempt=note)  # fmt: skip

    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        return await self.scorer.score(items)


def create_openai(urls: Sequence[str] | None = None, **options: Any) -> OpenAICompatBackend:
    """The backend for the servers at ``urls`` (``OpenAIConfig``'s and ``HttpConfig``'s
    fields as keywords)."""
    http = split_http_options(options)
    chosen = tuple(urls) if urls else DEFAULT_URLS
    return OpenAICompatBackend(OpenAIConfig(urls=chosen, http=http, **options))
