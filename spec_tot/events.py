"""Search events, emitted as they happen (streaming, progress, visualisation)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["EventKind", "EventSink", "ToTEvent"]

EventKind = Literal["expanded", "scored", "pruned", "speculative_hit", "cancelled", "answer"]


@dataclass(frozen=True, slots=True)
class ToTEvent:
    """``expanded``: a node was created (committed or speculative); ``scored``: its reward is
    known; ``pruned``: early pruning dropped it; ``speculative_hit``: a speculative node was
    adopted; ``cancelled``: it was aborted; ``answer``: the query finished (node_id is the
    answer node, data has the answer text and score)."""

    kind: EventKind
    query_id: str
    node_id: str | None
    speculative: bool = False
    data: Mapping[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        """The event as the dict that LangChain custom events and LangGraph's ``custom``
        stream carry (its kind is the event's name there)."""
        return {
            "query_id": self.query_id,
            "node_id": self.node_id,
            "speculative": self.speculative,
            **self.data,
        }


EventSink = Callable[[ToTEvent], None]
