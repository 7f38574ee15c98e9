"""What the CLI says about itself: ``--version``, the names its options take, and each
backend's options and each policy's parameters with their types and defaults
(``--list-options BACKEND``, ``--list-params SEARCH``).

Help texts list the built-in names from the same constants the code dispatches on, so they
cannot drift; plug-ins (entry points) appear in the ``--list-*`` tables, which read the
registries at call time.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from importlib import metadata
from typing import Annotated, Any

import typer

from spec_tot.cli._checks import as_option, backend_registry, backend_schema, schema_of
from spec_tot.config import MODES
from spec_tot.plugins import load_target
from spec_tot.policies import POLICY_NAMES, create_policy, policy_names
from spec_tot.programs import program_names

__all__ = [
    "APP_HELP",
    "MODES_TEXT",
    "POLICIES_TEXT",
    "ListOptionsOpt",
    "ListParamsOpt",
    "VersionOpt",
    "backend_option_rows",
    "list_options_callback",
    "list_params_callback",
    "policy_param_rows",
    "version_callback",
    "version_text",
]

APP_HELP = (
    "Fast Tree-of-Thought reasoning: run a ToT program (Game of 24, GSM8K math, yours) with a "
    "speculative executor over an embedded engine or a serving engine (SGLang, vLLM)."
)
POLICIES_TEXT = ", ".join(POLICY_NAMES)
MODES_TEXT = ", ".join(MODES)


def version_text() -> str:
    try:
        return f"spec-tot {metadata.version('spec-tot')}"
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "spec-tot (not installed)"


def _type_text(annotation: Any) -> str:
    if annotation is Any:
        return "JSON"
    if isinstance(annotation, type):
        return annotation.__name__
    text = str(annotation).replace("typing.", "")
    return text.replace("NoneType", "None")


def _defaults(source: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(source) and isinstance(source, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(source):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = "(built)"
        return out
    func = getattr(source, "__init__") if isinstance(source, type) else source  # noqa: B009
    return {
        name: p.default
        for name, p in inspect.signature(func).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def _rows(schema: dict[str, Any], defaults: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for name in sorted(schema):
        shown = repr(defaults[name]) if name in defaults else "(required)"
        if defaults.get(name) == "(built)":
            shown = "(built from the options above)"
        rows.append((name, _type_text(schema[name]), shown))
    return rows


def backend_option_rows(backend: str) -> list[tuple[str, str, str]]:
    """``(option, type, default)`` for every ``--backend-opt`` key of ``backend``."""
    registry = backend_registry()
    with as_option("--list-options"):
        sources = registry.entry(backend).options
    schema = backend_schema(backend, registry)
    if schema is None or sources is None:
        return []
    defaults: dict[str, Any] = {}
    for source in reversed(sources):  # the factory's own defaults win over its configs'
        loaded = load_target(source) if isinstance(source, str) else source
        defaults.update(_defaults(loaded))
    return _rows(schema, defaults)


def policy_param_rows(search: str) -> list[tuple[str, str, str]]:
    """``(parameter, type, default)`` for every ``--param`` key of the policy ``search``."""
    with as_option("--list-params"):
        policy_type = type(create_policy(search))
    return _rows(schema_of(policy_type), _defaults(policy_type))


def _print_rows(title: str, rows: list[tuple[str, str, str]]) -> None:
    typer.echo(title)
    if not rows:
        typer.echo("  (none declared: values are passed on as JSON)")
        return
    width = max(len(r[0]) for r in rows)
    kind = max(len(r[1]) for r in rows)
    for name, type_text, default in rows:
        typer.echo(f"  {name:<{width}}  {type_text:<{kind}}  {default}")


def _eager(action: Callable[[str], None]) -> Callable[[typer.Context, str | None], None]:
    def callback(ctx: typer.Context, value: str | None) -> None:
        if value is None or ctx.resilient_parsing:
            return
        action(value)
        raise typer.Exit(0)

    return callback


def _list_options(backend: str) -> None:
    _print_rows(
        f"--backend-opt KEY=VALUE for backend {backend!r} (option, type, default):",
        backend_option_rows(backend),
    )


def _list_params(search: str) -> None:
    _print_rows(
        f"--param KEY=VALUE for search {search!r} (parameter, type, default):",
        policy_param_rows(search),
    )


list_options_callback = _eager(_list_options)
list_params_callback = _eager(_list_params)


def version_callback(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit(0)


def names_epilog() -> str:
    """The names ``run`` and ``bench`` take, read from the registries (plug-ins included)."""
    backends = ", ".join(backend_registry().names())
    return (
        f"Programs: {', '.join(program_names())}.  Searches: {', '.join(policy_names())}.  "
        f"Modes: {MODES_TEXT}.  Backends: {backends}.  "
        "List a backend's options: --list-options BACKEND; a search's parameters: "
        "--list-params SEARCH."
    )


def _lister(metavar: str, callback: Any, text: str) -> Any:
    return typer.Option(metavar=metavar, is_eager=True, callback=callback, help=text)


ListOptionsOpt = Annotated[
    str | None,
    _lister("BACKEND", list_options_callback, "List BACKEND's --backend-opt keys and exit."),
]
ListParamsOpt = Annotated[
    str | None,
    _lister("SEARCH", list_params_callback, "List the search's --param keys and exit."),
]
VersionOpt = Annotated[
    bool,
    typer.Option(
        "--version", callback=version_callback, is_eager=True, help="Print the version and exit."
    ),
]
