"""Search policies, one small file each, dispatched by name (see ``base`` for the contract)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from spec_tot.errors import ConfigError, UnknownNameError
from spec_tot.policies.base import Answer, Candidate, Expansion, SearchPolicy

__all__ = [
    "POLICY_NAMES",
    "Answer",
    "Candidate",
    "Expansion",
    "SearchPolicy",
    "create_policy",
]

# name -> "module:Class"; modules import lazily so a policy's dependencies (scipy for ETS)
# cost nothing until it is used.
_POLICIES: dict[str, str] = {
    "best_of_n": "spec_tot.policies.best_of_n:BestOfN",
    "beam": "spec_tot.policies.beam:BeamSearch",
    "dvts": "spec_tot.policies.dvts:DVTS",
    "rebase": "spec_tot.policies.rebase:Rebase",
    "ets": "spec_tot.policies.ets:ETS",
    "mcts": "spec_tot.policies.mcts:MCTS",
    "rstar": "spec_tot.policies.mcts:RStarMCTS",
    "rest_mcts": "spec_tot.policies.rest_mcts:RestMCTS",
    "tot_bfs": "spec_tot.policies.tot_bfs:ToTBFS",
    "tot_dfs": "spec_tot.policies.tot_dfs:ToTDFS",
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def create_policy(name: str, **params: Any) -> SearchPolicy:
    """A fresh policy instance (policies hold per-query state: make one per query). An
    unknown parameter or a value of the wrong type is a ``ConfigError`` naming the
    parameter and the policy."""
    target = _POLICIES.get(name)
    if target is None:
        raise UnknownNameError("search policy", name, list(_POLICIES))
    module_name, _, cls_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    known = [p for p in inspect.signature(cls).parameters if p != "self"]
    for key in params:
        if key not in known:
            raise ConfigError(
                key, f"unknown parameter of policy {name!r}; known: {', '.join(known)}"
            )
    try:
        policy: SearchPolicy = cls(**params)
    except ConfigError as exc:
        message = str(exc).split(": ", 1)[-1]
        raise ConfigError(exc.field, f"{message} (policy {name!r})") from exc
    except TypeError as exc:  # a value the policy's own checks did not catch
        raise ConfigError("search_params", f"policy {name!r}: {exc}") from exc
    return policy
