"""OpenAI-compatible completions backend (vLLM, SGLang, others), plus vLLM PRM rewards.

``backend`` holds the backend and what it relies on in the protocol; ``protocol`` reads its
replies (and the token budget of its requests, for the shared pool's deadlines) and vLLM's
speculative-decoding counters; ``rewards`` scores over ``/pooling`` or a generative judge.
"""

from __future__ import annotations

from .backend import OpenAICompatBackend, create_openai
from .config import QWEN_PRM_TEMPLATE, OpenAIConfig
from .protocol import OPENAI_WIRE, parse_vllm_speculation

__all__ = [
    "OPENAI_WIRE",
    "QWEN_PRM_TEMPLATE",
    "OpenAICompatBackend",
    "OpenAIConfig",
    "create_openai",
    "parse_vllm_speculation",
]
