"""The options ``run`` and ``bench`` share, described once (their types are the plug-in
kit's, ``spec_tot.cli.kit``): ``search_command`` adds them to both commands, so neither
lists nor forwards them by hand."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from spec_tot.backends import BackendRegistry
from spec_tot.cli._about import ListOptionsOpt, ListParamsOpt
from spec_tot.cli.kit import (
    BackendOpt,
    BackendParamOpt,
    DatasetOpt,
    HitRatesOpt,
    JsonOpt,
    ParamOpt,
    ProgramOpt,
    SearchOpt,
    SeedOpt,
)

__all__ = ["Shared", "search_command"]


@dataclass(frozen=True, slots=True)
class Shared:
    """What the user gave for the options ``run`` and ``bench`` share (their names are the
    parameters of ``spec_tot.cli._checks.plan_runs`` where the two agree), and the backends
    known by name (the CLI's ``obj``: ``run_cli(registry=...)``)."""

    program: str | None
    backend: str | None
    search: str | None
    dataset: str | None
    seed: int
    param: list[str] | None
    backend_opt: list[str] | None
    json_path: Path | None
    hit_rates: str
    registry: BackendRegistry | None

    def selection(self) -> dict[str, Any]:
        """The keywords ``plan_runs`` takes from these options, as given."""
        return {
            "program": self.program,
            "backend": self.backend,
            "search": self.search,
            "dataset": self.dataset,
            "seed": self.seed,
            "hit_rates": self.hit_rates,
            "registry": self.registry,
        }


def _option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=annotation)  # fmt: skip


# The one description of the shared options, in the order ``--help`` lists them (the command's
# own options follow). ``--list-options`` / ``--list-params`` act on their own and exit.
_SHARED = (
    _option("program", ProgramOpt, None),
    _option("backend", BackendOpt, None),
    _option("search", SearchOpt, None),
    _option("dataset", DatasetOpt, None),
    _option("seed", SeedOpt, 0),
    _option("param", ParamOpt, None),
    _option("backend_opt", BackendParamOpt, None),
    _option("json_path", JsonOpt, None),
    _option("hit_rates", HitRatesOpt, "auto"),
)
_LISTERS = (
    _option("list_options", ListOptionsOpt, None),
    _option("list_params", ListParamsOpt, None),
)
_CONTEXT = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)


def search_command(command: Callable[..., None]) -> Callable[..., None]:
    """``command(shared, **own)`` as a typer command taking the shared options before its own
    (``own``: ``command``'s keyword parameters after ``shared``); typer reads the signature
    built here, and the shared values reach ``command`` as one ``Shared``."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values()
           if p.name != "shared"]  # fmt: skip
    names = {p.name for p in _SHARED}

    @functools.wraps(command)
    def wrapper(ctx: typer.Context, **values: Any) -> None:
        for lister in _LISTERS:
            values.pop(lister.name, None)  # eager: handled (and exited) by their callbacks
        shared = Shared(registry=ctx.obj, **{k: values.pop(k) for k in names})
        command(shared, **values)

    params = [_CONTEXT, *_SHARED, *(p.replace(kind=p.KEYWORD_ONLY) for p in own), *_LISTERS]
    del wrapper.__wrapped__  # typer must read the signature below, not ``command``'s
    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
