"""LangGraph graphs run by LangGraph's own loop, with spec-tot's speculation beside it.

``from_langgraph(graph)`` returns a copy of the compiled graph (still a LangGraph graph:
every LangGraph feature works as LangGraph runs it); node metadata
(``spec_tot.langgraph.roles``) marks what may run ahead of the superstep barrier, and
``spec_tot.langgraph.speculation`` describes how it does.
"""

from spec_tot.langgraph._pregel import SUPPORTED_VERSIONS
from spec_tot.langgraph.app import arun, from_langgraph, run, speculation_of
from spec_tot.langgraph.results import LangGraphMetrics, LangGraphResult, TaskRecord
from spec_tot.langgraph.roles import KINDS, METADATA_KEY, NodeRole

__all__ = [
    "KINDS",
    "METADATA_KEY",
    "SUPPORTED_VERSIONS",
    "LangGraphMetrics",
    "LangGraphResult",
    "NodeRole",
    "TaskRecord",
    "arun",
    "from_langgraph",
    "run",
    "speculation_of",
]
