"""The speculative executor.

- ``controller``: one ``QueryController`` per query (commit, adopt, speculate, prune);
- ``branch``: the ``BranchRunner`` of a query (segments, generation, tools);
- ``budget``: the SPEX T2 ``SpeculationBudget``;
- ``rewards`` and ``batching``: the ``RewardRouter`` and its batch rules (round, eager, lazy);
- ``pruning``: SpecScale's EP threshold and SPEX T3 early termination.
"""

from __future__ import annotations

from spec_tot.executor.budget import SpeculationBudget
from spec_tot.executor.context import QueryContext
from spec_tot.executor.controller import QueryController, QueryOutcome, record_for
from spec_tot.executor.rewards import RewardRouter, calibrated_lv, call_scorer

__all__ = [
    "QueryContext",
    "QueryController",
    "QueryOutcome",
    "RewardRouter",
    "SpeculationBudget",
    "calibrated_lv",
    "call_scorer",
    "record_for",
]
