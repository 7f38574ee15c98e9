"""ToT programs: a compiled search plus its evaluation inputs, runnable by name from the CLI
(``spec-tot run --program NAME``, ``spec-tot bench``).

A program is a ``Program`` value, usually a module-level constant (``graphs/game24.py`` and
``graphs/toy.py`` are the built-in ones, written with public names only). Built-in programs
and the ones installed distributions declare as entry points (group ``spec_tot.programs``,
value ``"module:CONSTANT"``) are found by ``load_program``; each is imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spec_tot.errors import ConfigError, UnknownNameError
from spec_tot.plugins import declared, load_target

__all__ = ["BUILT_IN_PROGRAMS", "PROGRAM_ENTRY_POINTS", "Program", "load_program", "program_names"]


@dataclass(frozen=True, slots=True)
class Program:
    """What the CLI needs to run a ToT program.

    Contract:
    - ``build(backend=, search=, search_params=, config=)`` compiles the program's app (a
      ``ToTApp``): ``backend`` is a backend name or instance, ``search`` a policy name,
      ``search_params`` that policy's parameters (a dict), ``config`` an ``ExecutorConfig``.
    - ``inputs(n)`` returns the program's first ``n`` evaluation inputs (what the app's
      ``invoke`` takes), the same ones every call: runs are comparable.
    - ``backend_options(backend)`` returns what the program's default models need on that
      backend (model folders, a drafter, ...) as factory options; ``{}`` when none.
    - ``default_backend`` and ``default_search`` are used when the user names neither.
    - ``dataset_inputs(dataset, n)``, if the program has it, returns the first ``n`` inputs of
      a named or file dataset (``spec-tot run --dataset``); None: ``inputs`` only.
    """

    name: str
    description: str
    default_backend: str
    default_search: str
    build: Callable[..., Any]
    inputs: Callable[[int], list[Any]]
    backend_options: Callable[[str], dict[str, Any]]
    dataset_inputs: Callable[[str, int], list[Any]] | None = None


PROGRAM_ENTRY_POINTS = "spec_tot.programs"
_BUILT_IN: dict[str, str] = {
    "toy": "spec_tot.graphs.toy:PROGRAM",
    "game24": "spec_tot.graphs.game24:PROGRAM",
    "math": "spec_tot.graphs.math:PROGRAM",
}
BUILT_IN_PROGRAMS: tuple[str, ...] = tuple(_BUILT_IN)


def _targets() -> dict[str, str]:
    return {**_BUILT_IN, **declared(PROGRAM_ENTRY_POINTS, _BUILT_IN, warn=True)}


def program_names() -> list[str]:
    return sorted(_targets())


def load_program(name: str) -> Program:
    """The program called ``name`` (built in, or declared by an installed plug-in)."""
    targets = _targets()
    target = targets.get(name)
    if target is None:
        raise UnknownNameError("program", name, sorted(targets))
    program = load_target(target)
    if not isinstance(program, Program):
        raise ConfigError(
            "program", f"{target!r} is a {type(program).__name__}, not a spec_tot.programs.Program"
        )
    return program
