"""The speculative executor.

- ``run_queries``: a batch of queries on one backend (``RunSpec``: what it needs of an app);
- ``controller``: one ``QueryController`` per query (commit, adopt, speculate, prune);
- ``branch_runner``: the ``BranchRunner`` of a query (segments, generation, tools);
- ``segment``: one branch's walk from a node to its next reward edge;
- ``dispatcher``: SPEX T2, the one speculation rule (a ``Dispatcher`` per backend);
- ``gain_loop``: how many speculative sequences a dispatcher admits, set by measured gain;
- ``hub``: ``hub_for(backend)``, what every app, batch and call on one backend shares (its
  dispatcher, its reward router per event loop, the query ids running on it);
- ``reward_router``: the ``RewardRouter`` (queues per rule, batches run);
- ``reward_rules``: when waiting items are scored (round, eager, lazy = SpecScale LV);
- ``reward_calls``: one scorer call per batch, split per query when it fails or hangs;
- ``reward_scorer``: calling one scorer and checking each score it returns;
- ``pruning``: SpecScale's EP threshold and SPEX T3 early termination;
"""

from __future__ import annotations

from spec_tot.executor.context import QueryContext
from spec_tot.executor.controller import QueryController, QueryOutcome, record_for
from spec_tot.executor.dispatcher import ClientRules, Dispatcher, Offer
from spec_tot.executor.gain_loop import GainLoopConfig
from spec_tot.executor.hub import BackendHub, hub_for
from spec_tot.executor.reward_router import RewardRouter, calibrated_lv
from spec_tot.executor.reward_scorer import call_scorer, check_score

__all__ = [
    "BackendHub",
    "ClientRules",
    "Dispatcher",
    "GainLoopConfig",
    "Offer",
    "QueryContext",
    "QueryController",
    "QueryOutcome",
    "RewardRouter",
    "calibrated_lv",
    "call_scorer",
    "check_score",
    "hub_for",
    "record_for",
]
