"""A fake SGLang server on ``asyncio.start_server`` (127.0.0.1, random port) for tests.

It behaves as SGLang 0.5.23 does (``tokenizer_manager.py``, ``io_struct.py``): ``POST
/generate`` takes text or input_ids (one prompt or a batch), sampling_params (one dict or one
per prompt) with n / max_new_tokens / stop, rid (one, or one per prompt), stream,
return_logprob + token_ids_logprob. A batch answers a list in order; a batch with one string
rid expands it to ``f"{rid}_{i}"``; parallel samples (n > 1) get *fresh* uuid rids and the
request's own rid is not live (``regenerate_rid()``). SSE streaming (``data: {...}\\n\\n`` ...
``data: [DONE]\\n\\n``) with cumulative text and ``index`` for a batch. ``POST
/abort_request``: an rid that is not exactly live is silently ignored; a live one aborts every
live rid *starting with* it, as SGLang's scheduler does. ``GET /health``, ``GET
/get_server_info``, ``GET /v1/loads`` and ``POST /classify``. A client disconnect aborts the
request, as SGLang does.

Fault injection (``faults``, consumed one per /generate or /classify call): ``"refuse"``
(close the connection before any byte), ``"500"``, ``"503"``, ``"slow"`` (wait
``slow_s`` before answering), ``"drop"`` (stream a few chunks, then cut the connection).
``live`` counts requests being generated; ``attempts`` counts calls per path.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FakeSGLang", "MiniHTTPServer", "Request"]


@dataclass
class Request:
    method: str
    path: str
    body: Any
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


class MiniHTTPServer:
    """Just enough HTTP/1.1: keep-alive, Content-Length bodies, chunked streaming replies."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self.attempts: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> MiniHTTPServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for writer in list(self._writers):  # EOF ends each handler on its own
                writer.close()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=1.0)
            await self.server.wait_closed()
            self.server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = h.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                size = int(headers.get("content-length", "0"))
                raw = await reader.readexactly(size) if size else b""
                body = json.loads(raw) if raw else None
                self.attempts[path] += 1
                keep = await self.handle(Request(method, path, body, reader, writer))
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.close()

    async def handle(self, req: Request) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    @staticmethod
    async def reply(req: Request, status: int, payload: Any) -> bool:
        data = b"" if payload is None else json.dumps(payload).encode()
        head = (
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        req.writer.write(head.encode() + data)
        await req.writer.drain()
        return True

    @staticmethod
    async def start_stream(req: Request) -> None:
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        req.writer.write(head.encode())
        await req.writer.drain()

    @staticmethod
    async def chunk(req: Request, data: bytes) -> None:
        req.writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await req.writer.drain()

    @staticmethod
    async def end_stream(req: Request) -> None:
        req.writer.write(b"0\r\n\r\n")
        await req.writer.drain()


@dataclass
class FakeSGLang(MiniHTTPServer):
    token_delay_s: float = 0.0
    tokens: int = 4  # generated per sample unless max_new_tokens is smaller
    hang: bool = False  # generate until aborted
    slow_s: float = 0.5
    max_running_requests: int = 48
    priority_scheduling: bool = True
    faults: list[str] = field(default_factory=list)
    live: dict[str, asyncio.Event] = field(default_factory=dict)
    max_live: int = 0
    waiting: int = 0  # reported on /v1/loads beside the live requests
    aborted: list[str] = field(default_factory=list)
    abort_calls: list[str] = field(default_factory=list)
    generate_bodies: list[dict[str, Any]] = field(default_factory=list)
    spec_meta: dict[str, Any] = field(default_factory=dict)  # speculative decoding's meta_info

    def __post_init__(self) -> None:
        MiniHTTPServer.__init__(self)

    async def handle(self, req: Request) -> bool:
        if req.path == "/health":
            return await self.reply(req, 200, None)
        if req.path.startswith("/v1/loads"):
            running = len(self.live)
            return await self.reply(
                req,
                200,
                {
                    "loads": [
                        {
                            "dp_rank": 0,
                            "num_running_reqs": running,
                            "num_waiting_reqs": self.waiting,
                        }
                    ]
                },
            )
        if req.path == "/get_server_info":
            return await self.reply(
                req,
                200,
                {
                    "max_running_requests": self.max_running_requests,
                    "max_total_num_tokens": 20480,
                    "enable_priority_scheduling": self.priority_scheduling,
                    "schedule_low_priority_values_first": False,
                    "stream_output": False,
                    "version": "fake",
                },
            )
        if req.path == "/abort_request":
            return await self.abort(req)
        fault = self.faults.pop(0) if self.faults and req.path != "/abort_request" else None
        if fault == "refuse":
            return False  # closes without a byte
        if fault in ("500", "503"):
            return await self.reply(req, int(fault), {"error": {"message": "injected"}})
        if fault == "slow":
            await asyncio.sleep(self.slow_s)
        if req.path == "/classify":
            texts = req.body["text"]
            texts = [texts] if isinstance(texts, str) else texts
            return await self.reply(
                req,
                200,
                [
                    {"embedding": [self.logit(t)], "meta_info": {"id": str(i)}}
                    for i, t in enumerate(texts)
                ],
            )
        if req.path == "/generate":
            return await self.generate(req, drop=fault == "drop")
        return await self.reply(req, 404, {"error": {"message": "no such route"}})

    @staticmethod
    def logit(text: str) -> float:
        return 2.0 if "good" in text else -2.0

    async def abort(self, req: Request) -> bool:
        rid = req.body.get("rid", "")
        self.abort_calls.append(rid)
        if req.body.get("abort_all"):
            hit = list(self.live)
        elif rid and rid in self.live:  # the tokenizer manager only knows exact rids
            hit = [r for r in self.live if r.startswith(rid)]  # the scheduler matches prefixes
        else:
            hit = []
        for r in hit:  # an aborted sample ends now, even while its batch runs on
            self.live.pop(r).set()
            self.aborted.append(r)
        return await self.reply(req, 200, None)

    async def generate(self, req: Request, drop: bool) -> bool:
        body = req.body
        self.generate_bodies.append(body)
        texts, ids = body.get("text"), body.get("input_ids")
        batch = isinstance(texts, list) or (
            isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        )
        prompts: list[Any] = (texts if texts is not None else ids) if batch else [texts or ids]
        given = body.get("sampling_params") or {}
        plist = given if isinstance(given, list) else [given] * len(prompts)
        n = int(plist[0].get("n", 1))
        rid = body.get("rid")
        if n > 1:  # parallel samples: fresh rids, the request's own rid is dropped
            rids = [uuid.uuid4().hex for _ in range(len(prompts) * n)]
        elif isinstance(rid, list):
            rids = list(rid)
        elif batch:
            rids = (
                [f"{rid}_{i}" for i in range(len(prompts))]
                if rid
                else [uuid.uuid4().hex for _ in prompts]
            )
        else:
            rids = [rid or uuid.uuid4().hex]
        if len(rids) != len(prompts) * n:
            return await self.reply(req, 400, {"error": {"message": "rid length mismatch"}})
        batch = batch or n > 1
        samples = [(rids[k], plist[k // n], prompts[k // n]) for k in range(len(rids))]
        events = {r: asyncio.Event() for r in rids}
        self.live.update(events)
        self.max_live = max(self.max_live, len(self.live))
        wants = {r: min(self.tokens, int(p.get("max_new_tokens", 128))) for r, p, _ in samples}
        want = max(wants.values())
        stream = bool(body.get("stream"))
        made = dict.fromkeys(rids, 0)
        try:
            if stream:
                await self.start_stream(req)
            steps = 0
            while steps < want or self.hang:
                # The client sends nothing while it waits: EOF means it went away.
                if all(e.is_set() for e in events.values()) or req.reader.at_eof():
                    break
                await asyncio.sleep(max(self.token_delay_s, 0.005 if self.hang else 0.0))
                steps += 1
                for r in rids:
                    if not events[r].is_set() and steps <= wants[r]:
                        made[r] = steps
                if stream:
                    for i, (r, p, prompt) in enumerate(samples):
                        out = self.output(r, i, made[r], wants[r], events[r], p, body, prompt)
                        if batch:
                            out["index"] = i
                        await self.chunk(req, b"data: " + json.dumps(out).encode() + b"\n\n")
                    if drop and steps >= 2:
                        return False
            if req.reader.at_eof():
                for e in events.values():
                    e.set()
                return False
            outs = [
                self.output(r, i, made[r], wants[r], events[r], p, body, prompt)
                for i, (r, p, prompt) in enumerate(samples)
            ]
            if stream:
                for i, out in enumerate(outs):
                    if batch:
                        out["index"] = i
                    await self.chunk(req, b"data: " + json.dumps(out).encode() + b"\n\n")
                await self.chunk(req, b"data: [DONE]\n\n")
                await self.end_stream(req)
                return True
            return await self.reply(req, 200, outs if batch else outs[0])
        finally:
            for r in rids:
                if self.live.pop(r, None) is not None and events[r].is_set():
                    self.aborted.append(r)

    def output(
        self,
        rid: str,
        index: int,
        made: int,
        want: int,
        aborted: asyncio.Event,
        params: dict[str, Any],
        body: dict[str, Any],
        prompt: Any,
    ) -> dict[str, Any]:
        text = "".join(f"t{index}.{k} " for k in range(made))
        if aborted.is_set():
            reason: dict[str, Any] = {"type": "abort", "message": "Abort request"}
        elif made >= want and want < self.tokens:
            reason = {"type": "length", "length": made}
        else:
            stop = params.get("stop") or []
            reason = {"type": "stop", "matched": stop[0] if stop else 2}
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": 5,
            "completion_tokens": made,
            "cached_tokens": 0,
            **self.spec_meta,
        }
        if body.get("return_logprob"):
            last = str(prompt).rsplit("\n", 1)[0].rsplit("\n", 1)[-1]  # the judged step
            p_good = 0.9 if "good" in last else 0.2
            ids = body.get("token_ids_logprob") or [7]
            meta["output_token_ids_logprobs"] = [
                [
                    [math.log(p_good if j == 0 else 1 - p_good), tid, None]
                    for j, tid in enumerate(ids)
                ]
            ]
        return {"text": text, "output_ids": list(range(made)), "meta_info": meta}
