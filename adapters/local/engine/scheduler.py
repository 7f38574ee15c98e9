"""Continuous batching with priorities, preemption and mixed prefill/decode steps.

Every ``schedule()`` call picks the next step's rows; sequences join and leave every step.

- **Mixed steps** (``mixed_steps=True``, the default): one step holds every running decode
  row (one token each) *and* prompt chunks, under a budget of ``max_num_batched_tokens``
  tokens a step. Decode rows come first, then prompts already being prefilled, then new
  prompts from the waiting queues; a prompt longer than what is left of the budget is
  chunked (its next chunk runs in the next step). A new request therefore never stalls the
  running batch for a step of its own.
- **Legacy steps** (``mixed_steps=False``, kept for comparison): a step is all-prefill
  (whole prompts, never chunked) or all-decode, a pending prefill first (as nano-vllm).
- **Order**: ``Priority.COMMITTED`` before ``Priority.SPECULATIVE``; FIFO within a class
  (forks keep their parent's arrival).
- **Admission** is bounded by ``max_num_seqs``, the token budget and free KV blocks (a
  prompt gets all its blocks at admission; prefix hits on blocks in use cost nothing). The
  head of the queue blocks the rest (strict priority: a speculative prompt never overtakes a
  committed one that waits).
- **Preemption**: a committed prompt that cannot be admitted (no blocks, or the running set
  is full) evicts running *speculative* sequences, newest first, until it fits; it never
  evicts committed work. A decode row that needs a block evicts the lowest-priority, newest
  running sequence (speculative first; committed only as a last resort, possibly itself).
  Evicted sequences free their blocks and go back to the front of their waiting queue; on
  readmission they recompute (prefix caching usually finds most blocks again). Their members
  keep their generators, so preemption does not change any output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from spec_tot.requests import Priority

from ..config import EngineConfig
from .block_manager import BlockManager
from .sequence import ScheduledRow, Sequence, SequenceStatus

__all__ = ["Scheduler", "StepPlan"]


def _key(seq: Sequence) -> tuple[int, int]:
    return seq.rank


@dataclass(slots=True)
class StepPlan:
    """The rows of one step: ``rows[:num_decode]`` compute one token each at the end of their
    sequence (decode rows), the rest are prompt chunks."""

    rows: list[ScheduledRow]
    num_decode: int

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.mixed_steps = config.mixed_steps
        self.block_manager = block_manager
        self.waiting: dict[Priority, deque[Sequence]] = {p: deque() for p in Priority}
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting[seq.priority].append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A fork of a running sequence (it already holds its blocks)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence (blocks are freed by the caller)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting[seq.priority].remove(seq)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.forget(seq, seq.num_computed_tokens)  # never written: not findable
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting[seq.priority].appendleft(seq)
        self.num_preemptions += 1

    def _newest_speculative(self) -> Sequence | None:
        spec = [s for s in self.running if s.priority == Priority.SPECULATIVE]
        return max(spec, key=_key) if spec else None

    # -- the plan ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._chunks: list[ScheduledRow] = []
        if not self.mixed_steps:
            budget = self.max_num_batched_tokens
            for priority in Priority:
                budget = self._admit_waiting(priority, budget, whole=True)
            if self._chunks:
                return StepPlan(self._chunks, 0)
            decode = self._decode_rows(self._ready(), self.max_num_batched_tokens)
            return StepPlan(decode, len(decode))
        # Decode rows always fit (config: budget >= max_num_seqs); prompts get the rest, class
        # by class, running chunks before new admissions. Admission may evict speculative
        # sequences, so it runs before the decode rows are fixed.
        ready = self._ready()
        budget = self.max_num_batched_tokens - len(ready)
        for priority in Priority:
            budget = self._continue_prefills(priority, budget)
            budget = self._admit_waiting(priority, budget, whole=False)
        decode = self._decode_rows(ready, self.max_num_batched_tokens)
        return StepPlan(decode + self._chunks, len(decode))

    def _ready(self) -> list[Sequence]:
        """Running sequences with exactly one token to compute, highest rank first."""
        ready = [s for s in self.running if s.num_computed_tokens == len(s.token_ids) - 1]
        ready.sort(key=_key)
        return ready

    def _evict(self, victim: Sequence) -> None:
        """Preempt ``victim``, dropping its chunk from the plan being built."""
        self.preempt(victim)
        self._chunks = [r for r in self._chunks if r.seq is not victim]

    def _decode_rows(self, ready: list[Sequence], budget: int) -> list[ScheduledRow]:
        """The ``ready`` sequences still running, each given room for its token."""
        bm = self.block_manager
        order = deque(s for s in ready if s.status == SequenceStatus.RUNNING)
        rows: list[ScheduledRow] = []
        running = SequenceStatus.RUNNING
        while order and len(rows) < budget:
            seq = order.popleft()
            if seq.status != running:  # evicted for an earlier row
                continue
            while not bm.reserve_slot(seq):
                victim = order.pop() if order else self._victim_outside(seq)
                self._evict(victim)
                if victim is seq:
                    break
            else:
                rows.append(ScheduledRow(seq, len(seq.token_ids) - 1, 1))
        return rows

    def _victim_outside(self, seq: Sequence) -> Sequence:
        """Who makes room for ``seq`` once no later decode row is left: a running prompt of
        lower rank not in this step's plan (newest first), else ``seq`` itself. (A prompt
        admitted in this step may already lend its blocks to another admitted with it.)"""
        rank = _key(seq)
        planned = {id(r.seq) for r in self._chunks}
        others = [
            s for s in self.running if s is not seq and _key(s) > rank and id(s) not in planned
        ]
        return max(others, key=_key) if others else seq

    def _continue_prefills(self, priority: Priority, budget: int) -> int:
        pending = sorted(
            (
                s
                for s in self.running
                if s.priority == priority and s.num_computed_tokens < len(s) - 1
            ),
            key=_key,
        )
        for seq in pending:
            if budget <= 0:
                break
            n = min(len(seq) - seq.num_computed_tokens, budget)
            self._chunks.append(ScheduledRow(seq, seq.num_computed_tokens, n))
            budget -= n
        return budget

    def _admit_waiting(self, priority: Priority, budget: int, whole: bool) -> int:
        """Admit from the head of ``priority``'s queue while the budget lasts; returns what is
        left of it (0 also when the head could not be admitted: it blocks the rest)."""
        bm = self.block_manager
        queue = self.waiting[priority]
        admitted: list[Sequence] = []
        while queue and budget > 0:
            seq = queue[0]
            if whole and len(seq) > budget:
                budget = 0
                break
            committed = priority == Priority.COMMITTED
            while committed and not self._fits(seq, len(admitted)):
                victim = self._newest_speculative()
                if victim is None:
                    break
                self._evict(victim)
            if not self._fits(seq, len(admitted)):
                budget = 0
                break
            queue.popleft()
            bm.allocate(seq, seq.max_cached_tokens)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            bm.publish(seq, seq.num_computed_tokens + n)  # later admissions may share them
            self._chunks.append(ScheduledRow(seq, seq.num_computed_tokens, n))
            admitted.append(seq)
            budget -= n
        for seq in admitted:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return budget

    def _fits(self, seq: Sequence, num_admitted: int) -> bool:
        if len(self.running) + num_admitted >= self.max_num_seqs:
            return False
        return self.block_manager.can_allocate(seq, seq.max_cached_tokens)
