"""Shared fixtures and helpers for the core tests (graph, runtime, app, metrics)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.backends import GenerationBackend
from spec_tot.requests import Capabilities, GenerateRequest, GenerateResult, RewardItem

# Triton kernels run on CPU only through its interpreter, which Triton fixes when it is first
# imported: set it before anything imports triton, and only where no GPU could run them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


class RecordingBackend(ScriptedBackend):
    """A ScriptedBackend that remembers every request id, abort prefix and event loop."""

    def __init__(self, config: ScriptedConfig | None = None) -> None:
        super().__init__(config or ScriptedConfig())
        self.request_ids: list[str] = []
        self.abort_prefixes: list[str] = []
        self.loops: set[int] = set()
        self.score_batches: list[list[str]] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.request_ids.append(request.request_id)
        self.loops.add(id(asyncio.get_running_loop()))
        return await super().generate(request)

    async def abort(self, prefix: str) -> int:
        self.abort_prefixes.append(prefix)
        return await super().abort(prefix)

    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        self.score_batches.append([i.request_id for i in items])
        return await super().score(items)


class GenerateOnlyBackend(GenerationBackend):
    """A generation backend that cannot score (not a RewardBackend)."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="gen-only")

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        raise AssertionError("not used")

    async def abort(self, prefix: str) -> int:
        return 0

    @property
    def num_inflight(self) -> int:
        return 0


class RecordingScorer:
    """A plain callable reward (sync) that records each batch's item ids and delegates the
    scores to a ScriptedBackend's deterministic ``step_score``."""

    def __init__(self, backend: ScriptedBackend) -> None:
        self.backend = backend
        self.batches: list[list[str]] = []

    def __call__(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        self.batches.append([i.request_id for i in items])
        return [
            tuple(
                self.backend.step_score(i.question, i.steps[: k + 1]) for k in range(len(i.steps))
            )
            for i in items
        ]


def query_of(node_id: str) -> str:
    return node_id.split("/", 1)[0]


def tree_texts(result: Any) -> dict[str, tuple[str, float | None]]:
    """Node id -> (text, reward) of every non-root node of a result's tree."""
    return {n.id: (n.text, n.reward) for n in result.tree.nodes() if n.parent is not None}


@pytest.fixture
def backend() -> RecordingBackend:
    return RecordingBackend()
