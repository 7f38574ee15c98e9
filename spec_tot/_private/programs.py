"""Ready ToT programs the CLI can run, found by name (imported lazily)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spec_tot._private.plugins import load_target
from spec_tot.errors import UnknownNameError

__all__ = ["PROGRAMS", "Program", "load_program"]


@dataclass(frozen=True, slots=True)
class Program:
    """``build(backend=, search=, search_params=, config=)`` compiles the program's app;
    ``inputs(n)`` returns its first n evaluation inputs; ``backend_options`` are what its
    default backend needs (model folders, ...)."""

    name: str
    description: str
    default_backend: str
    default_search: str
    build: Callable[..., Any]
    inputs: Callable[[int], list[Any]]
    backend_options: Callable[[str], dict[str, Any]]


PROGRAMS: dict[str, str] = {
    "toy": "spec_tot.graphs.toy:PROGRAM",
    "game24": "spec_tot.graphs.game24:PROGRAM",
}


def load_program(name: str) -> Program:
    target = PROGRAMS.get(name)
    if target is None:
        raise UnknownNameError("program", name, list(PROGRAMS))
    program: Program = load_target(target)
    return program
