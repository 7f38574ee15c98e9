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

from spec_tot.requests import (
    Completion,
    FinishReason,
    GenerateResult,
    Priority,
    SamplingParams,
    TokenLogprob,
)

__all__ = [
    "DetokState",
    "Member",
    "RequestState",
    "ScheduledRow",
    "Sequence",
    "SequenceStatus",
]

# Uniforms drawn per refill of a member's buffer: ``torch.rand(k)`` yields exactly the values
# of k successive ``torch.rand(1)`` calls, so the stream is the same, at 1/k of the calls.
_UNIFORM_BLOCK = 32


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
    stream: bool = False
    prompt_logprobs_from: int | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()

    @property
    def finished(self) -> bool:
        return self.num_done == len(self.completions)

    def result(self) -> GenerateResult:
        done = tuple(c for c in self.completions if c is not None)
        return GenerateResult(
            self.request_id,
            done,
            len(self.prompt_ids),
            self.cached_prompt_tokens,
            self.prompt_logprobs,
        )


@dataclass(slots=True, eq=False)
class Member:
    """One logical sample: completion slot ``index`` of ``request``."""

    request: RequestState
    index: int
    generator: torch.Generator | None  # None for greedy requests: no draws
    target_len: int = 0  # synthetic workload: stop after this many tokens (0 = off)
    uniforms: list[float] = field(default_factory=list)
    cursor: int = 0

    def next_uniform(self) -> float:
        """The member's next uniform in [0, 1) (its generator's stream, drawn in blocks)."""
        value = self.peek_uniform(0)
        self.consume(1)
        return value

    def peek_uniform(self, ahead: int) -> float:
        """The uniform ``ahead`` places after the next one, without using it up: a verify
        row reads one per drafted position, and only the tokens it emits use theirs
        (``consume``), so the stream is exactly the one plain decoding reads."""
        if self.generator is None:
            return 0.0
        while self.cursor + ahead >= len(self.uniforms):
            block = torch.rand(_UNIFORM_BLOCK, generator=self.generator).tolist()
            self.uniforms = [*self.uniforms[self.cursor :], *block]
            self.cursor = 0
        return self.uniforms[self.cursor + ahead]

    def consume(self, count: int) -> None:
        if self.generator is not None:
            self.cursor += count


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
    num_hashed_blocks: int = 0  # leading full blocks published to the prefix cache
    detok: DetokState = field(default_factory=DetokState)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token
    # prompt logprobs wanted from this position on (None: not wanted); filled per position
    prompt_logprobs_from: int | None = None
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    streaming: bool = False  # some member's request streams: keep ``detok`` current
    rank: tuple[int, int] = (0, 0)  # scheduling order: (priority, arrival), set below
    # token speculation: this sequence's recent share of drafted tokens accepted (None: no
    # draft verified yet), and the tree it belongs to (its first request's root id)
    accept_rate: float | None = None
    tree: str = ""

    def __post_init__(self) -> None:
        self.rank = (int(self.priority), self.arrival)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_cached_tokens(self) -> int:
        """Prefix-cache hits must stop here: prompt logprobs need the hidden states of every
        position from ``prompt_logprobs_from - 1`` on, until they are all computed."""
        start = self.prompt_logprobs_from
        if start is None or len(self.prompt_logprobs) >= self.num_prompt_tokens - max(1, start):
            return len(self.token_ids)
        return max(0, start - 1)

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
            num_hashed_blocks=self.num_hashed_blocks,
            detok=DetokState(self.detok.text, self.detok.prefix_offset, self.detok.read_offset),
            logprobs=list(self.logprobs),
            prompt_logprobs_from=self.prompt_logprobs_from,
            prompt_logprobs=self.prompt_logprobs,  # complete by now: shared, never written
            streaming=any(m.request.stream for m in members),
            accept_rate=self.accept_rate,
            tree=self.tree,
        )


@dataclass(slots=True)
class ScheduledRow:
    """Tokens ``start .. start + num_tokens`` of ``seq`` computed in this step. A verify row
    (token speculation) is a decode row that also computes ``draft``, tokens proposed to
    follow the sequence: it has ``1 + len(draft)`` tokens, of which only the first is in
    ``seq.token_ids`` yet; ``source`` names the drafter."""

    seq: Sequence
    start: int
    num_tokens: int
    draft: tuple[int, ...] = ()
    source: str = ""

    def input_ids(self) -> list[int]:
        """The token ids this row feeds the model."""
        if self.draft:
            return [self.seq.token_ids[self.start], *self.draft]
        return self.seq.token_ids[self.start : self.start + self.num_tokens]

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes(self) -> bool:
        """This step computes the sequence's last token: the step samples (or finishes) it."""
        return self.start + self.num_tokens == len(self.seq.token_ids)


def finish_member(
    member: Member,
    text: str,
    seq: Sequence,
    reason: FinishReason,
    matched: str | int | None = None,
) -> bool:
    """Record a member's completion; True when its request is now complete."""
    req = member.request
    if req.completions[member.index] is None:
        out = tuple(seq.output_ids)
        logprobs = tuple(seq.logprobs) if req.params.wants_logprobs else ()
        req.completions[member.index] = Completion(
            text, out, len(out), reason, logprobs, matched if reason == FinishReason.STOP else None
        )
        req.num_done += 1
        if seq.prompt_logprobs_from is not None and not req.prompt_logprobs:
            req.prompt_logprobs = prompt_logprob_tuple(seq)
    return req.finished


def prompt_logprob_tuple(seq: Sequence) -> tuple[TokenLogprob | None, ...]:
    """One entry per prompt position from ``prompt_logprobs_from`` on (position 0: None)."""
    start = seq.prompt_logprobs_from or 0
    return tuple(seq.prompt_logprobs.get(p) for p in range(start, seq.num_prompt_tokens))
