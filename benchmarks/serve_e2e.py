"""Game of 24 end to end through the SGLang adapter against ``spec-tot serve``.

Starts ``spec-tot serve`` (the embedded engine behind SGLang's native HTTP API) as a separate
process on 127.0.0.1, runs the full executor over the SGLang adapter (generation over
/generate with ``sampling_seed``, the PRM over /classify), then runs the same puzzles, seeds
and mode on the embedded backend directly, and compares answers and solve rates.

    python benchmarks/serve_e2e.py --queries 20 --mode full --json serve.json
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

from spec_tot.adapters.local import create_local
from spec_tot.adapters.sglang import create_sglang
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


async def _run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    inputs = game24_inputs(args.queries)
    config = ExecutorConfig(mode=args.mode, seed=args.seed, max_concurrency=args.concurrency)
    remote = create_sglang(urls=[url], dedup=False, reward_per_step=True)
    over_http = compile_game24(search=args.search, backend=remote, reward=remote, config=config)
    started = time.perf_counter()
    http_batch = await over_http.arun_batch(inputs)
    http_wall = time.perf_counter() - started
    info = httpx.get(f"{url}/get_server_info").json()
    await remote.aclose()

    folder = task.asset_dir()
    direct_backend = create_local(
        policy_path=str(folder / "policy"),
        prm_path=str(folder / "prm"),
        saturation_batch=info["saturation_batch"],
    )
    direct = compile_game24(search=args.search, backend=direct_backend, config=config)
    started = time.perf_counter()
    direct_batch = await direct.arun_batch(inputs)
    direct_wall = time.perf_counter() - started
    await direct_backend.aclose()

    same = sum(
        a.answer == b.answer for a, b in zip(http_batch.results, direct_batch.results, strict=True)
    )
    return {
        "mode": args.mode,
        "search": args.search,
        "queries": args.queries,
        "seed": args.seed,
        "http": {"solved": http_batch.metrics.solved, "wall_s": http_wall},
        "direct": {"solved": direct_batch.metrics.solved, "wall_s": direct_wall},
        "same_answers": same,
        "http_errors": [r.errors for r in http_batch.results if r.errors],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--mode", default="full")
    parser.add_argument("--search", default="rebase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--saturation-batch", type=int, default=32)
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
    print(
        f"summary: {args.search}/{args.mode} over SGLang HTTP solved "
        f"{report['http']['solved']}/{args.queries}, direct {report['direct']['solved']}/"
        f"{args.queries}; identical answers {report['same_answers']}/{args.queries}"
    )


if __name__ == "__main__":
    main()
