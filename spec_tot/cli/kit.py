"""What a plug-in's CLI command uses to behave like spec-tot's own.

A package adds a command to ``spec-tot`` with an entry point in the ``spec_tot.commands``
group naming a typer-annotated function (``spec-tot serve`` is one:
``spec_tot.adapters.local.serve.command:serve``). Its options read as the built-in ones'
(``ProgramOpt``, ``BackendParamOpt``), its bad values are ``ConfigError``s naming the
option (``as_option``, ``parse_backend_options``, ``typed_pairs``), and ``spec-tot`` turns
them into one-line usage errors (exit 2), other failures into one line (exit 1).
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from spec_tot.backends import BUILT_IN_BACKENDS, BackendRegistry
from spec_tot.cli._checks import (
    as_option,
    backend_error,
    backend_registry,
    error_line,
    parse_backend_options,
    parse_pairs,
    schema_of,
    typed_pairs,
)
from spec_tot.errors import ConfigError, ExecutionError, UnknownNameError
from spec_tot.plugins import declared, load_target
from spec_tot.policies import POLICY_NAMES
from spec_tot.programs import BUILT_IN_PROGRAMS, load_program

__all__ = [
    "COMMAND_ENTRY_POINTS",
    "BackendOpt",
    "BackendParamOpt",
    "DatasetOpt",
    "HitRatesOpt",
    "JsonOpt",
    "ParamOpt",
    "ProgramOpt",
    "SearchOpt",
    "SeedOpt",
    "add_commands",
    "as_option",
    "console",
    "error_line",
    "load_program",
    "out",
    "parse_backend_options",
    "parse_pairs",
    "schema_of",
    "start_backend",
    "typed_pairs",
]

COMMAND_ENTRY_POINTS = "spec_tot.commands"

ProgramOpt = Annotated[
    str | None,
    typer.Option(
        help=f"ToT program: {', '.join(BUILT_IN_PROGRAMS)} (default: toy on scripted/sim, "
        "else game24)."
    ),
]
BackendParamOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="Backend option KEY=VALUE, repeatable (e.g. urls=http://127.0.0.1:8000, "
        "model=NAME); --list-options BACKEND lists them."
    ),
]
BackendOpt = Annotated[
    str | None,
    typer.Option(
        help=f"Backend: {', '.join(BUILT_IN_BACKENDS)} (default: the program's, "
        "local for game24 and math)."
    ),
]
SearchOpt = Annotated[
    str | None,
    typer.Option(help=f"Search policy: {', '.join(POLICY_NAMES)} (default: the program's)."),
]
SeedOpt = Annotated[int, typer.Option(help="Base seed.")]
ParamOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="Search parameter KEY=VALUE, repeatable (e.g. width=8); --list-params SEARCH "
        "lists them."
    ),
]
HitRatesOpt = Annotated[
    str,
    typer.Option(
        help="Where speculation's learnt hit rates are kept between runs: auto (the cache "
        "directory, per program, search and backend options), a JSON file, or off."
    ),
]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write the runs as JSON here.")]
DatasetOpt = Annotated[
    str | None,
    typer.Option(
        help="Inputs from a dataset: a name the program knows or a JSONL path "
        "(math: gsm8k, or GSM8K / MATH JSONL)."
    ),
]

# Messages and progress on stderr: stdout carries results, wide enough for the results
# table when piped to a file or a CI log.
console = Console(stderr=True)
out = Console(width=max(shutil.get_terminal_size((160, 24)).columns, 150))


def start_backend(
    name: str,
    options: dict[str, Any],
    given: str,
    keys: Sequence[str] = (),
    registry: BackendRegistry | None = None,
) -> Any:
    """Create the backend ``name`` from ``options``; a bad option value is a usage error
    naming the option the user typed (``keys``: the ones they gave), any other failure one
    line naming the options the user gave (``given``)."""
    registry = registry or backend_registry()
    try:
        return registry.create(name, **options)
    except ConfigError as exc:
        raise backend_error(name, exc, keys, registry) from exc
    except UnknownNameError as exc:
        raise ConfigError("--backend-opt", str(exc)) from exc
    except Exception as exc:
        raise ExecutionError(
            f"backend {name!r} did not start ({given}): {error_line(exc)}"
        ) from exc


def add_commands(cli: typer.Typer, built_in: Mapping[str, str]) -> None:
    """Register ``built_in`` (name -> ``"module:function"``) and every command of the
    ``spec_tot.commands`` entry points on ``cli``. A plug-in may not take a name already
    used, and one that cannot be loaded is skipped with a warning naming its entry point:
    one broken package must not take the whole CLI down."""
    for name, target in built_in.items():
        cli.command(name)(load_target(target))
    taken = {_command_name(c) for c in cli.registered_commands} | set(built_in)
    for name, target in declared(COMMAND_ENTRY_POINTS, taken, warn=True).items():
        try:
            command = load_target(target)
            if not callable(command):
                raise TypeError(f"{type(command).__name__} is not callable")
        except Exception as exc:
            warnings.warn(
                f"spec-tot command {name!r} ({target!r}, entry point group "
                f"{COMMAND_ENTRY_POINTS}) could not be loaded: {exc!r}; skipped",
                stacklevel=2,
            )
            continue
        cli.command(name)(command)


def _command_name(info: Any) -> str:
    """A registered command's name: given, or typer's own from its function's."""
    return str(info.name or getattr(info.callback, "__name__", "").replace("_", "-"))
