"""``spec-tot graph``: a program's compiled graph as Mermaid."""

from __future__ import annotations

import spec_tot.cli.kit as kit
from spec_tot._private.mermaid import graph_to_mermaid
from spec_tot.cli._checks import as_option
from spec_tot.cli.kit import ProgramOpt
from spec_tot.programs import load_program

__all__ = ["graph"]


def graph(program: ProgramOpt = None) -> None:
    """Print a program's compiled graph as Mermaid."""
    from spec_tot.adapters.scripted import ScriptedBackend

    with as_option("--program"):
        prog = load_program(program or "game24")
    tot = prog.build(backend=ScriptedBackend(), search=prog.default_search, search_params={})
    kit.out.print(graph_to_mermaid(tot.graph), markup=False, highlight=False)
