"""The ``spec-tot`` command line: ``run`` (the main job), ``bench``, ``serve`` and ``graph``
(one module each in this package), and the one place their errors become exit codes."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import typer

import spec_tot.cli._about as about
import spec_tot.cli.kit as kit
from spec_tot.backends import BackendRegistry
from spec_tot.cli._checks import error_line
from spec_tot.cli._interrupt import RunInterrupted
from spec_tot.cli.bench import bench
from spec_tot.cli.graph import graph
from spec_tot.cli.run import run
from spec_tot.errors import ConfigError, UnknownNameError
from spec_tot.progress import show_progress

__all__ = ["app", "main", "run_cli"]

TRACEBACK_ENV = "SPEC_TOT_TRACEBACK"  # set to 1 to see the traceback of an unexpected error

app = typer.Typer(add_completion=False, help=about.APP_HELP, epilog=about.names_epilog())


@app.callback()
def _top(version: about.VersionOpt = False) -> None:
    """Fast Tree-of-Thought reasoning ('spec-tot COMMAND --help': a command's options)."""


for _command in (run, bench, graph):
    app.command()(_command)

# typer ships its own copy of click (typer._click) whose exceptions are not click's: find the
# base class through a public one, so this works with a vendored and a plain click alike.
_CLICK_ERROR: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"
)

# Commands that live with what they serve, registered by name so the core imports none of
# them (``spec_tot.cli.kit``: how a plug-in adds its own).
_BUILTIN_COMMANDS = {"serve": "spec_tot.adapters.local.serve.command:serve"}


kit.add_commands(app, _BUILTIN_COMMANDS)


def _say(line: str) -> None:
    """One line on stderr, never wrapped (a terminal-width console would break it)."""
    print(line, file=sys.stderr, flush=True)


def run_cli(argv: Sequence[str] | None = None, *, registry: BackendRegistry | None = None) -> int:
    """Run the CLI and return its exit code: 0 ok, 2 a usage error (one line, naming the
    option), 1 a runtime failure (one line), 130 interrupted. No traceback unless
    ``SPEC_TOT_TRACEBACK=1``. ``registry``: the backends ``run`` and ``bench`` know by name,
    their options checked by each entry's schema (default: ``default_registry()``)."""
    command = typer.main.get_command(app)
    try:
        code = command.main(
            args=list(argv) if argv is not None else None,
            prog_name="spec-tot",
            standalone_mode=False,
            obj=registry,
        )
    except _CLICK_ERROR as exc:
        err: Any = exc
        ctx = getattr(err, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        _say(f"error: {' '.join(str(err.format_message()).split())}{hint}")
        return int(getattr(err, "exit_code", 2))
    except RunInterrupted as stopped:
        _say(f"aborted ({stopped}): the queries that had finished are reported, marked partial")
        return stopped.exit_code
    except (typer.Abort, KeyboardInterrupt):
        _say("aborted")
        return 130
    except (ConfigError, UnknownNameError) as exc:
        _say(f"error: {error_line(exc)}")
        return 2
    except Exception as exc:
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        _say(f"error: {error_line(exc)}")
        return 1
    return code if isinstance(code, int) else 0


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point (``spec-tot``, ``python -m spec_tot``): errors are one line, not a
    traceback; long steps (model load, calibration, kernel compilation) print what they do."""
    show_progress()
    sys.exit(run_cli(argv))
