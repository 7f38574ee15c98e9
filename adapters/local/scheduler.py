"""Continuous batching with priorities and preemption.

Every ``schedule()`` call picks the next step's batch; sequences join and leave every step.

- **Prefill is whole, never chunked**, and a step is either all-prefill or all-decode (as in
  nano-vllm): a pending prefill runs first, so new work starts at once; config validation
  guarantees the longest prompt fits ``max_num_batched_tokens``.
- **Order**: ``Priority.COMMITTED`` before ``Priority.SPECULATIVE``; FIFO within a class
  (forks keep their parent's arrival).
- **Admission** is bounded by ``max_num_seqs``, ``max_num_batched_tokens`` and free KV blocks
  (prefix hits on blocks already in use cost nothing). The head of the queue blocks the rest
  (strict priority: a speculative prompt never overtakes a committed one that waits).
- **Preemption policy**: a committed prompt that cannot be admitted (no blocks, or the running
  set is full) evicts running *speculative* sequences, newest first, until it fits; it never
  evicts committed work. In decode, a sequence that needs a block evicts the lowest-priority,
  newest running sequence (speculative first; committed only as a last resort, possibly
  itself). Evicted sequences free their blocks and go back to the front of their waiting
  queue; on readmission they recompute (prefix caching usually finds most blocks again).
  Their members keep their generators, so preemption does not change any output.
"""

from __future__ import annotations

from collections import deque

from spec_tot.requests import Priority

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus

__all__ = ["Scheduler"]


def _key(seq: Sequence) -> tuple[int, int]:
    return (int(seq.priority), seq.arrival)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
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
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting[seq.priority].appendleft(seq)
        self.num_preemptions += 1

    def _newest_speculative(self) -> Sequence | None:
        spec = [s for s in self.running if s.priority == Priority.SPECULATIVE]
        return max(spec, key=_key) if spec else None

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next batch and whether it is a prefill batch."""
        batch = self._schedule_prefill()
        if batch:
            return batch, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        bm = self.block_manager
        batch: list[Sequence] = []
        num_tokens = 0
        for priority in Priority:
            queue = self.waiting[priority]
            while queue:
                seq = queue[0]
                if num_tokens + len(seq) > self.max_num_batched_tokens:
                    return self._admit(batch)
                committed = priority == Priority.COMMITTED
                while committed and (
                    len(self.running) + len(batch) >= self.max_num_seqs or not bm.can_allocate(seq)
                ):
                    victim = self._newest_speculative()
                    if victim is None:
                        break
                    self.preempt(victim)
                if len(self.running) + len(batch) >= self.max_num_seqs or not bm.can_allocate(seq):
                    return self._admit(batch)
                queue.popleft()
                bm.allocate(seq)
                num_tokens += len(seq) - seq.num_cached_tokens
                batch.append(seq)
        return self._admit(batch)

    def _admit(self, batch: list[Sequence]) -> list[Sequence]:
        for seq in batch:
            seq.status = SequenceStatus.RUNNING
        self.running.extend(batch)
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        bm = self.block_manager
        order = sorted(self.running, key=_key)
        batch: list[Sequence] = []
        while order:
            seq = order.pop(0)
            while not bm.can_append(seq):
                if order:
                    self.preempt(order.pop())  # lowest priority, newest
                else:
                    self.preempt(seq)
                    break
            else:
                bm.may_append(seq)
                batch.append(seq)
        return batch
