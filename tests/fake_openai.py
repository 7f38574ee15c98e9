"""A fake OpenAI-compatible (vLLM-like) server for tests: ``POST /v1/completions`` (stream
or not, ``n``, ``stop``, ``logprobs`` for a judge) and vLLM's ``POST /pooling`` for a
Qwen2.5-Math-PRM-style model (one ``[P(neg), P(pos)]`` row per ``<extra_0>`` tag). A closed
connection aborts the request, as vLLM does; ``live`` counts running requests."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import Any

from fake_sglang import MiniHTTPServer, Request

__all__ = ["FakeOpenAI"]


@dataclass
class FakeOpenAI(MiniHTTPServer):
    token_delay_s: float = 0.0
    tokens: int = 4
    hang: bool = False
    faults: list[str] = field(default_factory=list)
    live: set[int] = field(default_factory=set)
    aborted: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    metrics: str = ""  # vLLM's Prometheus page on GET /metrics

    def __post_init__(self) -> None:
        MiniHTTPServer.__init__(self)
        self._next = 0

    async def handle(self, req: Request) -> bool:
        fault = self.faults.pop(0) if self.faults else None
        if fault == "refuse":
            return False
        if fault in ("500", "503"):
            return await self.reply(req, int(fault), {"error": {"message": "injected"}})
        if req.path == "/metrics":
            data = self.metrics.encode()
            head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
            head += f"Content-Length: {len(data)}\r\n\r\n"
            req.writer.write(head.encode() + data)
            await req.writer.drain()
            return True
        if req.path == "/pooling":
            return await self.pooling(req)
        if req.path == "/v1/completions":
            self.bodies.append(req.body)
            if req.body.get("logprobs"):
                return await self.judge(req)
            if fault == "cut":  # one chunk of a stream, then the connection drops
                await self.start_stream(req)
                await self.chunk(req, b'data: {"choices": [{"index": 0, "text": "cut "}]}\n\n')
                return False
            return await self.complete(req)
        return await self.reply(req, 404, {"error": {"message": "no such route"}})

    async def pooling(self, req: Request) -> bool:
        inputs = req.body["input"]
        inputs = [inputs] if isinstance(inputs, str) else inputs
        data = []
        for i, text in enumerate(inputs):
            steps = text.split("<extra_0>")[:-1]
            rows = [[0.1, 0.9] if "good" in s else [0.7, 0.3] for s in steps]
            data.append({"index": i, "object": "pooling", "data": rows})
        return await self.reply(req, 200, {"object": "list", "data": data, "usage": {}})

    async def judge(self, req: Request) -> bool:
        prompts = req.body["prompt"]
        prompts = [prompts] if isinstance(prompts, str) else prompts
        choices = []
        for i, p in enumerate(prompts):
            last = p.rsplit("\n", 2)[-2] if "\n" in p else p
            yes = 0.8 if "good" in last else 0.25
            top = {" Yes": math.log(yes), " No": math.log(1 - yes)}
            choices.append(
                {
                    "index": i,
                    "text": " Yes",
                    "finish_reason": "length",
                    "logprobs": {"top_logprobs": [top]},
                }
            )
        return await self.reply(req, 200, {"choices": choices, "usage": {"prompt_tokens": 3}})

    async def complete(self, req: Request) -> bool:
        body = req.body
        n, want = int(body.get("n", 1)), min(self.tokens, int(body.get("max_tokens", 16)))
        ident = self._next = self._next + 1
        self.live.add(ident)
        made = 0
        try:
            if body.get("stream"):
                await self.start_stream(req)
            while made < want or self.hang:
                if req.reader.at_eof():  # client closed: abort
                    self.aborted += 1
                    return False
                await asyncio.sleep(max(self.token_delay_s, 0.005 if self.hang else 0.0))
                if made < want:
                    made += 1
                if body.get("stream") and made <= want:
                    choices = [
                        {"index": i, "text": f"t{i}.{made - 1} ", "finish_reason": None}
                        for i in range(n)
                    ]
                    await self.chunk(
                        req, b"data: " + json.dumps({"choices": choices}).encode() + b"\n\n"
                    )
                    if self.hang:
                        made = want + 1  # stop emitting; keep the request alive
            reason = "length" if want < self.tokens else "stop"
            if body.get("stream"):
                final = {
                    "choices": [
                        {"index": i, "text": "", "finish_reason": reason} for i in range(n)
                    ],
                    "usage": {"prompt_tokens": 3},
                }
                await self.chunk(req, b"data: " + json.dumps(final).encode() + b"\n\n")
                await self.chunk(req, b"data: [DONE]\n\n")
                await self.end_stream(req)
                return True
            text = [("".join(f"t{i}.{k} " for k in range(made))) for i in range(n)]
            return await self.reply(
                req,
                200,
                {
                    "choices": [
                        {"index": i, "text": text[i], "finish_reason": reason} for i in range(n)
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": made * n},
                },
            )
        finally:
            self.live.discard(ident)
