"""The ``spec-tot`` command line (``spec_tot.cli.kit``: what a plug-in's command uses)."""

from spec_tot.cli.entry import app, main, run_cli

__all__ = ["app", "main", "run_cli"]
