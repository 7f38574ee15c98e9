"""spec-tot: fast Tree-of-Thought reasoning.

Write a ToT program as a ``ThoughtGraph`` (thought, reward, tool and function nodes), compile
it with a search policy and a backend, and run it as a langchain_core Runnable.
"""

from typing import TYPE_CHECKING, Any

from spec_tot.app import BatchResult, ToTApp, ToTResult
from spec_tot.backends import BackendRegistry, GenerationBackend, RewardBackend, default_registry
from spec_tot.config import ExecutorConfig
from spec_tot.graph import END, START, ThoughtGraph
from spec_tot.policies import SearchPolicy, create_policy, policy_names
from spec_tot.requests import RewardItem, SamplingParams

__version__ = "0.1.0"

if TYPE_CHECKING:
    from spec_tot.chat_model import ToTChatModel
    from spec_tot.chat_spec_tot import ChatSpecTot
    from spec_tot.langgraph import from_langgraph

# The LangChain adapters, imported on first use (the core never imports an adapter when it
# is itself imported), and the LangGraph/LangChain chat-model parts: importing spec_tot does
# not import langgraph or LangChain's chat models until one of these is used.
_ADAPTERS = {
    "LangChainBackend": "spec_tot.adapters.langchain",
    "RunnableReward": "spec_tot.adapters.langchain",
    "add_tool": "spec_tot.adapters.langchain",
    "tool_node": "spec_tot.adapters.langchain",
    "ToTChatModel": "spec_tot.chat_model",
    "ChatSpecTot": "spec_tot.chat_spec_tot",
    "from_langgraph": "spec_tot.langgraph",
}


def __getattr__(name: str) -> Any:
    if name in _ADAPTERS:
        import importlib

        return getattr(importlib.import_module(_ADAPTERS[name]), name)
    raise AttributeError(f"module 'spec_tot' has no attribute {name!r}")


__all__ = [
    "END",
    "START",
    "BackendRegistry",
    "BatchResult",
    "ChatSpecTot",
    "ExecutorConfig",
    "GenerationBackend",
    "LangChainBackend",
    "RewardBackend",
    "RewardItem",
    "RunnableReward",
    "SamplingParams",
    "SearchPolicy",
    "ThoughtGraph",
    "ToTApp",
    "ToTChatModel",
    "ToTResult",
    "__version__",
    "add_tool",
    "create_policy",
    "default_registry",
    "from_langgraph",
    "policy_names",
    "tool_node",
]
