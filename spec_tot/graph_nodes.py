"""The node vocabulary of a ToT graph: ``START``, ``END``, ``State``, node kinds, and the
frozen ``GraphNode`` / ``ConditionalEdge`` records.

A leaf module: the builder (``spec_tot.graph``), the compiler and the executor all import it,
and it imports nothing of theirs, so the core has no import cycle.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from spec_tot.requests import RewardItem, SamplingParams

if TYPE_CHECKING:
    from spec_tot.backends import RewardBackend

__all__ = [
    "END",
    "START",
    "ConditionalEdge",
    "FunctionFn",
    "GraphNode",
    "GraphParts",
    "NodeKind",
    "ParseFn",
    "PromptFn",
    "RouterFn",
    "ScoreFn",
    "State",
    "ToolFn",
    "Update",
    "append_step",
    "default_reward_item",
]

START = "__start__"
END = "__end__"

State = dict[str, Any]
Update = Mapping[str, Any] | None
PromptFn = Callable[[State], str]
ParseFn = Callable[[State, str], Update]
FunctionFn = Callable[[State], Update]
ToolFn = Callable[[State], Update | Awaitable[Update]]
RouterFn = Callable[[State], Hashable]
ScoreFn = Callable[[Sequence[RewardItem]], Any]


class NodeKind(Enum):
    THOUGHT = "thought"
    REWARD = "reward"
    TOOL = "tool"
    FUNCTION = "function"


def append_step(state: State, text: str) -> Update:
    return {"steps": [*state.get("steps", ()), text.strip()]}


def default_reward_item(state: State) -> tuple[str, tuple[str, ...]]:
    return str(state.get("question", "")), tuple(state.get("steps", ()))


@dataclass(frozen=True, slots=True)
class GraphNode:
    """One node of the graph. Only the fields of its ``kind`` are set."""

    name: str
    kind: NodeKind
    prompt: PromptFn | None = None
    sampling: SamplingParams | None = None
    parse: ParseFn | None = None
    fn: FunctionFn | ToolFn | None = None
    scorer: RewardBackend | ScoreFn | None = None
    reward_input: Callable[[State], tuple[str, tuple[str, ...]]] | None = None
    speculable: bool = True
    pure: bool = False
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ConditionalEdge:
    router: RouterFn
    # router result -> node name; None means the router returns node names itself.
    path_map: Mapping[Hashable, str] | None

    def targets(self) -> list[str]:
        return list(self.path_map.values()) if self.path_map is not None else []


class GraphParts(Protocol):
    """What the compiler and validator read of a graph builder (``ThoughtGraph``): they
    take this, not the builder, so the builder may import them."""

    @property
    def nodes(self) -> Mapping[str, GraphNode]: ...
    @property
    def edges(self) -> Mapping[str, list[str]]: ...
    @property
    def branches(self) -> Mapping[str, ConditionalEdge]: ...
