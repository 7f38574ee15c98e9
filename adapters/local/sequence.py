"""Request and sequence state.

A *physical* ``Sequence`` is what the model runs: one row of the batch, one block table. It
carries one or more logical ``Member``s (CD): samples whose token histories are identical so
far. Every member owns its ``torch.Generator``; members move between sequences when a
sequence forks, so a member's draws never depend on who it shared a forward pass with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from spec_tot.requests import Completion, FinishReason, GenerateResult, Priority, SamplingParams

__all__ = ["DetokState", "Member", "RequestState", "Sequence", "SequenceStatus", "member_seed"]

_MASK63 = (1 << 63) - 1


def member_seed(request_seed: int, index: int) -> int:
    """Seed of member ``index`` of a request: a fixed mix of both, independent of batching."""
    return ((request_seed & _MASK63) * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _MASK63


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class RequestState:
    """One accepted request: its ``n`` completion slots fill as members finish."""

    request_id: str
    params: SamplingParams
    prompt_ids: tuple[int, ...]
    priority: Priority
    completions: list[Completion | None]
    cached_prompt_tokens: int = 0
    num_done: int = 0

    @property
    def finished(self) -> bool:
        return self.num_done == len(self.completions)

    def result(self) -> GenerateResult:
        done = tuple(c for c in self.completions if c is not None)
        return GenerateResult(
            self.request_id, done, len(self.prompt_ids), self.cached_prompt_tokens
        )


@dataclass(slots=True, eq=False)
class Member:
    """One logical sample: completion slot ``index`` of ``request``."""

    request: RequestState
    index: int
    generator: torch.Generator | None  # None for greedy requests: no draws
    target_len: int = 0  # synthetic workload: stop after this many tokens (0 = off)


@dataclass(slots=True)
class DetokState:
    """Incremental detokenization (decode a window, emit the stable suffix)."""

    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    params: SamplingParams
    priority: Priority
    arrival: int  # FIFO order within a priority class (forks inherit it)
    members: list[Member]
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    num_cached_tokens: int = 0  # of those, found by prefix caching at admission
    detok: DetokState = field(default_factory=DetokState)
    stop_text: str | None = None  # text truncated at a stop string, once found

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def fork(self, seq_id: int, members: list[Member]) -> Sequence:
        """A child sharing everything so far (the block table is shared by the caller)."""
        return Sequence(
            seq_id=seq_id,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            params=self.params,
            priority=self.priority,
            arrival=self.arrival,
            members=members,
            status=self.status,
            block_table=list(self.block_table),
            num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            detok=DetokState(self.detok.text, self.detok.prefix_offset, self.detok.read_offset),
        )


def finish_member(member: Member, text: str, token_ids: list[int], reason: FinishReason) -> bool:
    """Record a member's completion; True when its request is now complete."""
    req = member.request
    if req.completions[member.index] is None:
        req.completions[member.index] = Completion(text, tuple(token_ids), len(token_ids), reason)
        req.num_done += 1
    return req.finished
