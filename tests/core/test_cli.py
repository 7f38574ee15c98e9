"""``spec-tot`` as a user meets it: every usage error is one line on stderr naming the option,
exit 2, no traceback, and no backend started (option values are checked before any model
loads); runtime failures are one line and exit 1; a run in which every query failed is an
error; the main commands and every ``--help`` work."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_fixtures import tiny_llama

import spec_tot.cli._execute as cli_execute
from spec_tot import cli
from spec_tot.adapters.local.serve import command as serve_command
from spec_tot.cli import kit as cli_kit
from spec_tot.errors import ConfigError

__all__ = ["tiny_llama"]


def invoke(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.run_cli(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def no_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a backend (and so a model) would start."""

    def refuse(*_args: Any, **_kw: Any) -> Any:
        raise AssertionError("a backend started before the options were checked")

    monkeypatch.setattr(cli_kit, "start_backend", refuse)


USAGE_ERRORS = [
    (["--bogus"], "No such option: --bogus"),
    (["run", "--queries", "abc"], "'--queries'"),
    (["nosuch"], "No such command 'nosuch'"),
    ([], "Missing command"),
    (["run", "--param", "bogus=1"], "--param bogus: not a known option"),
    (["run", "--param", "width=abc"], "--param width: expected an integer, got 'abc'"),
    (["run", "--param", "width"], "--param: expected KEY=VALUE"),
    (["run", "--param", "width=0"], "--param: width"),
    (["run", "--backend-opt", "num_kv_blocks=abc"], "--backend-opt num_kv_blocks: expected an"),
    (["run", "--backend-opt", "bogus=1"], "--backend-opt bogus: not a known option"),
    (["run", "--backend-opt", "enable_dedup=maybe"], "--backend-opt enable_dedup: expected true"),
    (["serve", "--port", "99999"], "'--port'"),
    (["serve", "--port", "0"], "'--port'"),
    (["serve", "--backend-opt", "num_kv_blocks=abc"], "--backend-opt num_kv_blocks"),
    (["serve", "--api-key", " "], "--api-key: must not be empty"),
    (["serve", "--allow-origin", "*"], "--allow-origin: '*' is not an origin"),
    (["serve", "--limit", "header_timeout_s=100000"], "is over the bound of 3600"),
    (["serve", "--limit", "max_header_count=1000000000"], "is over the bound of 1048576"),
    (["serve", "--program", "nope"], "--program: unknown program 'nope'"),
    (["run", "--queries", "101"], "--queries: the test range holds 100 puzzles"),
    (["run", "--queries", "0"], "'--queries'"),
    (["run", "--concurrency", "0"], "'--concurrency'"),
    (["run", "--search", "bogus"], "--search: unknown search policy 'bogus'"),
    (["run", "--mode", "bogus"], "--mode: unknown executor mode 'bogus'"),
    (["run", "--compare", "--mode", "baseline"], "--compare:"),
    (["run", "--program", "nope"], "--program: unknown program 'nope'"),
    (["bench", "--rounds", "3", "--control", "dedup"], "--control: 'dedup' is not among --modes"),
    (["bench", "--control", "baseline"], "--control: compares over rounds: give --rounds 2"),
    (["bench", "--rounds", "0"], "'--rounds'"),
    (["bench", "--rounds", "100000"], "'--rounds'"),
    (["run", "--backend", "nope"], "--backend: unknown backend 'nope'"),
    (["run", "--json", "/nonexistent-dir/x.json"], "--json: folder '/nonexistent-dir'"),
    (["bench", "--modes", ","], "--modes: expected executor modes"),
    (["bench", "--modes", "full,bogus"], "--modes: unknown executor mode 'bogus'"),
    (["bench", "--modes", "bogus"], "--modes: unknown executor mode 'bogus'"),
    (["run", "--compare", "--mode", "bogus"], "--mode: unknown executor mode 'bogus'"),
    (["run", "--json", "/"], "--json: '/' is a directory"),
    (["serve", "--limit", "max_connections=0"], "--limit max_connections: must be an integer"),
    (["serve", "--limit", "bogus=1"], "--limit bogus: not a known option"),
    (["serve", "--limit", "stream_stall_s=abc"], "--limit stream_stall_s: expected a number"),
    (["serve", "--limit", "max_connections=100000000"], "--limit max_connections: 100000000"),
    (["serve", "--limit", "max_samples_per_request=99999"], "--limit max_samples_per_request"),
    (["serve", "--api-key", ""], "--api-key: must not be empty"),
    (["serve", "--api-key", " k3y"], "--api-key: has leading or trailing whitespace"),
    (["serve", "--host", "0.0.0.0"], "--host: 0.0.0.0 is reachable from other machines"),
    (["serve", "--insecure-no-auth", "--api-key", "k"], "--insecure-no-auth: given with an"),
    (["bench", "--concurrency", "0,4"], "--concurrency: expected positive integers"),
    (["bench", "--concurrency", "x"], "--concurrency: expected positive integers"),
    (["graph", "--program", "nope"], "--program: unknown program 'nope'"),
]


@pytest.mark.parametrize(
    ("argv", "expected"), USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS]
)
def test_usage_error_is_one_line_exit_2_and_starts_nothing(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str], no_backend: None
) -> None:
    code, out, err = invoke(capsys, *argv)
    line = one_line(err)
    assert code == 2 and out == ""
    assert line.startswith("error: ") and expected in line, line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "--backend-opt", "num_kv_blocks=0"], "--backend-opt num_kv_blocks: must be >= 1"),
        (["bench", "--backend", "scripted", "--backend-opt", "depth=0"], "--backend-opt depth:"),
        # create_local hands policy_path on as EngineConfig's model: the error names the
        # option the user typed
        (["run", "--backend-opt", "policy_path="], "--backend-opt policy_path: must be a non"),
    ],
)
def test_backend_option_values_are_checked_before_weights_load(
    argv: list[str],
    expected: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spec_tot.adapters.local.engine import llm_engine as engine

    def refuse(*_args: Any, **_kw: Any) -> Any:
        raise AssertionError("the engine started loading weights")

    monkeypatch.setattr(engine, "LLMEngine", refuse)
    code, out, err = invoke(capsys, *argv)
    assert code == 2 and out == "" and expected in one_line(err)


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_bad_policy_folder_names_the_option_the_user_typed(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model loader's errors say ``model``; the user typed ``policy_path``."""
    (tmp_path / "config.json").write_text("{}")
    for folder, words in (
        ("/nonexistent", "is not a folder"),
        (str(tmp_path), "has no *.safetensors file"),
    ):
        code, out, err = invoke(capsys, command, "--backend-opt", f"policy_path={folder}")
        line = one_line(err)
        assert code == 2 and out == "", line
        assert line.startswith("error: --backend-opt policy_path: ") and words in line, line


def test_a_port_in_use_is_refused_before_the_engine_loads(
    capsys: pytest.CaptureFixture[str], no_backend: None
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        code, _, err = invoke(capsys, "serve", "--port", str(port))
    assert code == 2 and f"--port: cannot bind 127.0.0.1:{port}" in one_line(err)


def test_a_truncated_model_file_is_one_line_naming_the_option(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code, out, err = invoke(
        capsys, "run", "--queries", "1", "--backend-opt", f"policy_path={folder}"
    )
    line = one_line(err)
    assert code == 1 and out == ""
    assert f"backend 'local' did not start (--backend-opt policy_path={folder})" in line, line


@pytest.mark.parametrize(
    ("option", "bound"),
    [
        ("num_kv_blocks=1000000000000", "num_kv_blocks: 1000000000000 is over the bound of"),
        ("max_num_seqs=99999999", "max_num_seqs: 99999999 is over the bound of"),
        ("max_model_len=1073741824", "max_model_len: 1073741824 is over the bound of"),
        ("threads=100000", "threads: 100000 is over the bound of"),
        ("num_kv_blocks=1000000", "hold 17000000 tokens"),  # under the block bound: tokens
    ],
)
def test_sizes_past_their_bounds_are_refused_before_anything_loads(
    option: str, bound: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """On 2f33153 num_kv_blocks=10**12 was accepted and the core grew past 15 GB."""
    if option == "num_kv_blocks=1000000":
        option += " block_size=17"  # 17M tokens: past MAX_KV_TOKENS
    opts = [x for o in option.split() for x in ("--backend-opt", o)]
    code, out, err = invoke(capsys, "run", "--queries", "1", *opts)
    line = one_line(err)
    assert code == 2 and out == "" and bound in line, line


@pytest.mark.timeout(60)
def test_a_weight_file_that_is_a_fifo_is_refused_not_opened(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """open() of a FIFO blocks until a writer comes: on 2f33153 this hung forever."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    code, out, err = invoke(
        capsys, "run", "--queries", "1", "--backend-opt", f"policy_path={folder}"
    )
    line = one_line(err)
    assert code == 2 and out == "" and "policy_path" in line and "not a regular file" in line


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("tokenizer.json", b""),  # was: "local: JSONDecodeError(...)", exit 1, no file named
        ("tokenizer.json", b"\xff\xfe not json"),
        ("config.json", b"{not json"),  # was: "local: OSError(...)" after start-up, exit 1
        ("config.json", b"[1, 2]"),
    ],
)
def test_corrupt_json_in_a_model_folder_is_refused_up_front(
    name: str, content: bytes, tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / name).write_bytes(content)
    code, out, err = invoke(
        capsys, "run", "--queries", "1", "--backend-opt", f"policy_path={folder}"
    )
    line = one_line(err)
    assert code == 2 and out == "" and "policy_path" in line and name in line, line


def test_every_query_failed_is_an_error_not_a_result(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The case: prompts longer than max_model_len, so each query fails in the engine.
    code, out, err = invoke(
        capsys, "run", "--program", "toy", "--backend", "local", "--queries", "2",
        "--backend-opt", f"policy_path={tiny_llama}", "--backend-opt", "max_model_len=8",
        "--backend-opt", "saturation_batch=4",
    )  # fmt: skip
    line = one_line(err)
    assert code == 1 and "q/s" not in out
    assert "every query failed in full@32 (2/2; --backend-opt" in line and "max_model_len=8" in line
    assert "first error: q0/" in line and "8" in line


def test_some_failed_queries_warn_and_the_run_still_reports(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = invoke(
        capsys, "run", "--backend", "scripted", "--queries", "4", "--concurrency", "2",
        "--backend-opt", 'fail_prefixes=["q1"]',
    )  # fmt: skip
    assert code == 0 and "summary: full@2:" in out and "3/4" in out
    assert one_line(err).startswith("warning: 1/4 queries failed in full@2; first: q1/")


def test_bench_with_one_dead_run_prints_the_table_then_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_json = tmp_path / "runs.json"
    code, out, err = invoke(
        capsys, "bench", "--backend", "scripted", "--modes", "baseline,full", "--concurrency",
        "2", "--queries", "3", "--backend-opt", 'fail_prefixes=["q0","q1","q2"]',
        "--json", str(out_json),
    )  # fmt: skip
    assert code == 1 and out == ""  # every run dead: no table of rates that measure nothing
    assert "every query failed in baseline@2, full@2 (3/3;" in one_line(err)
    assert len(json.loads(out_json.read_text())) == 2  # the record is still written


def test_run_and_bench_print_the_table_summary_and_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = invoke(capsys, "run", "--backend", "scripted", "--queries", "4", "--compare")
    assert code == 0 and err == ""
    assert "solved" in out and "summary: baseline@32:" in out and "x baseline)" in out
    out_json = tmp_path / "runs.json"
    code, out, err = invoke(
        capsys, "bench", "--backend", "scripted", "--modes", "baseline, full", "--concurrency",
        "1,4", "--queries", "3", "--param", "width=2", "--param", "n=4", "--json", str(out_json),
    )  # fmt: skip
    assert code == 0 and f"wrote {out_json}" in err
    rows = json.loads(out_json.read_text())
    assert [(r["mode"], r["concurrency"]) for r in rows] == [
        ("baseline", 1), ("baseline", 4), ("full", 1), ("full", 4),
    ]  # fmt: skip
    assert all(r["metrics"]["queries"] == 3 and r["search"] == "beam" for r in rows)


def test_graph_prints_mermaid(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = invoke(capsys, "graph", "--program", "toy")
    assert code == 0 and out.startswith(("flowchart", "graph"))


@pytest.mark.parametrize("command", [[], ["run"], ["bench"], ["serve"], ["graph"]])
def test_help_works_everywhere(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = invoke(capsys, *command, "--help")
    assert code == 0 and "Usage" in out


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", "must not be empty"),  # set and empty: an error, never auth turned off
        (" ", "must not be empty"),
        ("\t\n", "must not be empty"),
        ("k3y ", "has leading or trailing whitespace"),
        ("\udcffkey", "must be visible ASCII"),  # argv/environ bytes that are not UTF-8
        ("abc\ndef", "must be visible ASCII"),  # no client can send a newline in a header
        ("k\u00e9y", "must be visible ASCII"),
        ("a b", "must be visible ASCII"),
    ],
)
def test_serve_reads_the_api_key_from_its_env_var(
    value: str,
    expected: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_backend: None,
) -> None:
    code, out, _ = invoke(capsys, "serve", "--help")
    assert code == 0 and "--api-key" in out and serve_command.API_KEY_ENV in out
    monkeypatch.setenv(serve_command.API_KEY_ENV, value)
    code, _, err = invoke(capsys, "serve")
    assert code == 2 and f"${serve_command.API_KEY_ENV}: {expected}" in one_line(err)
    # a non-loopback host never starts without a key, nor with a bad one
    code, _, err = invoke(capsys, "serve", "--host", "0.0.0.0")
    assert code == 2 and f"${serve_command.API_KEY_ENV}: {expected}" in one_line(err)


def test_serve_auth_choice_is_checked_before_the_engine_loads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A good key from either source, or an explicit --insecure-no-auth, passes the auth
    checks and reaches the backend start (refused here, so no model loads)."""
    seen: list[str] = []

    def refuse(*_args: Any, **_kw: Any) -> Any:
        seen.append("start")
        raise ConfigError("--backend-opt", "stopped before loading")

    monkeypatch.setattr(cli_kit, "start_backend", refuse)
    monkeypatch.delenv(serve_command.API_KEY_ENV, raising=False)
    for argv in (
        ["serve", "--host", "0.0.0.0", "--api-key", "k3y!~"],  # every visible ASCII goes
        ["serve", "--host", "0.0.0.0", "--insecure-no-auth"],
        ["serve", "--host", "localhost"],
        ["serve", "--host", "::1"],
    ):
        code, _, err = invoke(capsys, *argv, "--port", "1")
        assert code == 2 and "stopped before loading" in one_line(err), (argv, err)
    monkeypatch.setenv(serve_command.API_KEY_ENV, "s3cret")
    code, _, err = invoke(capsys, "serve", "--host", "0.0.0.0", "--port", "1")
    assert code == 2 and "stopped before loading" in one_line(err)
    assert len(seen) == 5


@pytest.mark.parametrize("kind", ["directory", "symlink", "unwritable file", "unwritable dir"])
def test_json_paths_are_refused_before_anything_runs(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_backend: None
) -> None:
    import os

    target = tmp_path / "out.json"
    if kind == "directory":
        target.mkdir()
    elif kind == "symlink":
        (tmp_path / "real.json").write_text("[]")
        target.symlink_to(tmp_path / "real.json")
    elif kind == "unwritable file":
        target.write_text("[]")
        target.chmod(0o444)
    else:
        target = tmp_path / "locked" / "out.json"
        target.parent.mkdir()
        target.parent.chmod(0o555)
    try:
        if os.geteuid() == 0 and kind.startswith("unwritable"):
            pytest.skip("root writes anywhere: os.access says so")
        for command in ("run", "bench"):
            code, out, err = invoke(capsys, command, "--json", str(target))
            assert code == 2 and out == "", (command, err)
            assert one_line(err).startswith("error: --json: "), err
    finally:
        target.parent.chmod(0o755)
        if target.exists() and not target.is_symlink() and not target.is_dir():
            target.chmod(0o644)


def test_the_table_prints_even_when_the_json_cannot_be_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path that passes the up-front check but fails at the end (the folder went away
    meanwhile): the table and summary still print, then one error line, exit 1."""
    out_json = tmp_path / "gone" / "runs.json"
    out_json.parent.mkdir()
    real = cli_execute.execute_plan

    def execute_then_lose_the_folder(*args: Any, **kwargs: Any) -> Any:
        runs = real(*args, **kwargs)
        out_json.parent.rmdir()
        return runs

    monkeypatch.setattr(cli_execute, "execute_plan", execute_then_lose_the_folder)
    code, out, err = invoke(
        capsys, "run", "--backend", "scripted", "--queries", "2", "--json", str(out_json)
    )
    assert code == 1 and "solved" in out and "summary: full@32:" in out
    assert one_line(err).startswith(f"error: --json: could not write '{out_json}'")


async def test_serve_api_key_reaches_the_server(tiny_llama: Path) -> None:
    import httpx

    options = [f"policy_path={tiny_llama}", "prm_path=null", "saturation_batch=4"]
    server = serve_command.build_server("game24", options, "k3y")
    await server.state.serve.backend.start()  # what the server's startup does
    transport = httpx.ASGITransport(app=server)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.get("/health")).status_code == 401
        ok = await client.get("/health", headers={"Authorization": "Bearer k3y"})
        assert ok.status_code == 200


def test_the_entry_point_prints_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "spec_tot", "run", "--queries", "abc"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_line(proc.stderr).startswith("error: Invalid value for '--queries'")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("sig", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_keeps_the_queries_that_finished(sig: str, code: int, tmp_path: Path) -> None:
    """On 2f33153 SIGINT or SIGTERM 20 s into a run left no JSON and printed nothing."""
    import signal
    import time

    out = tmp_path / "part.json"
    command = [
        sys.executable, "-m", "spec_tot", "run", "--backend", "scripted", "--program", "toy",
        "--queries", "100", "--concurrency", "2", "--backend-opt", "token_latency_s=0.01",
        "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(8)  # start-up, then a few queries finish (about 3 a second)
    proc.send_signal(getattr(signal, sig))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, (stdout, stderr)
    assert f"aborted ({sig})" in stderr and "summary: full@2" in stdout
    (row,) = json.loads(out.read_text())
    assert row["partial"] is True and 0 < row["metrics"]["queries"] < 100


def test_bench_rounds_reports_each_cell_against_the_control_with_an_interval(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_json = tmp_path / "rounds.json"
    code, out, err = invoke(
        capsys, "bench", "--backend", "scripted", "--modes", "baseline,full", "--concurrency",
        "1,2", "--queries", "2", "--rounds", "3", "--control", "baseline", "--seed", "4",
        "--json", str(out_json),
    )  # fmt: skip
    assert code == 0, err
    assert "spec-tot bench (rounds)" in out and "summary: baseline@1 " in out
    assert "full@1" in out and "x baseline@1 [" in out.split("summary:")[1]
    payload = json.loads(out_json.read_text())
    runs = payload["runs"]
    assert [r["round"] for r in runs[:1]] == [0] and len(runs) == 1 + 3 * 4  # warm-up + 3x4
    for rnd in (1, 2, 3):  # every cell once per round
        cells = sorted((r["mode"], r["concurrency"]) for r in runs if r["round"] == rnd)
        assert cells == [("baseline", 1), ("baseline", 2), ("full", 1), ("full", 2)]
    orders = [[(r["mode"], r["concurrency"]) for r in runs if r["round"] == k] for k in (1, 2, 3)]
    full = payload["cells"]["full@2"]
    assert full["control"] == "baseline@2" and len(full["ratios"]) == 3
    lo, hi = full["interval"]
    assert lo <= full["ratio"] <= hi
    assert payload["cells"]["baseline@1"]["ratio"] is None  # the control itself
    assert payload["control"] == "baseline" and payload["summary"].startswith("baseline@1")
    # the same seed gives the same order; the order is shuffled, not fixed
    code, _, _ = invoke(
        capsys, "bench", "--backend", "scripted", "--modes", "baseline,full", "--concurrency",
        "1,2", "--queries", "2", "--rounds", "3", "--seed", "4", "--json", str(out_json),
    )  # fmt: skip
    again = json.loads(out_json.read_text())["runs"]
    assert [[(r["mode"], r["concurrency"]) for r in again if r["round"] == k]
            for k in (1, 2, 3)] == orders  # fmt: skip


def test_serve_is_a_command_the_core_cli_does_not_import() -> None:
    """``serve`` lives with the server and registers by name: loading the CLI loads neither
    the server nor the engine (``run`` on a remote backend pays for neither)."""
    code = (
        "import sys, spec_tot.cli as c;"
        "assert 'serve' in [x.name for x in c.app.registered_commands];"
        "assert not {'starlette', 'uvicorn', 'torch'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plugin_commands_register_and_a_broken_one_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A package's ``spec_tot.commands`` entry point adds a command; one that cannot load,
    or that claims a taken name, is skipped with a warning naming it: the CLI stays up."""
    import importlib.metadata as md

    import typer

    points = [
        md.EntryPoint("hello", "json:dumps", cli_kit.COMMAND_ENTRY_POINTS),
        md.EntryPoint("broken", "no_such_module_xyz:cmd", cli_kit.COMMAND_ENTRY_POINTS),
        md.EntryPoint("run", "json:loads", cli_kit.COMMAND_ENTRY_POINTS),
    ]
    monkeypatch.setattr("spec_tot.plugins.entry_points", lambda group: points)
    app = typer.Typer()

    @app.command()
    def run() -> None: ...

    with pytest.warns(UserWarning) as seen:
        cli_kit.add_commands(app, {"serve": "spec_tot.adapters.local.serve.command:serve"})
    names = sorted(cli_kit._command_name(c) for c in app.registered_commands)
    assert names == ["hello", "run", "serve"]
    messages = " ".join(str(w.message) for w in seen)
    assert "'broken'" in messages and "no_such_module_xyz" in messages
    assert "may not replace the built-in 'run'" in messages
