"""A pytest plugin that routes LangGraph's own test suite through ``from_langgraph``.

Loaded by ``scripts/langgraph_suite.py`` (``-p lg_suite_plugin``) with
``SPEC_TOT_LG_MODE`` set to ``baseline`` or ``full``: every ``StateGraph.compile(...)`` and
every ``@entrypoint`` graph of the suite is passed through ``spec_tot.from_langgraph`` in
that mode. In ``full`` mode every node is treated as speculable (``kind: function``)
except those this plugin judges to side-effect (see ``side_effect``), since a test's nodes
carry no spec-tot metadata. Graphs built directly with ``Pregel(...)`` run unrouted.
"""

from __future__ import annotations

import collections
import functools
import inspect
import json
import os
import threading
import types
from typing import Any

from langgraph.func import entrypoint
from langgraph.graph.state import StateGraph

from spec_tot.langgraph import from_langgraph, speculation_of

MODE = os.environ.get("SPEC_TOT_LG_MODE", "baseline")
_MUTABLE = (
    list,
    dict,
    set,
    bytearray,
    collections.deque,
    collections.Counter,
    collections.defaultdict,
)
_STATEFUL_MODULES = ("unittest.mock", "threading", "asyncio", "queue", "multiprocessing")
_PURE_MODULES = ("operator", "math", "json", "re", "typing", "time", "random", "functools")


def _stateful(value: Any) -> str | None:
    """Why a value a node function reaches could carry state it mutates (None: it cannot)."""
    if isinstance(value, _MUTABLE):
        return f"a {type(value).__name__}"
    if isinstance(value, types.ModuleType | type | types.BuiltinFunctionType):
        return None
    if isinstance(value, str | bytes | int | float | bool | complex | frozenset | tuple):
        return None
    if value is None or isinstance(value, types.FunctionType | functools.partial):
        return None
    module = type(value).__module__ or ""
    if module.startswith(_STATEFUL_MODULES) or isinstance(value, threading.Event):
        return f"a {type(value).__name__} ({module})"
    if isinstance(value, types.MethodType):
        return _stateful(value.__self__)
    if hasattr(value, "__dict__") or hasattr(value, "__slots__"):
        return f"an object of {type(value).__name__}"
    return None


def side_effect(fn: Any, depth: int = 0, seen: set[int] | None = None) -> str | None:
    """Why ``fn`` may have a side effect (None: none found). A function is judged pure
    when every value it reaches outside itself (closure cells, globals), and every function
    among them, is immutable; it takes no ``store``; it is not a method of an object."""
    seen = seen if seen is not None else set()
    if id(fn) in seen or depth > 3:
        return None
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        return side_effect(fn.func, depth, seen) or next(
            (r for a in fn.args if (r := _stateful(a))), None
        )
    if isinstance(fn, types.MethodType):
        return f"a method of {type(fn.__self__).__name__}"
    fn = inspect.unwrap(fn)
    if not isinstance(fn, types.FunctionType):
        if callable(fn) and not isinstance(fn, type):
            return f"a callable object {type(fn).__name__}"
        return None
    if "store" in inspect.signature(fn).parameters:
        return "takes the store"
    try:
        reach = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        return "its closure cannot be read"
    for name, value in {**reach.nonlocals, **reach.globals}.items():
        if isinstance(value, types.ModuleType) and value.__name__.startswith(_PURE_MODULES):
            continue
        why = _stateful(value)
        if why:
            return f"reaches {name}: {why}"
        if isinstance(value, types.FunctionType):
            inner = side_effect(value, depth + 1, seen)
            if inner:
                return f"calls {name}, which {inner}"
    return None


def node_function(bound: Any) -> Any:
    """The user's function behind a node's runnable (None: not a plain function)."""
    func = getattr(bound, "func", None) or getattr(bound, "afunc", None)
    if isinstance(func, functools.partial) and func.args:  # LangGraph's run_in_executor wrap
        func = func.args[-1] if callable(func.args[-1]) else func
    return func


STATS: dict[str, Any] = {"graphs": 0, "speculable": 0, "excluded": collections.Counter()}
# The totals only, never the plans: a plan holds its graph's nodes, and through them what
# a test left on them (LangGraph's refcount test counts every loop still reachable). Each
# is kept with the test file that built its graph, for the per-file launched/adopted check.
TOTALS: list[tuple[str, Any]] = []
CURRENT_FILE = ["(collection)"]


def pytest_runtest_setup(item: Any) -> None:
    CURRENT_FILE[0] = item.nodeid.split("::")[0]


def auto_roles(compiled: Any) -> dict[str, dict[str, Any]]:
    """``kind: function`` for every node not judged to side-effect."""
    roles: dict[str, dict[str, Any]] = {}
    for name, node in compiled.nodes.items():
        if name.startswith("__"):
            continue
        func = node_function(node.bound)
        why = (
            "runs a subgraph"
            if node.subgraphs
            else "not a plain function"
            if func is None
            else side_effect(func)
        )
        if why is not None:
            STATS["excluded"][why.split(":")[0]] += 1
            continue
        roles[name] = {"kind": "function"}
        STATS["speculable"] += 1
    return roles


def route(compiled: Any) -> Any:
    roles = auto_roles(compiled) if MODE == "full" else None
    graph = from_langgraph(compiled, mode=MODE, roles=roles)
    STATS["graphs"] += 1
    TOTALS.append((CURRENT_FILE[0], speculation_of(graph).totals))
    return graph


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """Where the suite's speculation went: ``SPEC_TOT_LG_STATS`` names a JSON file."""
    path = os.environ.get("SPEC_TOT_LG_STATS")
    if not path:
        return
    totals: collections.Counter[str] = collections.Counter()
    per_file: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for test_file, run_totals in TOTALS:
        figures = run_totals.to_dict()
        totals.update(figures)
        per_file[test_file].update(figures)
    out = {
        "mode": MODE,
        "graphs": STATS["graphs"],
        "speculable_nodes": STATS["speculable"],
        "excluded_nodes": dict(STATS["excluded"].most_common()),
        "runs": dict(totals),
        "per_file": {
            name: {
                "launched": c["speculative"],
                "adopted": c["adopted"],
                "within_3x_adopted_plus_50": c["speculative"] <= 3 * c["adopted"] + 50,
            }
            for name, c in sorted(per_file.items())
        },
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=2)


_compile = StateGraph.compile


@functools.wraps(_compile)
def _routed_compile(self: Any, *args: Any, **kwargs: Any) -> Any:
    return route(_compile(self, *args, **kwargs))


_entrypoint_call = entrypoint.__call__


@functools.wraps(_entrypoint_call)
def _routed_entrypoint(self: Any, func: Any) -> Any:
    return route(_entrypoint_call(self, func))


if MODE in ("baseline", "full"):
    StateGraph.compile = _routed_compile  # type: ignore[method-assign]
    entrypoint.__call__ = _routed_entrypoint  # type: ignore[method-assign]
