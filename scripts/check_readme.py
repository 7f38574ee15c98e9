"""Follow the README line by line on a fresh clone, as a newcomer would; exit 0 only if every
command and snippet in it does.

- Every ```` ```bash ```` block runs, in order, in the clone, under ``bash -e`` with the
  clone's ``.venv`` active once a block has made it (each block's lines run as written).
- A line ending in ``# Ctrl-C stops it ...`` starts a server: it runs in the background
  until the end; the check waits until the first ``http://HOST:PORT`` it prints accepts a
  connection (the next blocks use it), and fails if it exits before the end.
- Every ```` ```python ```` block runs as a file with the venv's Python; a block whose first
  line is ``# from PATH`` is an excerpt: each of its lines must be in ``PATH`` and ``PATH``
  runs instead.
- ```` ```text ```` blocks are sample output and are not run.

    python scripts/check_readme.py                  # a clone of HEAD in a temporary folder
    python scripts/check_readme.py --skip-tests     # CI: its own step runs the test command

``--skip-tests`` replaces the README's ``python -m pytest -q`` by a collection of the same
tests (the install is still checked); ``.ci/run`` runs that command itself. The clone gets a
fresh ``$SPEC_TOT_CACHE_DIR`` (a newcomer's empty cache: kernels, calibration, models).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER_MARK = "# Ctrl-C stops it"
TEST_COMMAND = "python -m pytest -q"
_URL = re.compile(r"http://([\w.\-]+):(\d+)")


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # where it starts in the README


def blocks(readme: str) -> list[Block]:
    out: list[Block] = []
    lines = readme.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        out.append(Block(fence.group(1), "\n".join(body), start))
        i += 1
    return out


def commands(text: str) -> list[str]:
    """A bash block's commands: its lines, a trailing backslash joining the next one."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line and not line.startswith("#"):
            out.append(line)
    return out


class Runner:
    def __init__(self, clone: Path, env: dict[str, str], skip_tests: bool) -> None:
        self.clone, self.env, self.skip_tests = clone, env, skip_tests
        self.servers: list[tuple[str, subprocess.Popen[str], Path]] = []

    def _prelude(self) -> str:
        venv = self.clone / ".venv" / "bin" / "activate"
        return f". {venv}\n" if venv.is_file() else ""

    def bash(self, command: str, where: str) -> None:
        if self.skip_tests and TEST_COMMAND in command:
            command = command.replace(TEST_COMMAND, "python -m pytest -qq --collect-only")
        if SERVER_MARK in command:
            self.server(command, where)
            return
        print(f"$ {command}", flush=True)
        started = time.monotonic()
        code = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", self._prelude() + command],
            cwd=self.clone,
            env=self.env,
        ).returncode
        print(f"  ({where}: exit {code} in {time.monotonic() - started:.0f} s)", flush=True)
        if code != 0:
            raise SystemExit(f"README {where}: {command!r} exited {code}")

    def server(self, command: str, where: str, wait_s: float = 600) -> None:
        print(f"$ {command}   [in the background]", flush=True)
        log = self.clone / f".readme-server-{len(self.servers)}.log"
        with log.open("w") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                ["bash", "-c", self._prelude() + command.split(SERVER_MARK)[0]],
                cwd=self.clone,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        self.servers.append((where, proc, log))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"README {where}: {command!r} exited {proc.returncode}:\n"
                                 + log.read_text()[-3000:])  # fmt: skip
            found = _URL.search(log.read_text())
            if found is not None and _accepts(found.group(1), int(found.group(2))):
                print(f"  ({where}: {found.group(0)} accepts connections)", flush=True)
                return
            time.sleep(1)
        raise SystemExit(f"README {where}: no URL accepting connections after {wait_s:.0f} s")

    def python(self, block: Block, where: str) -> None:
        first = block.text.splitlines()[0] if block.text else ""
        source = re.match(r"#\s*from\s+([^\s:]+)", first)
        if source is not None:
            path = self.clone / source.group(1)
            body = path.read_text()
            lines = [_code(x) for x in block.text.splitlines()[1:]]
            missing = [x for x in lines if x and x != "..." and x not in body]
            if missing:
                raise SystemExit(f"README {where}: not in {source.group(1)}: {missing}")
            self.bash(f"python {source.group(1)}", where)
            return
        snippet = self.clone / f".readme-snippet-{block.line}.py"
        snippet.write_text(block.text + "\n")
        self.bash(f"python {snippet.name}", where)

    def stop_servers(self) -> None:
        failed = []
        for where, proc, log in self.servers:
            if proc.poll() is not None:
                failed.append(f"{where} exited {proc.returncode} early:\n{log.read_text()[-2000:]}")
                continue
            os.killpg(proc.pid, 2)  # Ctrl-C, as the README says
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
        if failed:
            raise SystemExit("README servers: " + "; ".join(failed))


def _code(line: str) -> str:
    """An excerpt's line without its trailing comment (the README may explain it)."""
    return re.sub(r"\s+#\s.*$", "", line).strip()


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-tests", action="store_true", help="collect, do not run, tests")
    parser.add_argument("--workdir", help="clone here (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the clone afterwards")
    parser.add_argument(
        "--worktree", action="store_true", help="copy the working tree, not a clone of HEAD"
    )
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="readme-check-"))
    clone = work / "spec-tot"
    if clone.exists():
        shutil.rmtree(clone)
    if args.worktree:  # what is here now, committed or not (git's ignores apply)
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.decode().split("\0")  # fmt: skip
        for name in filter(None, listed):
            if (ROOT / name).is_file():
                (clone / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, clone / name)
    else:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    active = os.environ.get("VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(  # a newcomer's shell: no virtual environment active
        p
        for p in env.get("PATH", "").split(os.pathsep)
        if not (active and p == os.path.join(active, "bin"))
    )
    env["SPEC_TOT_CACHE_DIR"] = str(work / "cache")
    # Jupyter refuses to run as root unless told: a checker running as root (CI) says so in
    # a config folder of its own, as a user's own account would not need to
    jupyter = work / "jupyter"
    jupyter.mkdir(parents=True, exist_ok=True)
    (jupyter / "jupyter_server_config.py").write_text("c.ServerApp.allow_root = True\n")
    env["JUPYTER_CONFIG_DIR"] = str(jupyter)
    runner = Runner(clone, env, args.skip_tests)
    started = time.monotonic()
    try:
        for block in blocks((clone / "README.md").read_text()):
            where = f"line {block.line}"
            if block.lang == "bash":
                for command in commands(block.text):
                    runner.bash(command, where)
            elif block.lang == "python":
                runner.python(block, where)
            elif block.lang not in ("text", ""):
                raise SystemExit(f"README {where}: a ```{block.lang} block: bash, python or text")
        runner.stop_servers()
    finally:
        for _, proc, _ in runner.servers:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"README: every command and snippet ran ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
