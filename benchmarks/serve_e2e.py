"""Game of 24 end to end through ``spec-tot serve`` with both HTTP adapters.

Starts ``spec-tot serve`` (the embedded engine behind SGLang's native API and the OpenAI API)
as a separate process on 127.0.0.1, runs the executor over the SGLang adapter (generation over
/generate with ``sampling_seed``, the PRM over /classify), then over the OpenAI adapter
(generation over /v1/completions with ``seed``, the PRM over /classify), then the same
puzzles, seeds and mode on the embedded backend directly, and compares answers and solve
rates.

``--keepalive-rounds R`` then runs the SGLang path R more times with the HTTP pool's own
client (no keep-alive) and with an httpx client that keeps connections alive, interleaved,
and reports the wall-time ratio: httpcore 1.0.9 hands one idle keep-alive connection to every
request of a burst, which is why the pool opens a connection per request.

    python benchmarks/serve_e2e.py --queries 20 --mode baseline --json serve.json
    python benchmarks/serve_e2e.py --queries 10 --keepalive-rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from spec_tot.adapters.http import EndpointPool
from spec_tot.adapters.local import create_local
from spec_tot.adapters.openai_compat import create_openai
from spec_tot.adapters.sglang import SGLANG_WIRE, SGLangBackend, SGLangConfig, create_sglang
from spec_tot.config import ExecutorConfig
from spec_tot.graphs import game24_task as task
from spec_tot.graphs.game24 import compile_game24, game24_inputs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"spec-tot serve exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"spec-tot serve did not become healthy at {url}")


async def _over_http(args: argparse.Namespace, url: str, api: str) -> tuple[Any, float]:
    config = ExecutorConfig(mode=args.mode, seed=args.seed, max_concurrency=args.concurrency)
    rewards = create_sglang(urls=[url], dedup=False, reward_per_step=True)
    if api == "sglang-keepalive":  # the same adapter over a client that keeps connections
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        client = httpx.AsyncClient(timeout=600.0, limits=limits)
        pool = EndpointPool([url], client=client, protocol=SGLANG_WIRE)
        await rewards.aclose()
        rewards = SGLangBackend(SGLangConfig(urls=(url,), dedup=False, reward_per_step=True), pool)
    if api.startswith("sglang"):
        gen: Any = rewards
    else:
        gen = create_openai(urls=[url], model="default", stream=True)
    app = compile_game24(search=args.search, backend=gen, reward=rewards, config=config)
    started = time.perf_counter()
    try:
        batch = await app.arun_batch(game24_inputs(args.queries))
    finally:
        if gen is not rewards:
            await gen.aclose()
        await rewards.aclose()
        if api == "sglang-keepalive":
            await rewards.pool.http.aclose()  # a client the pool was given stays open
    return batch, time.perf_counter() - started


async def _run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    runs = {api: await _over_http(args, url, api) for api in ("sglang", "openai")}
    info = httpx.get(f"{url}/get_server_info").json()
    folder = task.asset_dir()
    direct_backend = create_local(
        policy_path=str(folder / "policy"),
        prm_path=str(folder / "prm"),
        saturation_batch=info["saturation_batch"],
    )
    config = ExecutorConfig(mode=args.mode, seed=args.seed, max_concurrency=args.concurrency)
    direct = compile_game24(search=args.search, backend=direct_backend, config=config)
    started = time.perf_counter()
    direct_batch = await direct.arun_batch(game24_inputs(args.queries))
    direct_wall = time.perf_counter() - started
    await direct_backend.aclose()

    report: dict[str, Any] = {
        "mode": args.mode,
        "search": args.search,
        "queries": args.queries,
        "seed": args.seed,
        "direct": {"solved": direct_batch.metrics.solved, "wall_s": direct_wall},
    }
    walls: dict[str, list[float]] = {"sglang": [], "sglang-keepalive": []}
    for _ in range(args.keepalive_rounds):
        for api in walls:
            batch, wall = await _over_http(args, url, api)
            same = sum(a.answer == b.answer for a, b in zip(batch.results, direct_batch.results,
                                                             strict=True))  # fmt: skip
            walls[api].append(wall)
            report.setdefault("keepalive", {}).setdefault(f"{api}_same_answers", []).append(same)
    if args.keepalive_rounds:
        report["keepalive"]["wall_s"] = walls
        report["keepalive"]["ratio_keepalive_over_fresh"] = sum(walls["sglang-keepalive"]) / sum(
            walls["sglang"]
        )
    for api, (batch, wall) in runs.items():
        same = sum(
            a.answer == b.answer for a, b in zip(batch.results, direct_batch.results, strict=True)
        )
        report[api] = {
            "solved": batch.metrics.solved,
            "wall_s": wall,
            "same_answers": same,
            "errors": [r.errors for r in batch.results if r.errors],
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--mode", default="baseline")
    parser.add_argument("--search", default="rebase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--saturation-batch", type=int, default=32)
    parser.add_argument("--keepalive-rounds", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "spec_tot",
        "serve",
        "--port",
        str(port),
        "--backend-opt",
        f"saturation_batch={args.saturation_batch}",
    ]
    proc = subprocess.Popen(command)
    try:
        _wait_healthy(url, proc)
        report = asyncio.run(_run(args, url))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    q = args.queries
    if args.keepalive_rounds:
        ka = report["keepalive"]
        print(
            f"summary: sglang path, {args.keepalive_rounds} interleaved rounds: keep-alive "
            f"client {ka['ratio_keepalive_over_fresh']:.2f}x the wall time of the pool's "
            "fresh connections (denominator: fresh connections)"
        )
    print(
        f"summary: {args.search}/{args.mode}: direct solved {report['direct']['solved']}/{q}; "
        + "; ".join(
            f"{api} over HTTP solved {report[api]['solved']}/{q}, identical answers "
            f"{report[api]['same_answers']}/{q}"
            for api in ("sglang", "openai")
        )
    )


if __name__ == "__main__":
    main()
