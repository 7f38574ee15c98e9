"""The CLI explains itself (issue 48): ``--version``, help that lists the programs, searches,
modes and backends it takes, every backend's options and every policy's parameters with
their types and defaults, and long starts that say what they are doing: ``spec-tot serve``
shows its calibration and prints its URL only once the URL accepts connections."""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from engine_fixtures import tiny_llama
from test_cli import invoke  # one helper for every CLI test

from spec_tot.config import MODES
from spec_tot.policies import POLICY_NAMES

__all__ = ["tiny_llama"]


def flat(text: str) -> str:
    """Help text without rich's box drawing and line wrapping."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = invoke(capsys, "--version")
    assert code == 0 and re.fullmatch(r"spec-tot \d+\.\d+\.\d+\S*\n", out)


def test_top_level_help_lists_names_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = invoke(capsys, "--help")
    text = flat(out)
    assert code == 0 and "``" not in out
    for name in ("game24", "math", "toy", *POLICY_NAMES, *MODES, "openai", "sglang", "local"):
        assert name in text, name
    assert "--list-options" in text and "--version" in text


@pytest.mark.parametrize("command", ["run", "bench"])
def test_run_help_names_what_each_option_takes(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = invoke(capsys, command, "--help")
    text = flat(out)
    assert code == 0
    assert "math" in text and "rebase" in text and "rest_mcts" in text and "specscale" in text
    assert "--list-options" in text and "--list-params" in text


def test_list_options_gives_each_backend_option_with_type_and_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = invoke(capsys, "run", "--list-options", "openai")
    assert code == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert rows["model"] == ["str", "'default'"]  # the served model's name is an option
    assert rows["forward_seed"] == ["bool", "True"]
    assert rows["deadline_floor_s"] == ["float", "30.0"]  # the HTTP client's too
    assert "http" not in rows  # built from the loose fields, not an option itself
    code, out, _ = invoke(capsys, "bench", "--list-options", "local")
    assert code == 0 and "policy_path" in out and "num_kv_blocks" in out
    assert not any(line.split()[0] == "model" for line in out.splitlines()[1:])


def test_list_params_gives_the_policy_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = invoke(capsys, "run", "--list-params", "rebase")
    assert code == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert rows["width"] == ["int", "16"] and rows["temperature"] == ["float", "0.2"]


def test_an_unknown_name_to_list_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = invoke(capsys, "run", "--list-options", "nope")
    assert code == 2 and "--list-options" in err and "openai" in err
    code, _, err = invoke(capsys, "run", "--list-params", "nope")
    assert code == 2 and "--list-params" in err and "rebase" in err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_shows_its_start_and_prints_the_url_once_it_listens(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A new model (an empty cache): the calibration is announced, and the moment the URL is
    printed, a request to it is answered (it was printed before the engine started, and a
    client got 'connection refused' from the URL it had just been given)."""
    port = _free_port()
    env = {**os.environ, "SPEC_TOT_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "spec_tot", "serve", "--program", "toy", "--port",
               str(port), "--backend-opt", f"policy_path={tiny_llama}"]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    stderr = proc.stderr
    threading.Thread(target=lambda: [lines.put(x) for x in stderr], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any("listening on" in x for x in seen):
            assert time.monotonic() < deadline, f"no 'listening' line: {seen}"
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, f"serve exited {proc.returncode}: {seen}"
        # at once, no retry: the printed URL accepts connections
        reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert reply.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = "".join(seen)
    assert "starting the engine" in text
    assert "loading the model" in text
    assert "calibrating the engine's step times" in text and "done in" in text
    assert text.index("calibrating") < text.index("listening on")


def test_a_long_run_off_a_terminal_prints_plain_progress_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import io
    import logging

    from rich.console import Console

    from spec_tot.progress import PROGRESS_LOGGER, run_progress

    log = Console(file=io.StringIO())  # not a terminal: no bar
    with (
        caplog.at_level(logging.INFO, logger=PROGRESS_LOGGER),
        run_progress("full x8", 3, log, every_s=0.0) as advance,
    ):
        for _ in range(3):
            advance()
    lines = [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER]
    assert lines == ["full x8: 1/3 done (0 s)", "full x8: 2/3 done (0 s)"]  # the table ends it
    assert log.file.getvalue() == ""  # type: ignore[attr-defined]
