"""The fused paged decode-attention kernel (``csrc/paged_decode.c``), built on first use.

Plain C with OpenMP, no torch headers: it compiles in well under a second with the
machine's C compiler (``$CC``, else Python's own, else ``cc``/``gcc``/``clang``), for this
CPU (``-march=native``), into the project's cache directory (``kernels/``), keyed by the
source, the compiler and the CPU's flags: a shared home directory never hands one CPU a
build tuned for another. Loaded with ``ctypes``, which releases the GIL for the call.

Built against the process's OpenMP runtime: torch's wheels ship ``libgomp.so.1`` and load
it first, so the kernel's ``omp parallel`` uses torch's thread pool instead of a second
one that would spin beside it.

Where no compiler is found or the build fails, ``load_paged_kernel`` returns None with the
reason and the engine keeps the sparse path (same results up to float rounding, tested).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from spec_tot.progress import note, timed_step

from ..config import cache_root

__all__ = ["PagedDecodeKernel", "load_paged_kernel"]

_SOURCE = "paged_decode.c"
_SYMBOL = "spec_tot_paged_decode"
_BUILD_SECONDS = 120
_ERRORS = {
    -1: "bad shape",
    -2: "more than 64 query heads per KV head",
    -3: "a context longer than its block table",
    -4: "a block id outside the pool",
    -5: "out of memory",
}


def _compiler() -> list[str] | None:
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC")):
        if candidate:
            words = shlex.split(candidate)
            if words and shutil.which(words[0]):
                return words
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _version(compiler: list[str]) -> str:
    try:
        done = subprocess.run(
            [*compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def _build(source: bytes, target: Path, compiler: list[str]) -> str | None:
    """Compiles ``source`` to ``target`` (atomically); returns an error, or None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    src = target.with_suffix(f".{os.getpid()}.c")
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    src.write_bytes(source)
    base = ["-O3", "-shared", "-fPIC", "-std=gnu11", str(src), "-o", str(tmp), "-lm"]
    error = "no attempt"
    try:
        # the CPU's own vector units first; then portable code; OpenMP where the compiler has it
        for extra in (["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], []):
            try:
                done = subprocess.run(
                    [*compiler, *extra, *base],
                    capture_output=True,
                    text=True,
                    timeout=_BUILD_SECONDS,
                    check=False,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                return f"{compiler[0]} failed to run: {exc}"
            if done.returncode == 0:
                os.replace(tmp, target)  # a concurrent build reads a whole library or none
                return None
            error = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            error = f"{compiler[0]}: {error[0]}"
        return error
    finally:
        for leftover in (src, tmp):
            leftover.unlink(missing_ok=True)


@dataclass(frozen=True)
class PagedDecodeKernel:
    """``attend(q, k_pool, v_pool, tables, lengths, scale)``: ``q`` ``[n, Hq, D]`` (rows
    may be strided, heads and dims contiguous), pools ``[blocks, block_size, Hkv, D]``,
    ``tables`` ``[n, max_blocks]`` int64 block ids, ``lengths`` ``[n]`` int64 context
    lengths (row ``i`` sees slots ``0 .. lengths[i] - 1``) -> ``[n, Hq, D]``. float32 on
    CPU only; the caller checks that (``supports``)."""

    path: str
    function: ctypes._CFuncPtr

    @staticmethod
    def supports(q: torch.Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype == torch.float32

    def attend(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        n, heads, dim = q.shape
        blocks, block_size, kv_heads, _ = k_pool.shape
        if q.stride(2) != 1 or q.stride(1) != dim:
            q = q.contiguous()
        out = torch.empty((n, heads, dim), dtype=q.dtype)
        code = self.function(
            q.data_ptr(),
            q.stride(0),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            lengths.data_ptr(),
            out.data_ptr(),
            n,
            heads,
            kv_heads,
            dim,
            block_size,
            blocks,
            scale,
            torch.get_num_threads(),
        )
        if code:
            raise RuntimeError(f"paged decode kernel refused its input: {_ERRORS.get(code, code)}")
        return out


def load_paged_kernel(root: str | Path | None = None) -> tuple[PagedDecodeKernel | None, str]:
    """The kernel (built into ``root/kernels`` when not yet there) and ``""``, or None and
    why not."""
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler found ($CC, cc, gcc, clang)"
    source = resources.files(__package__).joinpath("csrc", _SOURCE).read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, _version(compiler).encode(), _cpu_flags().encode()])
    ).hexdigest()[:20]
    folder = Path(root if root is not None else cache_root()) / "kernels"
    target = folder / f"paged_decode-{key}.so"
    if not target.is_file():
        try:
            with timed_step("compiling the C decode kernel", f"once per machine, into {folder}"):
                error = _build(source, target, compiler)
        except OSError as exc:
            error = f"cannot write {folder}: {exc}"
        if error is not None:
            note(f"no C decode kernel ({error}): decode attention runs in PyTorch, slower")
            return None, error
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"cannot load {target}: {exc}"
    function = getattr(library, _SYMBOL)
    function.restype = ctypes.c_int
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, i64, pointer, pointer, pointer, i64, pointer, pointer]
    function.argtypes += [i64] * 6 + [ctypes.c_float, ctypes.c_int]
    return PagedDecodeKernel(str(target), function), ""
