"""Node metadata: what may run ahead of its superstep.

Every key lives under ``metadata={"spec_tot": {...}}`` of ``StateGraph.add_node``:

- ``kind``: ``thought`` (an LLM call), ``reward`` (a scorer), ``select`` (a fan-in that
  chooses, such as the ToT tutorial's ``prune``), ``function`` (a pure transform) or
  ``tool`` (side effects). The first four are pure by default; ``tool`` is not.
- ``pure``: overrides the kind's default. A pure node's writes depend only on its input and
  the run's context, it changes nothing outside them (no tool calls, no in-place mutation of
  its input), and so do the routers of its conditional edges.
- ``reads``: the input keys a pure node's writes depend on. A speculative run is adopted
  when the real task's input equals its input on these keys (default: the whole input).
- ``top_k`` (select only): it keeps the best candidates of its pool by a ranking that does
  not depend on the rest of the pool, so a ``Send`` it drops on a partial pool it never
  emits on the whole pool: the runner cancels such branches at once (strict early pruning).

Nodes without metadata run on committed paths only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spec_tot.errors import GraphValidationError

__all__ = ["KINDS", "METADATA_KEY", "NodeRole", "roles_of"]

METADATA_KEY = "spec_tot"
KINDS = ("thought", "reward", "select", "function", "tool")
_PURE_BY_DEFAULT = frozenset({"thought", "reward", "select", "function"})
_KEYS = frozenset({"kind", "pure", "reads", "top_k"})
# Keys of the former contract, in which spec-tot generated instead of calling the node.
_RETIRED = frozenset({"prompt", "parse", "sampling", "scorer", "reward_input", "fn", "terminal"})


@dataclass(frozen=True, slots=True)
class NodeRole:
    name: str
    kind: str | None = None
    pure: bool = False
    reads: tuple[str, ...] | None = None
    top_k: bool = False

    @property
    def select(self) -> bool:
        return self.kind == "select"


def _role(name: str, metadata: Mapping[str, Any] | None) -> NodeRole:
    spec = (metadata or {}).get(METADATA_KEY)
    if spec is None:
        return NodeRole(name)
    if not isinstance(spec, Mapping):
        raise GraphValidationError(name, f"metadata[{METADATA_KEY!r}] must be a dict")
    retired = sorted(set(spec) & _RETIRED)
    if retired:
        raise GraphValidationError(
            name,
            f"metadata keys {retired} are not used any more: spec-tot runs the node's own "
            "function; mark it with kind/pure/reads/top_k only",
        )
    unknown = sorted(set(spec) - _KEYS)
    if unknown:
        raise GraphValidationError(name, f"unknown metadata keys {unknown}; known: {sorted(_KEYS)}")
    kind = spec.get("kind")
    if kind is not None and kind not in KINDS:
        raise GraphValidationError(name, f"metadata kind {kind!r} is not one of {KINDS}")
    pure = spec.get("pure", kind in _PURE_BY_DEFAULT)
    if not isinstance(pure, bool):
        raise GraphValidationError(name, f"metadata pure must be True or False, got {pure!r}")
    reads = spec.get("reads")
    if reads is not None:
        if isinstance(reads, str) or not all(isinstance(k, str) for k in reads):
            raise GraphValidationError(name, f"metadata reads must be a list of keys: {reads!r}")
        reads = tuple(reads)
        if not pure:
            raise GraphValidationError(name, "metadata reads only applies to pure nodes")
    top_k = spec.get("top_k", False)
    if not isinstance(top_k, bool):
        raise GraphValidationError(name, f"metadata top_k must be True or False, got {top_k!r}")
    if top_k and kind != "select":
        raise GraphValidationError(name, "metadata top_k applies to kind 'select' only")
    if kind == "select" and not pure:
        raise GraphValidationError(name, "a select node is predicted on partial pools: pure")
    return NodeRole(name, kind, pure, reads, top_k)


def roles_of(
    nodes: Mapping[str, Any], overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, NodeRole]:
    """The role of every node of a compiled graph, from its metadata or from
    ``overrides`` (the same keys, by node name; errors name the node)."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(nodes))
    if unknown:
        raise GraphValidationError(unknown[0], f"no such node; the graph has {sorted(nodes)}")
    roles: dict[str, NodeRole] = {}
    for name, node in nodes.items():
        if name in overrides:
            roles[name] = _role(name, {METADATA_KEY: overrides[name]})
        else:
            roles[name] = _role(name, getattr(node, "metadata", None))
        if roles[name].pure and getattr(node, "subgraphs", None):
            raise GraphValidationError(
                name,
                "runs a subgraph (it has its own checkpoints and streams): it runs on the "
                "real path only; drop its spec_tot metadata or mark it kind 'tool'",
            )
    return roles
