"""spec-tot: fast Tree-of-Thought reasoning.

Write a ToT program as a ``ThoughtGraph`` (thought, reward, tool and function nodes), compile
it with a search policy and a backend, and run it as a langchain_core Runnable.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from spec_tot.adapters.langchain import LangChainBackend, RunnableReward, add_tool, tool_node
    from spec_tot.app import BatchResult, ToTApp, ToTResult
    from spec_tot.backends import (
        BackendRegistry,
        GenerationBackend,
        RewardBackend,
        default_registry,
    )
    from spec_tot.chat_model import ToTChatModel
    from spec_tot.chat_spec_tot import ChatSpecTot
    from spec_tot.config import ExecutorConfig
    from spec_tot.drafting import DraftContext, Drafter
    from spec_tot.graph import END, START, ThoughtGraph
    from spec_tot.langgraph import from_langgraph
    from spec_tot.policies import SearchPolicy, create_policy, policy_names
    from spec_tot.requests import RewardItem, SamplingParams

# Every public name is imported on first use: importing spec_tot (or any of its modules,
# which runs this file first) stays cheap, so a process that needs only a corner of the
# package, such as the embedded engine's own process, never pays for LangChain (~1 s). The
# core still never imports an adapter when it is itself imported, and langgraph and
# LangChain's chat models load only when one of their names is used.
_LAZY = {
    "BatchResult": "spec_tot.app",
    "ToTApp": "spec_tot.app",
    "ToTResult": "spec_tot.app",
    "BackendRegistry": "spec_tot.backends",
    "GenerationBackend": "spec_tot.backends",
    "RewardBackend": "spec_tot.backends",
    "default_registry": "spec_tot.backends",
    "ExecutorConfig": "spec_tot.config",
    "DraftContext": "spec_tot.drafting",
    "Drafter": "spec_tot.drafting",
    "END": "spec_tot.graph",
    "START": "spec_tot.graph",
    "ThoughtGraph": "spec_tot.graph",
    "SearchPolicy": "spec_tot.policies",
    "create_policy": "spec_tot.policies",
    "policy_names": "spec_tot.policies",
    "RewardItem": "spec_tot.requests",
    "SamplingParams": "spec_tot.requests",
    "LangChainBackend": "spec_tot.adapters.langchain",
    "RunnableReward": "spec_tot.adapters.langchain",
    "add_tool": "spec_tot.adapters.langchain",
    "tool_node": "spec_tot.adapters.langchain",
    "ToTChatModel": "spec_tot.chat_model",
    "ChatSpecTot": "spec_tot.chat_spec_tot",
    "from_langgraph": "spec_tot.langgraph",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'spec_tot' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "END",
    "START",
    "BackendRegistry",
    "BatchResult",
    "ChatSpecTot",
    "DraftContext",
    "Drafter",
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
