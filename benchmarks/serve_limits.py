"""Issue 22's heavy checks against a real ``spec-tot serve`` process (the shipped Game-of-24
policy and PRM), one server under ``ulimit -n 1024`` for them all, figures in one JSON:

- ``fuzz``: 1,500 requests over the four routes whose texts (prompts, stops, messages, rids,
  unknown keys) carry arbitrary code points (lone surrogates, noncharacters, NUL, astral),
  some with a field swapped for any JSON value, a few not UTF-8: status counts (target: no
  5xx, no dropped connection).
- ``oversize``: the issue's 220 KB body (20,000 prompts x n=128 on ``/v1/completions``) and
  its twins on ``/generate`` and ``/classify``: status, latency (target: a 400 in 100 ms),
  RSS before and after.
- ``capped``: one request at ``max_samples_per_request`` (4,096 samples), then 16 of them at
  once beside ``/health`` probes (every 50 ms, a fresh connection each) and small good
  requests (every 250 ms): statuses, peak RSS against the bound the admission rule implies
  (idle + at most 3 capped requests at once: one request takes at most half of the free
  room), probe latencies, good requests' outcomes.
- ``floods``: under ``ulimit -n 1024``, 1,500 half-open connections (half a request head)
  and 1,100 idle ones (nothing sent), with ``/health`` probes throughout: probe latencies
  (target: every one within 1 s), and when each flood connection was closed (evicted at the
  connection cap, or timed out at ``header_timeout_s``).
- ``streams``: four ``n=4096`` streams whose clients never read (the issue measured 665 MB
  of growth in 120 s): admitted or 429, RSS over time, when their samples left the engine
  (``stream_stall_s`` after they stalled) and whether every KV block came back.
- ``disconnects``: 32 clients go away mid-request; how long until ``/get_server_info``
  reports 0 running, 0 waiting, 0 KV blocks used (target: within 1 s), and what
  ``/metrics`` and ``/v1/loads`` say then.

    python benchmarks/serve_limits.py --json benchmarks/results/serve_limits.json
    python benchmarks/serve_limits.py --scenarios floods,disconnects
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

SCENARIOS = ("oversize", "fuzz", "capped", "floods", "streams", "disconnects")


JSON_TYPE = {"content-type": "application/json"}  # JSON routes require it


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _own_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on (the engine and PRM run in processes of their
    own: the server's memory is the whole tree's)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as children:
                kids = [int(k) for k in children.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _rss_mb(pid: int) -> float:
    """RSS of ``pid`` and every process under it, in MiB."""
    total = _own_rss_mb(pid)
    for child in _descendants(pid):
        with contextlib.suppress(OSError):  # gone meanwhile
            total += _own_rss_mb(child)
    return total


class Server:
    """``spec-tot serve`` in a process of its own (``nofile``: its open-file limit)."""

    def __init__(self, limits: Sequence[str] = (), nofile: int | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - open for the process's life
            prefix="serve-limits-", suffix=".log", delete=False
        )
        command = [sys.executable, "-m", "spec_tot", "serve", "--port", str(self.port)]
        for item in limits:
            command += ["--limit", item]

        def cap_files() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=self.log, preexec_fn=cap_files
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"spec-tot serve exited: {Path(self.log.name).read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            raise TimeoutError("spec-tot serve did not start")
        # the engine and PRM start on first use: start them, so idle figures include them
        warm = {"text": "1 2\n", "sampling_params": {"max_new_tokens": 1}}
        httpx.post(self.url + "/generate", json=warm, timeout=180).raise_for_status()
        httpx.post(self.url + "/classify", json={"text": "1 2\n1+2=3"}, timeout=180)

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def info(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/get_server_info", timeout=30).json())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class RssSampler:
    """The server's RSS every 20 ms on a thread: the peak, and a trace every ``every_s``."""

    def __init__(self, pid: int, every_s: float = 1.0) -> None:
        self.pid = pid
        self.peak = 0.0
        self.trace: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        last = -1e9
        while not self._stop.is_set():
            try:
                rss = _rss_mb(self.pid)
            except OSError:
                return
            self.peak = max(self.peak, rss)
            now = time.monotonic() - self._t0
            if now - last >= self._every:
                self.trace.append((round(now, 2), round(rss, 1)))
                last = now
            time.sleep(0.02)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {"peak_mb": round(self.peak, 1), "trace": self.trace}


async def _health_once(port: int, timeout_s: float = 5.0) -> float | None:
    """One ``GET /health`` on a fresh connection: seconds to its 200, or None (failed)."""
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            await writer.drain()
            head = await reader.readline()
            writer.close()
    except (OSError, TimeoutError):
        return None
    return time.perf_counter() - started if head.startswith(b"HTTP/1.1 200") else None


class Probe:
    """``/health`` every ``every_s`` while it runs."""

    def __init__(self, port: int, every_s: float = 0.05) -> None:
        self.port = port
        self.every = every_s
        self.latencies: list[float] = []
        self.failures = 0
        self.t0 = time.monotonic()
        self.slowest: list[tuple[float, float]] = []  # (latency, when it started)
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            when = time.monotonic() - self.t0
            got = await _health_once(self.port)
            if got is None:
                self.failures += 1
            else:
                self.latencies.append(got)
                self.slowest = sorted([*self.slowest, (got, when)], reverse=True)[:3]
            await asyncio.sleep(self.every)

    async def stop(self) -> dict[str, Any]:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        lat = sorted(self.latencies)
        return {
            "probes": len(lat) + self.failures,
            "failures": self.failures,
            "max_s": round(lat[-1], 4) if lat else None,
            "p99_s": round(lat[int(0.99 * (len(lat) - 1))], 4) if lat else None,
            "median_s": round(statistics.median(lat), 4) if lat else None,
            "over_1s": sum(t > 1.0 for t in lat) + self.failures,
            "slowest_at_s": [(round(t, 3), round(w, 2)) for t, w in self.slowest],
        }


def _puzzles(count: int) -> list[str]:
    return [f"{1 + i % 13} {1 + (i // 13) % 13} {1 + i % 7} {1 + i % 11}\n" for i in range(count)]


# -- scenarios ---------------------------------------------------------------------------------
async def oversize(server: Server) -> dict[str, Any]:
    bodies = {
        "/v1/completions": {"model": "default", "prompt": ["1 2"] * 20_000, "n": 128},
        "/generate": {"text": ["1 2"] * 20_000, "sampling_params": {"n": 128}},
        "/classify": {"text": ["1 2\n1+2=3"] * 20_000},
    }
    rss_before = _rss_mb(server.pid)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=30) as client:
        for path, body in bodies.items():
            raw = json.dumps(body).encode()
            times, codes = [], set()
            for _ in range(20):
                started = time.perf_counter()
                reply = await client.post(server.url + path, content=raw, headers=JSON_TYPE)
                times.append(time.perf_counter() - started)
                codes.add(reply.status_code)
            out[path] = {
                "body_kb": round(len(raw) / 1024, 1),
                "status": sorted(codes),
                "median_ms": round(1000 * statistics.median(times), 1),
                "max_ms": round(1000 * max(times), 1),
                "message": reply.json()["error"]["message"],
            }
    out["rss_before_mb"] = round(rss_before, 1)
    out["rss_after_mb"] = round(_rss_mb(server.pid), 1)
    return out


# Code points a client may send in JSON (\\u escapes reach every one of them): ASCII and
# controls, NUL, the BMP, lone surrogates of both halves, noncharacters, the astral planes.
_RANGES = [(0, 0x7F), (0x80, 0xD7FF), (0xD800, 0xDBFF), (0xDC00, 0xDFFF), (0xE000, 0xFFFF),
           (0xFFFE, 0xFFFF), (0x10000, 0x10FFFF)]  # fmt: skip


def _text(rng: random.Random) -> str:
    if rng.random() < 0.1:
        return ""
    return "".join(chr(rng.randint(*rng.choice(_RANGES))) for _ in range(rng.randint(1, 24)))


def _junk(rng: random.Random) -> Any:
    """Any JSON value, text of arbitrary code points included."""
    return rng.choice([
        lambda: _text(rng), lambda: rng.randint(-(2**70), 2**70), lambda: rng.random() * 1e6,
        lambda: None, lambda: rng.random() < 0.5, lambda: [_text(rng) for _ in range(3)],
        lambda: [rng.randint(-5, 70000) for _ in range(4)], lambda: {_text(rng): _text(rng)},
    ])()  # fmt: skip


def _fuzz_body(rng: random.Random) -> tuple[str, bytes]:
    """A request to one of the four routes: mostly well-formed bodies whose texts carry
    arbitrary code points, some with a field replaced by any JSON value, a few raw bytes
    that are not UTF-8."""
    small = {"max_new_tokens": rng.randint(0, 3)}
    text = _text(rng)
    route, body = rng.choice([
        ("/generate", {"text": text, "sampling_params": {**small, "stop": [_text(rng)]}}),
        ("/generate", {"text": [text, _text(rng)], "sampling_params": small}),
        ("/classify", {"text": text}),
        ("/v1/completions", {"model": "default", "prompt": text, "max_tokens": 2,
                             "stop": _text(rng)}),
        ("/v1/chat/completions", {"model": "default", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": text}]}),
    ])  # fmt: skip
    roll = rng.random()
    if roll < 0.3:  # one field of any kind
        key = rng.choice([*body, "sampling_params", "n", "stream", "rid", _text(rng)])
        body[key] = _junk(rng)
    if roll > 0.97:
        return route, b'{"text": "\xff\xfe\xed", "x": "\xc0\xaf"}'
    return route, json.dumps(body, ensure_ascii=True).encode()


async def fuzz(server: Server, count: int = 1500, seed: int = 22) -> dict[str, Any]:
    rng = random.Random(seed)
    bodies = [_fuzz_body(rng) for _ in range(count)]
    statuses: dict[str, dict[int, int]] = {}
    server_errors: list[dict[str, Any]] = []
    gate = asyncio.Semaphore(8)
    rss_before = _rss_mb(server.pid)
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=60) as client:

        async def send(route: str, raw: bytes) -> None:
            async with gate:
                try:
                    reply = await client.post(server.url + route, content=raw, headers=JSON_TYPE)
                except httpx.HTTPError as exc:
                    server_errors.append({"route": route, "error": repr(exc), "body": raw[:200]})
                    return
            row = statuses.setdefault(route, {})
            row[reply.status_code] = row.get(reply.status_code, 0) + 1
            if reply.status_code >= 500 and len(server_errors) < 10:
                server_errors.append({"route": route, "status": reply.status_code,
                                      "body": raw[:200].decode("ascii", "replace"),
                                      "reply": reply.text[:300]})  # fmt: skip

        await asyncio.gather(*(send(route, raw) for route, raw in bodies))
        health = (await client.get(server.url + "/health")).status_code
    return {
        "requests": count,
        "seed": seed,
        "seconds": round(time.perf_counter() - started, 2),
        "status_counts": {
            r: {str(k): v for k, v in sorted(c.items())} for r, c in statuses.items()
        },
        "five_xx": sum(v for c in statuses.values() for k, v in c.items() if k >= 500),
        "transport_errors": sum("error" in e for e in server_errors),
        "server_errors": [{k: str(v) for k, v in e.items()} for e in server_errors],
        "health_after": health,
        "rss_before_mb": round(rss_before, 1),
        "rss_after_mb": round(_rss_mb(server.pid), 1),
    }


async def capped(server: Server, max_new_tokens: int = 16) -> dict[str, Any]:
    body = {"text": _puzzles(512), "sampling_params": {"n": 8, "max_new_tokens": max_new_tokens,
                                                       "temperature": 1.0}}  # fmt: skip
    small = {"text": "4 4 6 8\n", "sampling_params": {"max_new_tokens": 16}}
    pool = httpx.Limits(max_connections=400, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=pool) as client:
        await client.post(server.url + "/generate", json=small)  # warm
        idle = _rss_mb(server.pid)
        sampler = RssSampler(server.pid)
        started = time.perf_counter()
        one = await client.post(server.url + "/generate", json=body)
        single = {"status": one.status_code, "seconds": round(time.perf_counter() - started, 2),
                  "samples": len(one.json()) if one.status_code == 200 else 0,
                  **sampler.stop()}  # fmt: skip
        settled = _rss_mb(server.pid)
        delta = single["peak_mb"] - idle
        sampler = RssSampler(server.pid)
        probe = Probe(server.port)
        good: list[tuple[int, float]] = []

        async def one_good() -> None:
            t0 = time.perf_counter()
            reply = await client.post(server.url + "/generate", json=small)
            good.append((reply.status_code, time.perf_counter() - t0))

        async def good_requests() -> None:  # one every 250 ms, each on its own
            pending = []
            try:
                while True:
                    pending.append(asyncio.create_task(one_good()))
                    await asyncio.sleep(0.25)
            finally:
                await asyncio.gather(*pending, return_exceptions=True)

        goods = asyncio.create_task(good_requests())
        started = time.perf_counter()
        replies = await asyncio.gather(
            *(client.post(server.url + "/generate", json=body) for _ in range(16))
        )
        sixteen_s = time.perf_counter() - started
        goods.cancel()  # the ones sent wait for their answers
        await asyncio.gather(goods, return_exceptions=True)
        health = await probe.stop()
        rss16 = sampler.stop()
    statuses = [r.status_code for r in replies]
    bound = idle + 3 * delta  # at most 3 capped requests hold room at once
    return {
        "idle_rss_mb": round(idle, 1),
        "one_capped": single,
        "rss_after_one_mb": round(settled, 1),
        "sixteen": {
            "status_counts": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "retry_after": sorted(
                {str(r.headers.get("retry-after")) for r in replies if r.status_code == 429}
            ),
            "seconds": round(sixteen_s, 2),
            **rss16,
            "rss_bound_mb": round(bound, 1),
            "bound_holds": rss16["peak_mb"] <= bound,
            "health": health,
            "good_requests": len(good),
            "good_ok": sum(s == 200 for s, _ in good),
            "good_max_s": round(max((t for _, t in good), default=0.0), 3),
            "good_median_s": round(statistics.median(t for _, t in good), 3) if good else None,
        },
    }


async def floods(server: Server, header_timeout_s: float) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this side holds 2,600 sockets
    probe = Probe(server.port)
    await asyncio.sleep(0.5)
    opened: list[float] = []
    closed: list[float | None] = []
    watchers = []
    writers = []

    async def watch(index: int, reader: asyncio.StreamReader) -> None:
        try:
            while await reader.read(4096):
                pass
        except OSError:
            pass
        closed[index] = time.monotonic()

    kinds = ["half-open"] * 1500 + ["idle"] * 1100
    connect_failures = 0
    t0 = time.monotonic()
    for i, kind in enumerate(kinds):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        except OSError:
            connect_failures += 1
            opened.append(time.monotonic())
            closed.append(time.monotonic())
            continue
        if kind == "half-open":
            writer.write(b"POST /generate HTTP/1.1\r\nhost: x\r\nx-slow: ")
        opened.append(time.monotonic())
        closed.append(None)
        writers.append(writer)
        watchers.append(asyncio.create_task(watch(i, reader)))
        if i % 100 == 99:
            await asyncio.sleep(0)  # let the probes in between
    open_s = time.monotonic() - t0
    await asyncio.sleep(header_timeout_s + 3)
    health = await probe.stop()
    info = server.info()
    for w in writers:
        w.close()
    for task in watchers:
        task.cancel()
    await asyncio.gather(*watchers, return_exceptions=True)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    delays = [c - o for o, c in zip(opened, closed, strict=True) if c is not None]
    still_open = sum(c is None for c in closed)
    by_kind = {
        kind: [closed[i] is not None for i, k in enumerate(kinds) if k == kind].count(True)
        for kind in ("half-open", "idle")
    }
    return {
        "server_nofile": 1024,
        "connections": len(kinds),
        "connect_failures": connect_failures,
        "opening_s": round(open_s, 2),
        "header_timeout_s": header_timeout_s,
        "closed_by_server": by_kind,
        "still_open_after_timeout": still_open,
        "close_delay_max_s": round(max(delays), 2) if delays else None,
        "close_delay_median_s": round(statistics.median(delays), 2) if delays else None,
        "guard": info.get("connections"),
        "health": health,
    }


def _stream_socket(port: int, body: bytes) -> socket.socket:
    """A client that sends a streaming request and never reads a byte of the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
    return sock


async def streams(server: Server, stall_s: float) -> dict[str, Any]:
    body = json.dumps({"text": "4 4 6 8\n", "stream": True, "sampling_params": {
        "n": 4096, "max_new_tokens": 200, "ignore_eos": True}}).encode()  # fmt: skip
    idle = _rss_mb(server.pid)
    sampler = RssSampler(server.pid)
    probe = Probe(server.port, every_s=0.25)
    t0 = time.monotonic()
    socks = [_stream_socket(server.port, body) for _ in range(4)]
    admitted_at_peak = 0
    samples_gone_s = None
    engine_idle_s = None
    trace = []
    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() - t0 < stall_s + 90:
            info = (await client.get(server.url + "/get_server_info")).json()
            inflight = info["in_flight"]["samples"]
            admitted_at_peak = max(admitted_at_peak, inflight)
            now = time.monotonic() - t0
            trace.append((round(now, 2), inflight, info["num_running_reqs"],
                          info["num_waiting_reqs"], info["kv_blocks_used"]))  # fmt: skip
            if inflight == 0 and admitted_at_peak and samples_gone_s is None:
                samples_gone_s = now
            quiet = info["num_running_reqs"] == info["num_waiting_reqs"] == 0
            if samples_gone_s is not None and quiet and info["kv_blocks_used"] == 0:
                engine_idle_s = now
                break
            await asyncio.sleep(0.2)
    heads = []
    for sock in socks:
        sock.setblocking(False)
        try:
            heads.append(sock.recv(64).split(b"\r\n")[0].decode())
        except OSError as exc:
            heads.append(f"{type(exc).__name__}")
        sock.close()
    health = await probe.stop()
    rss = sampler.stop()
    return {
        "stream_stall_s": stall_s,
        "idle_rss_mb": round(idle, 1),
        "samples_admitted_peak": admitted_at_peak,
        "first_bytes_seen_by_clients": heads,
        "samples_released_after_s": samples_gone_s,
        "engine_idle_kv_free_after_s": engine_idle_s,
        "rss": {**rss, "growth_mb": round(rss["peak_mb"] - idle, 1)},
        "final_info": {
            k: info[k] for k in ("num_running_reqs", "num_waiting_reqs", "kv_blocks_used")
        },
        "server_streams": info["streams"],
        "load_trace": trace[:: max(1, len(trace) // 40)],
        "health": health,
    }


async def disconnects(server: Server) -> dict[str, Any]:
    body = json.dumps({"text": "4 4 6 8\n", "sampling_params": {
        "max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0}}).encode()  # fmt: skip
    rounds = []
    for _ in range(5):
        writers = []
        for _ in range(32):
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                         b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
            writers.append(writer)
        async with httpx.AsyncClient(timeout=30) as client:
            busy = None
            for _ in range(200):
                info = (await client.get(server.url + "/get_server_info")).json()
                if info["num_running_reqs"] + info["num_waiting_reqs"] >= 16:
                    busy = {k: info[k] for k in ("num_running_reqs", "num_waiting_reqs",
                                                 "kv_blocks_used")}  # fmt: skip
                    break
                await asyncio.sleep(0.01)
            for writer in writers:
                writer.transport.abort()  # the client goes away mid-request
            gone = time.monotonic()
            while True:
                info = (await client.get(server.url + "/get_server_info")).json()
                quiet = info["num_running_reqs"] == info["num_waiting_reqs"] == 0
                if quiet and info["kv_blocks_used"] == 0:
                    break
                if time.monotonic() - gone > 30:
                    break
                await asyncio.sleep(0.01)
            true_after = time.monotonic() - gone
            metrics = (await client.get(server.url + "/metrics")).text
            loads = (await client.get(server.url + "/v1/loads")).json()["loads"][0]
        rounds.append({
            "while_busy": busy,
            "report_true_after_s": round(true_after, 3),
            "metrics_running": [line for line in metrics.splitlines()
                                if line.startswith("sglang:num_running_reqs")],
            "loads_running": loads["num_running_reqs"],
            "loads_used_tokens": loads["num_used_tokens"],
        })  # fmt: skip
    return {"rounds": rounds, "worst_s": max(r["report_true_after_s"] for r in rounds)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--header-timeout-s", type=float, default=5.0)
    parser.add_argument("--stream-stall-s", type=float, default=10.0)
    parser.add_argument("--capped-tokens", type=int, default=16)
    parser.add_argument("--fuzz-requests", type=int, default=1500)
    parser.add_argument("--scenario-timeout-s", type=float, default=150.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    plans: dict[str, Callable[[Server], Any]] = {
        "oversize": oversize,
        "fuzz": lambda s: fuzz(s, args.fuzz_requests),
        "capped": lambda s: capped(s, args.capped_tokens),
        "floods": lambda s: floods(s, args.header_timeout_s),
        "streams": lambda s: streams(s, args.stream_stall_s),
        "disconnects": disconnects,
    }
    limits = [f"header_timeout_s={args.header_timeout_s}", f"stream_stall_s={args.stream_stall_s}"]
    started = time.monotonic()
    server = Server(limits, nofile=1024)  # one server under ulimit -n 1024 for every scenario
    start_s = round(time.monotonic() - started, 1)
    cap = (server.info().get("connections") or {}).get("cap")
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count()},
        "server": {"nofile": 1024, "limits": limits, "start_s": start_s, "connection_cap": cap},
    }
    try:
        for name in chosen:
            t0 = time.monotonic()
            try:
                results[name] = asyncio.run(_bounded(plans[name](server), args.scenario_timeout_s))
            except TimeoutError:
                results[name] = {"timed_out_after_s": args.scenario_timeout_s}
            except Exception as exc:  # the other scenarios still run; the error is a figure
                results[name] = {"failed": f"{type(exc).__name__}: {exc}"}
            results[name]["scenario_s"] = round(time.monotonic() - t0, 1)
            print(f"{name}: done in {results[name]['scenario_s']} s", file=sys.stderr, flush=True)
            if args.json is not None:  # after each scenario: a later failure keeps these
                args.json.write_text(json.dumps(results, indent=2))
    finally:
        server.stop()
    print("summary: " + "; ".join(_summary(name, results[name]) for name in chosen))


async def _bounded(work: Any, timeout_s: float) -> Any:
    async with asyncio.timeout(timeout_s):
        return await work


def _summary(name: str, r: dict[str, Any]) -> str:
    if "timed_out_after_s" in r:
        return f"{name} timed out after {r['timed_out_after_s']} s"
    if "failed" in r:
        return f"{name} failed: {r['failed']}"
    if name == "oversize":
        worst = max(v["max_ms"] for k, v in r.items() if k.startswith("/"))
        return f"oversize 400 in <= {worst} ms"
    if name == "fuzz":
        return f"fuzz {r['five_xx']} 5xx of {r['requests']} ({r['transport_errors']} dropped)"
    if name == "capped":
        s = r["sixteen"]
        return (
            f"capped peak RSS {s['peak_mb']} MB (bound {s['rss_bound_mb']}), health max "
            f"{s['health']['max_s']} s, good {s['good_ok']}/{s['good_requests']}"
        )
    if name == "floods":
        return (
            f"floods health max {r['health']['max_s']} s ({r['health']['over_1s']} over "
            f"1 s), still open {r['still_open_after_timeout']}/{r['connections']}"
        )
    if name == "streams":
        return (
            f"streams RSS +{r['rss']['growth_mb']} MB, released after "
            f"{r['samples_released_after_s']} s, KV free after "
            f"{r['engine_idle_kv_free_after_s']} s"
        )
    return f"disconnects report true after <= {r['worst_s']} s"


if __name__ == "__main__":
    main()
