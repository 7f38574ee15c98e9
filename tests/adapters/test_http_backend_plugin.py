"""A new HTTP backend from public names, registered once, checked and run by the CLI."""

import asyncio
import json
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from spec_tot import backends as bk
from spec_tot import requests as rq
from spec_tot.adapters.http import EndpointPool, HttpConfig, WireProtocol, split_http_options
from spec_tot.cli import run_cli
from spec_tot.errors import BackendTimeoutError

# POST /complete {prompt, n, limit} -> {texts, used}; POST /score {texts} -> {scores}
TOY_WIRE = WireProtocol(lambda body: body.get("limit"), lambda reply: reply.get("used"))


class Server(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        threading.Event().wait(0.5 if body.get("prompt") == "slow" else 0.0)
        n, k = body.get("n", 0), len(body.get("texts", ()))
        data = json.dumps({"texts": ["answer: 24"] * n, "used": 3, "scores": [0.9] * k}).encode()
        self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))


class ToyBackend(bk.GenerationBackend, bk.RewardBackend):
    capabilities = rq.Capabilities(name="toy")
    num_inflight = property(lambda self: len(self.running))

    def __init__(self, urls: tuple[str, ...] = (), **http: object) -> None:
        self.pool = EndpointPool(list(urls), split_http_options(http), protocol=TOY_WIRE)
        self.running: dict[str, asyncio.Task[object]] = {}

    async def generate(self, request: rq.GenerateRequest) -> rq.GenerateResult:
        body = {"prompt": request.prompt, "n": request.n, "limit": request.sampling.max_tokens}
        self.running[rid := request.request_id] = asyncio.current_task()  # type: ignore[assignment]
        try:  # abort() cancels the call: the pool closes its connection
            _, got = await self.pool.json("POST", "/complete", body, key=rid.split("/")[0])
        finally:
            del self.running[rid]
        return rq.GenerateResult(rid, tuple(rq.Completion(t, num_tokens=3) for t in got["texts"]))

    async def abort(self, prefix: str) -> int:
        return sum(t.cancel() for r, t in self.running.items() if bk.matches_prefix(r, prefix))

    async def score(self, items: Sequence[rq.RewardItem]) -> list[tuple[float, ...]]:
        _, got = await self.pool.json("POST", "/score", {"texts": [i.text for i in items]})
        return [(s,) * len(i.steps) for s, i in zip(got["scores"], items, strict=True)]

    async def aclose(self) -> None:
        await self.pool.aclose()


@pytest.fixture
def url() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


async def test_a_new_http_backend(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    registry, dead = bk.default_registry(), "http://127.0.0.1:9"  # refused: the pool fails over
    registry.register("toy", ToyBackend, options=(ToyBackend, HttpConfig))
    run = ["run", "--program", "toy", "--backend", "toy", "--queries", "2", "--backend-opt"]
    assert await asyncio.to_thread(run_cli, [*run, "max_retries=x"], registry=registry) == 2
    assert "--backend-opt max_retries: expected an integer" in capsys.readouterr().err
    assert await asyncio.to_thread(run_cli, [*run, f"urls={url}"], registry=registry) == 0
    toy = ToyBackend((dead, url), deadline_floor_s=0.1, deadline_slack=1, assumed_s_per_token=0.01)
    slow = rq.GenerateRequest("q/a", rq.SamplingParams(max_tokens=300), prompt="slow")
    assert (await toy.generate(slow)).completions[0].text == "answer: 24"  # a 3.1 s deadline
    assert toy.pool.endpoints[dead].attempts > 0 and toy.pool.home_of("q") == url
    assert 0.1 < (toy.pool.endpoints[url].s_per_token or 0) < 0.5  # 0.5 s for the 3 tokens used
    with pytest.raises(BackendTimeoutError):  # 1 token: 0.1 s + the learned ~0.17 s < 0.5 s
        await toy.generate(rq.GenerateRequest("q/b", rq.SamplingParams(max_tokens=1), "slow"))
    await toy.aclose()
