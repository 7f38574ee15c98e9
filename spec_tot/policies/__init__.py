"""Search policies, one small file each, dispatched by name (see ``base`` for the contract)."""

from __future__ import annotations

import inspect
from typing import Any

from spec_tot.errors import ConfigError, UnknownNameError
from spec_tot.plugins import declared, load_target
from spec_tot.policies.base import Answer, Candidate, Expansion, SearchPolicy

__all__ = [
    "POLICY_ENTRY_POINTS",
    "POLICY_NAMES",
    "Answer",
    "Candidate",
    "Expansion",
    "SearchPolicy",
    "create_policy",
    "policy_names",
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


POLICY_ENTRY_POINTS = "spec_tot.policies"


def _plugins() -> dict[str, str]:
    """Policies that installed distributions declare as entry points (``spec_tot.policies``;
    value: ``"module:Class"`` or a factory). A plug-in cannot shadow a built-in name."""
    return declared(POLICY_ENTRY_POINTS, _POLICIES)


def policy_names() -> list[str]:
    """Every policy ``create_policy`` knows: the built-in ones and the plug-ins."""
    return sorted({*_POLICIES, *_plugins()})


def create_policy(name: str, **params: Any) -> SearchPolicy:
    """A fresh policy instance (policies hold per-query state: make one per query).

    ``name`` is a built-in policy or one a plug-in declares as an entry point in the group
    ``spec_tot.policies``; ``compile(search="name")`` and the CLI both come here, so they see
    the same policies (no module-global state: the entry points are what is installed). An
    unknown parameter or a value of the wrong type is a ``ConfigError`` naming the parameter
    and the policy.
    """
    target = _POLICIES.get(name) or _plugins().get(name)
    if target is None:
        raise UnknownNameError("search policy", name, policy_names())
    factory = load_target(target)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C factory: let the call check
        signature = None
    if signature is not None and not any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
    ):
        known = [p for p in signature.parameters if p != "self"]
        for key in params:
            if key not in known:
                raise ConfigError(
                    key, f"unknown parameter of policy {name!r}; known: {', '.join(known)}"
                )
    try:
        policy = factory(**params)
    except ConfigError as exc:
        message = str(exc).split(": ", 1)[-1]
        raise ConfigError(exc.field, f"{message} (policy {name!r})") from exc
    except TypeError as exc:  # a value the policy's own checks did not catch
        raise ConfigError("search_params", f"policy {name!r}: {exc}") from exc
    if not isinstance(policy, SearchPolicy):
        raise ConfigError("search", f"{target!r} made {type(policy).__name__}, not a SearchPolicy")
    return policy
