"""The engine's C kernels (``csrc/*.c``), built on first use and loaded with ``ctypes``.

Plain C with OpenMP, no torch headers: each compiles in about a second with the machine's
C compiler (``$CC``, else Python's own, else ``cc``/``gcc``/``clang``), for this CPU
(``-march=native``), into the project's cache directory (``kernels/``), keyed by the
source, the compiler and the CPU's flags: a shared home directory never hands one CPU a
build tuned for another. ``ctypes`` releases the GIL for the call.

Built against the process's OpenMP runtime: torch's wheels ship ``libgomp.so.1`` and load
it first, so a kernel's ``omp parallel`` uses torch's thread pool instead of a second one
that would spin beside it.
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
from importlib import resources
from pathlib import Path
from typing import Any

from spec_tot.progress import timed_step

from ..config import cache_root

__all__ = ["NO_COMPILER", "load_c_function"]

NO_COMPILER = "no C compiler found ($CC, cc, gcc, clang)"
_BUILD_SECONDS = 120


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


def load_c_function(
    source_name: str, symbol: str, what: str, root: str | Path | None = None
) -> tuple[Any, str, str]:
    """``symbol`` of ``csrc/<source_name>`` (built into ``root/kernels`` when not yet
    there): ``(function, library path, "")``, or ``(None, "", why not)``. ``what`` names
    the kernel in the progress line of a build."""
    compiler = _compiler()
    if compiler is None:
        return None, "", NO_COMPILER
    source = resources.files(__package__).joinpath("csrc", source_name).read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, _version(compiler).encode(), _cpu_flags().encode()])
    ).hexdigest()[:20]
    folder = Path(root if root is not None else cache_root()) / "kernels"
    target = folder / f"{Path(source_name).stem}-{key}.so"
    if not target.is_file():
        try:
            with timed_step(f"compiling {what}", f"once per machine, into {folder}"):
                error = _build(source, target, compiler)
        except OSError as exc:
            error = f"cannot write {folder}: {exc}"
        if error is not None:
            return None, "", error
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, "", f"cannot load {target}: {exc}"
    return getattr(library, symbol), str(target), ""
