"""spec-tot: fast Tree-of-Thought reasoning.

Write a ToT program as a ``ThoughtGraph`` (thought, reward, tool and function nodes), compile
it with a search policy and a backend, and run it as a langchain_core Runnable.
"""

from spec_tot.app import BatchResult, ToTApp, ToTResult
from spec_tot.backends import GenerationBackend, RewardBackend
from spec_tot.config import ExecutorConfig
from spec_tot.graph import END, START, ThoughtGraph
from spec_tot.langgraph import from_langgraph
from spec_tot.policies import SearchPolicy, create_policy
from spec_tot.requests import RewardItem, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "END",
    "START",
    "BatchResult",
    "ExecutorConfig",
    "GenerationBackend",
    "RewardBackend",
    "RewardItem",
    "SamplingParams",
    "SearchPolicy",
    "ThoughtGraph",
    "ToTApp",
    "ToTResult",
    "__version__",
    "create_policy",
    "from_langgraph",
]
