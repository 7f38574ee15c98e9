"""Each rule in one home: only ``SearchTree`` (``spec_tot/tree.py``) assigns a node's fields,
and no module but the dispatcher decides a speculative launch.

The node check runs real searches (every policy, every speculative mode, arbitrary
schedules) with a guard on ``Node.__setattr__`` that names any other writer; the launch
check reads the source for the comparisons a launch decision is made of.
"""

from __future__ import annotations

import ast
import asyncio
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from spec_helpers import POLICIES, SPEC_MODES, LatencyBackend, inputs, make_app, tick_fn, toy_graph

from spec_tot.adapters.scripted import ScriptedConfig
from spec_tot.tree_node import Node

ROOT = Path(__file__).resolve().parents[2]
_OWNERS = ("spec_tot/tree.py", "spec_tot/tree_node.py")  # the tree, and the dataclass's own init


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every assignment to a node field from outside the tree, as 'file:line field'."""
    intruders: list[str] = []
    plain = object.__setattr__

    def guard(node: Node, name: str, value: Any) -> None:
        frame = sys._getframe(1)
        caller = frame.f_code.co_filename.replace("\\", "/")
        made = frame.f_code.co_name == "__init__" and caller == "<string>"  # the dataclass's
        if not made and not caller.endswith(_OWNERS):
            intruders.append(f"{caller}:{frame.f_lineno} {name}")
        plain(node, name, value)

    monkeypatch.setattr(Node, "__setattr__", guard)
    return intruders


@pytest.mark.parametrize("policy", list(POLICIES))
def test_only_the_tree_assigns_node_fields(policy: str, guarded: list[str]) -> None:
    async def main() -> None:
        for mode in ("baseline", *SPEC_MODES):
            config = ScriptedConfig(seed=3, straggler_rate=0.3, mean_tokens=8, score_levels=3)
            backend = LatencyBackend(
                config, gen_latency=tick_fn(1, 12), reward_latency=tick_fn(2, 4)
            )
            graph = toy_graph(reward_dependent=True)
            app = make_app(backend, policy, mode, graph=graph, seed=1)
            batch = await app.arun_batch(inputs("q0", "q1"))
            assert all(r.status == "ok" for r in batch.results), mode

    asyncio.run(main())
    assert guarded == []


# What a launch decision is made of: a room, a value, a cap or a could-pay compared by the
# client itself. Only the dispatcher's modules may hold such a comparison.
_DECISIONS = re.compile(
    r"\.room\(\)\s*[<>]|\.value\([^)]*\)\s*[<>]|could_pay\(|max_speculative_per_query\s*[-<>]"
    r"|max_spec_depth\s*[<>]|speculative_generating\(\)\s*>=|>=\s*[\w.]*\blimit\b|max_cpu_share\s*[<>]"
    r"|lag_s\s*[<>]|<\s*limit\b|[<>]=?\s*[\w.]*(max_spec_depth|max_cpu_share|max_lag_s)\b"
    r"|min\([^)]*\.room\(\)"
)
_DISPATCHER = ("spec_tot/executor/dispatcher.py",)


def test_no_launch_decision_outside_the_dispatcher() -> None:
    found = []
    for path in sorted((ROOT / "spec_tot").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in _DISPATCHER:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _DECISIONS.search(code):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert found == []


# An HTTP worker's figures have one owner each: ``Endpoint`` (``adapters/http/endpoint.py``)
# and its ``CircuitBreaker`` (``breaker.py``). Others call their methods.
_HOMES = {"adapters/http/endpoint.py", "adapters/http/breaker.py"}
_MUTATORS = {"pop", "clear", "update", "setdefault", "popitem", "append", "remove"}


def _owned_fields() -> set[str]:
    from dataclasses import fields

    from spec_tot.adapters.http.breaker import CircuitBreaker
    from spec_tot.adapters.http.endpoint import Endpoint

    return {f.name for cls in (Endpoint, CircuitBreaker) for f in fields(cls)}


def _foreign_writes(tree: ast.AST, owned: set[str]) -> list[tuple[int, str]]:
    """``(line, field)`` of each write to ``x.field`` (assigned, augmented, its item set or
    deleted, or mutated in place) where ``x`` is not ``self``: another object's state."""

    def foreign(node: ast.AST) -> str | None:
        if isinstance(node, ast.Attribute) and node.attr in owned:
            base = node.value
            if not (isinstance(base, ast.Name) and base.id == "self"):
                return node.attr
        return None

    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS
        ):
            targets = [node.func.value]
        for target in targets:
            for part in ast.walk(target) if isinstance(target, ast.Tuple) else [target]:
                while isinstance(part, ast.Subscript):
                    part = part.value
                name = foreign(part)
                if name is not None:
                    found.append((node.lineno, name))
    return found


def test_no_module_but_the_endpoints_own_writes_an_endpoint_field() -> None:
    """Issue 53: the pool, the prober and the queue reader change a worker's figures
    through ``Endpoint``'s methods only (as ``SearchTree`` owns its nodes)."""
    owned = _owned_fields()
    assert {"inflight", "pending", "reported_queue", "probing"} <= owned
    found = []
    for folder in ("spec_tot", "adapters", "graphs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in _HOMES:
                continue
            for line, name in _foreign_writes(ast.parse(path.read_text()), owned):
                found.append(f"{rel}:{line} {name}")
    assert found == []


def test_the_ownership_check_sees_each_kind_of_write() -> None:
    source = """
endpoint.inflight += 1
e.pending[timer] = 3
e.breaker.probing = False
x.pending.pop(t, None)
a, b.reported_queue = 1, 2
self.inflight = 0
self.pending[k] = 1
"""
    found = _foreign_writes(ast.parse(source), _owned_fields())
    assert sorted(found) == [
        (2, "inflight"), (3, "pending"), (4, "probing"), (5, "pending"), (6, "reported_queue")
    ]  # fmt: skip
