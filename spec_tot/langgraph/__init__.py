"""Unmodified LangGraph ``StateGraph``s, run speculatively by spec-tot.

``from_langgraph(builder)`` keeps LangGraph's semantics (the graph's own node functions,
reducers, ``Send``, conditional edges, ``Command``, ``RunnableConfig`` and ``context``);
node metadata (``spec_tot.langgraph.roles``) marks what may run ahead of the superstep
barrier, and ``spec_tot.langgraph.speculation`` describes how it does.
"""

from spec_tot.langgraph.app import SpeculativeGraph, from_langgraph
from spec_tot.langgraph.results import LangGraphMetrics, LangGraphResult, TaskRecord
from spec_tot.langgraph.roles import KINDS, METADATA_KEY, NodeRole
from spec_tot.langgraph.speculation import SPECULATIVE_TAG

__all__ = [
    "KINDS",
    "METADATA_KEY",
    "SPECULATIVE_TAG",
    "LangGraphMetrics",
    "LangGraphResult",
    "NodeRole",
    "SpeculativeGraph",
    "TaskRecord",
    "from_langgraph",
]
