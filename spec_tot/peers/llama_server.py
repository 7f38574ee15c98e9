"""llama.cpp's own server on this machine's CPU, as a CPU user would run it: ``llama-server``
built from the llama.cpp sources that the ``llama-cpp-python`` sdist vendors (PyPI has no
llama.cpp wheel, and ``llama_cpp.server`` serves one request at a time; ``llama-server -np
N`` batches N), serving SmolLM2-135M-Instruct's own GGUF (``spec_tot.peers.smollm2``).

    python scripts/llama_server.py build               # once: cmake, ~5 minutes on 2 cores
    python scripts/llama_server.py serve               # prints the URL once /health answers

The build lives in ``llama.cpp-<version>`` in ``spec_tot.cache_dir.cache_root()`` (cmake
Release, native CPU flags, no curl, static). Its OpenAI-compatible ``/v1/completions``
takes ``prompt`` as text or token ids, ``n_probs`` for logprobs; ``/tokenize`` and
``/health`` are its own. ``-c`` is the context of all slots together: each of ``-np``
slots gets ``ctx / np`` tokens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from spec_tot.cache_dir import cache_root
from spec_tot.peers.served import Served, command_line, free_port, launch, log_path
from spec_tot.progress import show_progress, timed_step

__all__ = ["LLAMA_CPP_PYTHON", "binary", "build", "start"]

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built
_CMAKE = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)  # fmt: skip


def build_dir() -> Path:
    return cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def binary(folder: Path | None = None) -> Path:
    return (folder or build_dir()) / "bin" / "llama-server"


def build(folder: Path | None = None, jobs: int | None = None) -> Path:
    """``llama-server``, built when missing (idempotent); returns its path."""
    folder = folder or build_dir()
    if binary(folder).is_file():
        return binary(folder)
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-server needs cmake (and a C++ compiler)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
               ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp]  # fmt: skip
        with timed_step(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist", "77 MB"):
            subprocess.run(pip, check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        work = Path(tmp) / "build"
        jobs = jobs or os.cpu_count() or 2
        with timed_step("building llama-server with cmake", f"{jobs} jobs, a few minutes"):
            subprocess.run(["cmake", "-S", str(source), "-B", str(work), *_CMAKE], check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip
            subprocess.run(["cmake", "--build", str(work), "--target", "llama-server",
                            "-j", str(jobs)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        (folder / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(work / "bin" / "llama-server", binary(folder))
    return binary(folder)


def start(
    gguf: str | Path,
    *,
    name: str = "smollm2",
    port: int | None = None,
    slots: int = 32,
    threads: int = 2,
    slot_context: int = 2048,
    log: Path | None = None,
    extra: tuple[str, ...] = (),
    wait_s: float = 300.0,
) -> Served:
    """Serve ``gguf`` with ``slots`` parallel sequences (``-np``) on ``threads`` threads
    and wait until ``/health`` answers."""
    server = build()
    port = port or free_port()
    log = log or log_path("llama-server", port)
    command = [
        str(server), "-m", str(gguf), "--alias", name, "--host", "127.0.0.1",
        "--port", str(port), "-np", str(slots), "-t", str(threads),
        "-c", str(slots * slot_context), *extra,
    ]  # fmt: skip
    return launch(command, port, name, log).healthy("llama-server", wait_s)


def main(argv: list[str] | None = None) -> int:
    from spec_tot.peers.smollm2 import fetch_gguf

    parser, run = command_line(
        __doc__ or "", ("build", "build llama-server into its cached folder"),
        "serve a GGUF (default: SmolLM2's) until Ctrl-C",
    )  # fmt: skip
    run.add_argument("--gguf", default=None, help="the model file (default: SmolLM2-135M's)")
    run.add_argument("--slots", type=int, default=32, help="parallel sequences (-np)")
    run.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    show_progress()
    if args.command == "build":
        print(build())
        return 0
    gguf = args.gguf or fetch_gguf()
    server = start(gguf, port=args.port, slots=args.slots, threads=args.threads)
    return server.run_until_interrupted(f"llama_server: serving {gguf}")


if __name__ == "__main__":
    sys.exit(main())
