"""The SGLang backend's merged requests: identical pending requests travel as one wire
request (one ``WireGroup``), each caller a ``Member`` owning a slice of its samples."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spec_tot.requests import Completion, FinishReason, GenerateRequest, GenerateResult

__all__ = ["Member", "WireGroup", "aborted_result"]


def aborted_result(request: GenerateRequest) -> GenerateResult:
    """The answer of a request aborted before any output: n empty aborted completions."""
    comps = tuple(Completion("", finish_reason=FinishReason.ABORT) for _ in range(request.n))
    return GenerateResult(request.request_id, comps)


@dataclass(eq=False)
class Member:
    """One caller's request inside a wire request."""

    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    offset: int = 0
    aborted: bool = False


@dataclass(eq=False)
class WireGroup:
    """One wire request: identical pending requests merged into one with n = sum of n."""

    key: Any
    wire: str
    members: list[Member] = field(default_factory=list)
    n: int = 0
    endpoint: str | None = None
    task: asyncio.Task[None] | None = None
    open: bool = True
    aborted: bool = False
    progress: dict[int, int] = field(default_factory=dict)  # sample -> tokens so far
    rids: list[str] = field(default_factory=list)  # one server rid per sample, once sent

    def live(self) -> list[Member]:
        return [m for m in self.members if not m.future.done()]

    def sample_rids(self, members: Sequence[Member] | None = None) -> list[str]:
        """The server rids of these members' samples (all samples by default)."""
        if members is None:
            return list(self.rids)
        return [r for m in members for r in self.rids[m.offset : m.offset + m.request.n]]
