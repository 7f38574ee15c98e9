"""The CLI's option checks: every value is parsed and validated here, before any backend
starts (loading the shipped models takes seconds; a typo should cost none of them).

``KEY=VALUE`` pairs are typed by a schema: the fields of the backend's config dataclasses and
the named parameters of its factory, as its registry entry lists them (``--backend-opt``), or
the policy's constructor (``--param``). A value is coerced to the annotated type (``int``,
``float``, ``bool``, ``str``, optionals and tuples of those); anything else is read as JSON,
or kept as a bare string.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import math
import os
import types
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from spec_tot.backends import BackendRegistry, default_registry
from spec_tot.cache_dir import cache_root
from spec_tot.config import ExecutorConfig
from spec_tot.errors import ConfigError, SpecTotError, UnknownNameError
from spec_tot.executor.hit_rate_store import load_hit_rates
from spec_tot.plugins import load_target
from spec_tot.policies import create_policy
from spec_tot.programs import Program, load_program

__all__ = [
    "MAX_ROUNDS",
    "Plan",
    "as_option",
    "backend_error",
    "backend_registry",
    "backend_schema",
    "check_json_path",
    "check_rounds",
    "int_list",
    "mode_list",
    "parse_backend_options",
    "parse_pairs",
    "plan_runs",
    "program_for",
    "schema_of",
    "typed_pairs",
]

MAX_ROUNDS = 1000  # a bench of more rounds is a typo, not a measurement


def backend_registry() -> BackendRegistry:
    """The backends the CLI knows by name (one place to swap in another registry)."""
    return default_registry()


@contextmanager
def as_option(option: str) -> Iterator[None]:
    """Re-raise a bad value's error as a ``ConfigError`` naming the CLI option."""
    try:
        yield
    except ConfigError as exc:
        text = str(exc)
        # "queries: ..." -> "--queries: ..."; "hit_rates: ..." -> "--hit-rates: ..."
        if exc.field.lstrip("-").replace("_", "-") == option.lstrip("-"):
            text = text.removeprefix(f"{exc.field}: ")
        raise ConfigError(option, text) from exc
    except (UnknownNameError, TypeError, ValueError) as exc:
        raise ConfigError(option, str(exc)) from exc


def parse_pairs(pairs: Sequence[str] | None, option: str) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict of raw values (typed later, by a schema)."""
    parsed: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(option, f"expected KEY=VALUE, got {pair!r}")
        if key in parsed:
            raise ConfigError(option, f"{key} given twice")
        parsed[key] = raw
    return parsed


def int_list(text: str, option: str) -> list[int]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() and int(t) > 0 for t in items):
        raise ConfigError(option, f"expected positive integers separated by commas, got {text!r}")
    return [int(t) for t in items]


def mode_list(text: str, option: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise ConfigError(option, f"expected executor modes separated by commas, got {text!r}")
    return modes


# -- typed KEY=VALUE options ----------------------------------------------------------------------
def schema_of(obj: Any) -> dict[str, Any]:
    """Option name -> annotation, from a dataclass's fields or a callable's named parameters.
    An annotation that does not resolve at run time (a TYPE_CHECKING import) counts as Any."""
    if dataclasses.is_dataclass(obj) and isinstance(obj, type):
        hints = typing.get_type_hints(obj)
        return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(obj)}
    func = getattr(obj, "__init__") if isinstance(obj, type) else obj  # noqa: B009 - mypy
    scope = vars(importlib.import_module(func.__module__))
    schema: dict[str, Any] = {}
    for name, p in inspect.signature(func).parameters.items():
        if name == "self" or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        schema[name] = _resolve(p.annotation, scope)
    return schema


def _resolve(annotation: Any, scope: dict[str, Any]) -> Any:
    if annotation is inspect.Parameter.empty:
        return Any
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, dict(scope))  # our own modules' annotations
    except Exception:
        return Any


def backend_schema(backend: str, registry: BackendRegistry | None = None) -> dict[str, Any] | None:
    """Option name -> type of a registered backend, read from its entry's ``options``; None
    for a backend that declares none (its values go to it as JSON, and it checks them)."""
    entry = (registry or backend_registry()).entry(backend)
    if entry.options is None:
        return None
    schema: dict[str, Any] = {}
    for source in entry.options:
        schema.update(schema_of(load_target(source) if isinstance(source, str) else source))
    return {k: v for k, v in schema.items() if k not in entry.internal}


def policy_schema(search: str) -> dict[str, Any]:
    """The policy's constructor parameters (an instance with defaults tells its class)."""
    with as_option("--search"):
        policy = create_policy(search)
    return schema_of(type(policy))


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _coerce(raw: str, annotation: Any) -> Any:
    """``raw`` as a value of ``annotation``; ValueError says what was expected."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if raw.strip().lower() in ("none", "null"):
            return None
        return _coerce(raw, args[0]) if len(args) == 1 else _json(raw)
    if annotation is bool:
        value = _BOOLS.get(raw.strip().lower())
        if value is None:
            raise ValueError(f"expected true or false, got {raw!r}")
        return value
    if annotation is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
    if annotation is float:
        try:
            number = float(raw)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"expected a finite number, got {raw!r}")
        return number
    if annotation is str:
        return raw
    if origin is tuple:
        value = _json(raw)
        items: list[Any] = value if isinstance(value, list) else [value]
        item_args = typing.get_args(annotation)
        item_type = item_args[0] if item_args else Any
        return tuple(_coerce(_text(v), item_type) for v in items)
    return _json(raw)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _json(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # a bare string such as a path


def typed_pairs(
    given: dict[str, Any], schema: dict[str, Any] | None, option: str
) -> dict[str, Any]:
    """Values typed by ``schema``; a raw string is parsed, a Python value is checked the same
    way (through its JSON text)."""
    raw = {k: v if isinstance(v, str) else json.dumps(v) for k, v in given.items()}
    if schema is None:
        return {k: _json(v) for k, v in raw.items()}
    typed: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in schema:
            known = ", ".join(sorted(schema))
            raise ConfigError(f"{option} {key}", f"not a known option; known: {known}")
        try:
            typed[key] = _coerce(value, schema[key])
        except ValueError as exc:
            raise ConfigError(f"{option} {key}", str(exc)) from None
    return typed


def parse_backend_options(pairs: Sequence[str] | None, backend: str) -> dict[str, Any]:
    return typed_pairs(
        parse_pairs(pairs, "--backend-opt"), backend_schema(backend), "--backend-opt"
    )


def backend_error(
    backend: str, exc: ConfigError, given: Sequence[str], registry: BackendRegistry | None = None
) -> ConfigError:
    """``exc`` from starting ``backend``, as a usage error naming the ``--backend-opt`` the
    user typed (``given``: the keys they gave; a field the backend's entry aliases is named
    by its option); a field they did not give keeps its name."""
    aliases = (registry or backend_registry()).entry(backend).aliases
    key = aliases.get(exc.field, exc.field)
    message = str(exc).removeprefix(f"{exc.field}: ")
    if key in given:
        return ConfigError(f"--backend-opt {key}", message)
    return ConfigError("--backend-opt", f"{key}: {message}")


def program_for(program: str | None, backend: str | None) -> str:
    """The toy program fits the synthetic backends; real models run Game of 24."""
    if program is not None:
        return program
    return "toy" if backend in ("scripted", "sim") else "game24"


# -- the whole plan of a run ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a ``run``/``bench`` needs, checked; no backend has started yet."""

    program: Program
    backend: str  # its name in ``registry``
    search: str
    search_params: dict[str, Any]
    backend_options: dict[str, Any]  # the user's, on top of the program's
    configs: tuple[ExecutorConfig, ...]  # one per mode x concurrency, in run order
    inputs: list[Any]
    registry: BackendRegistry  # where the backend is created from

    def options_text(self) -> str:
        """The user's backend options, as given (for error lines)."""
        pairs = " ".join(f"{k}={_text(v)}" for k, v in self.backend_options.items())
        return f"--backend-opt {pairs}" if pairs else "the program's default backend options"


def plan_runs(
    *,
    program: str | None,
    backend: str | None,
    search: str | None,
    modes: Sequence[str],
    concurrency: Sequence[int],
    queries: int,
    seed: int,
    search_params: dict[str, Any],
    backend_options: dict[str, Any],
    modes_option: str = "--modes",
    registry: BackendRegistry | None = None,
    dataset: str | None = None,
    hit_rates: str = "off",
) -> Plan:
    """Check every option without starting a backend: program, backend name and options,
    modes, concurrency, queries, search and its parameters (the graph is compiled against a
    scripted backend, so the policy validates its parameters now). ``modes_option``: the
    option the modes came from, as the user typed it (``--mode`` for ``run``); ``registry``:
    the backends known by name (default: ``backend_registry()``); ``hit_rates``: ``auto``,
    ``off`` or a file (``hit_rate_file``)."""
    from spec_tot.adapters.scripted import ScriptedBackend

    with as_option("--program"):
        prog = load_program(program_for(program, backend))
    backend_name = backend or prog.default_backend
    registry = registry or backend_registry()
    with as_option("--backend"):
        registry.entry(backend_name)
    search_name = search or prog.default_search
    if not modes:
        raise ConfigError(modes_option, "give at least one executor mode")
    configs = []
    for mode in modes:
        for conc in concurrency:
            with as_option(modes_option):
                ExecutorConfig(mode=mode)
            with as_option("--concurrency"):
                configs.append(ExecutorConfig(mode=mode, seed=seed, max_concurrency=conc))
    if queries < 1:
        raise ConfigError("--queries", f"must be >= 1, got {queries}")
    if dataset is None:
        with as_option("--queries"):
            inputs = prog.inputs(queries)
    elif prog.dataset_inputs is None:
        raise ConfigError("--dataset", f"program {prog.name!r} reads no dataset")
    else:
        with as_option("--dataset"):
            inputs = prog.dataset_inputs(dataset, queries)
    schema = backend_schema(backend_name, registry)
    options = typed_pairs(backend_options, schema, "--backend-opt")
    params = typed_pairs(search_params, policy_schema(search_name), "--param")
    with as_option("--param"):
        prog.build(backend=ScriptedBackend(), search=search_name, search_params=params)
    with as_option("--hit-rates"):
        kept = hit_rate_file(hit_rates, prog.name, search_name, backend_name, options, params)
        configs = [replace(c, hit_rates=kept) for c in configs]
    return Plan(prog, backend_name, search_name, params, options, tuple(configs), inputs, registry)


def hit_rate_file(
    given: str, program: str, search: str, backend: str, *options: dict[str, Any]
) -> str | None:
    """The file a run keeps its speculation hit rates in: ``off``, none; ``auto``, one
    per program, search, backend and options in the cache directory (what a policy's
    predictions hit depends on all of them); else the path given."""
    if given == "off":
        return None
    path = given
    if given == "auto":
        blob = json.dumps(options, sort_keys=True, default=str).encode()
        name = f"{program}-{search}-{backend}-{hashlib.sha256(blob).hexdigest()[:12]}.json"
        path = str(cache_root() / "hit_rates" / name)
    load_hit_rates(path)  # a file that is not one is refused before a model loads
    return path


def check_json_path(path: Path | None, option: str = "--json") -> None:
    """Refuse, before anything runs, an output path the run could not write at its end: a
    directory, a symlink (never written through), something that is not a regular file, an
    unwritable file, or a missing or unwritable folder."""
    if path is None:
        return
    shown = str(path)
    if path.is_symlink():
        raise ConfigError(option, f"{shown!r} is a symbolic link; give the file it points to")
    if path.is_dir():
        raise ConfigError(option, f"{shown!r} is a directory; give a file path in it")
    if not path.parent.is_dir():
        raise ConfigError(option, f"folder {str(path.parent)!r} does not exist")
    if path.exists():
        if not path.is_file():
            raise ConfigError(option, f"{shown!r} is not a regular file")
        if not os.access(path, os.W_OK):
            raise ConfigError(option, f"{shown!r} is not writable")
    elif not os.access(path.parent, os.W_OK | os.X_OK):
        raise ConfigError(option, f"folder {str(path.parent)!r} is not writable")


def check_rounds(rounds: int, control: str | None, modes: Sequence[str]) -> str | None:
    """The control mode of a rounds bench (None for one round): ``control`` or the first
    mode; it must be one of ``modes``, and is only meaningful with ``rounds`` > 1."""
    if not 1 <= rounds <= MAX_ROUNDS:
        raise ConfigError("--rounds", f"must be in 1..{MAX_ROUNDS}, got {rounds}")
    if rounds == 1:
        if control is not None:
            raise ConfigError("--control", "compares over rounds: give --rounds 2 or more")
        return None
    chosen = control if control is not None else modes[0]
    if chosen not in modes:
        raise ConfigError(
            "--control", f"{chosen!r} is not among --modes ({', '.join(dict.fromkeys(modes))})"
        )
    return chosen


def error_line(exc: BaseException) -> str:
    """One line for any error: a spec-tot error as it reads, anything else with its type."""
    text = str(exc) if isinstance(exc, SpecTotError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())
