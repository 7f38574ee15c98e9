"""What one app's runs share: the speculation plan ``from_langgraph`` builds.

The plan holds the nodes' roles and the graph's nodes as predictions run them, the app's
speculation slots and threads, the running totals of what its runs did, and the run of
each LangGraph loop running the graph now (``run_for``: a run starts with its loop's first
task, ``spec_tot.langgraph.graph_run``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

from langchain_core.runnables import RunnableConfig

from spec_tot.langgraph._pregel import PregelLoop, PregelNode, loop_of
from spec_tot.langgraph.graph_run import GraphRun
from spec_tot.langgraph.roles import NodeRole
from spec_tot.langgraph.shared import RunTotals, SharedThreads
from spec_tot.langgraph.slots import SpeculationSlots

__all__ = ["SpeculationPlan"]


@dataclass(frozen=True, eq=False)
class SpeculationPlan:
    """What an app's runs share: the nodes' roles, whether to speculate, the slots (one
    pool per app), how deep a prediction may build on partial steps, the graph's nodes as
    given and as predictions run them (speculable ones logging into their entry), and the
    run of each loop running the graph now."""

    roles: Mapping[str, NodeRole]
    speculate: bool
    slots: SpeculationSlots
    strict: bool
    timeout_s: float | None
    base_nodes: Mapping[str, PregelNode]
    fork_nodes: dict[str, PregelNode] = field(default_factory=dict)
    threads: SharedThreads = field(init=False)
    totals: RunTotals = field(default_factory=RunTotals)
    _runs: weakref.WeakKeyDictionary[PregelLoop, GraphRun] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        object.__setattr__(self, "threads", SharedThreads(self.slots.threads))

    def forget(self, loop: PregelLoop) -> None:
        with self._lock:
            self._runs.pop(loop, None)

    def run_for(self, config: RunnableConfig | None) -> GraphRun | None:
        """The run of the loop whose task this config is (started on first sight)."""
        loop = loop_of(config)
        if loop is None:
            return None
        run = self._runs.get(loop)
        if run is None:
            with self._lock:
                run = self._runs.get(loop)
                if run is None:
                    run = self._runs[loop] = GraphRun.bind(self, loop)
        return run
