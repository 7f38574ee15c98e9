"""What the controller and the branch runner of one query share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spec_tot._private.compiled import CompiledGraph
from spec_tot.backends import GenerationBackend
from spec_tot.config import ExecutorConfig, Speculation
from spec_tot.events import EventKind, EventSink, ToTEvent
from spec_tot.executor.dispatcher import Dispatcher
from spec_tot.executor.reward_router import RewardRouter
from spec_tot.graph_nodes import State
from spec_tot.metrics import MetricsRecorder
from spec_tot.policies.base import SearchPolicy
from spec_tot.seeds import seed_below
from spec_tot.tree import Node, SearchTree

__all__ = ["QueryContext"]


@dataclass(eq=False)
class QueryContext:
    """One query's search: its tree and policy, and the run-wide services it uses."""

    graph: CompiledGraph
    tree: SearchTree
    policy: SearchPolicy
    backend: GenerationBackend
    rewards: RewardRouter
    recorder: MetricsRecorder
    config: ExecutorConfig
    answer_fn: Callable[[State], str | None]
    seed: int  # the query's base seed: every request's seed derives from it and the node id
    # The backend's speculation dispatcher: it sees every request on the backend and
    # admits every speculative launch (priced by T2 only when ``spec.budget`` is on).
    dispatcher: Dispatcher
    on_event: EventSink | None = None
    errors: list[str] = field(default_factory=list)
    closed: bool = False
    # Whether this query could speculate now (the controller's rule): a walk ahead of the
    # score, and an early score, are worth their cost only then.
    steering: Callable[[], bool] = lambda: True

    @property
    def spec(self) -> Speculation:
        return self.config.speculation

    @property
    def query_id(self) -> str:
        return self.tree.query_id

    def request_seed(self, request_id: str) -> int:
        """The seed of a request: the query's seed and the request's path below the root
        (never the query id itself, which may be auto-assigned)."""
        return seed_below(self.seed, self.tree.query_id, request_id)

    def emit(self, kind: EventKind, node: Node | None, **data: Any) -> None:
        if self.on_event is not None:
            self.on_event(
                ToTEvent(
                    kind,
                    self.tree.query_id,
                    node.id if node is not None else None,
                    node.speculative if node is not None else False,
                    data,
                )
            )
