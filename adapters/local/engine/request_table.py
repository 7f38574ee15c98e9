"""The engine's requests in flight, one owner: their states by id, the sequence ids, and the
release of a sequence that finished or was aborted (out of the scheduler, its KV freed).

The engine makes one table and hands it to the collaborators that change it: ``Intake``
adds requests and their first sequences, ``Postprocessor`` forks sequences and finishes
requests; nobody else holds the dict or the counter.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from spec_tot.backends import matches_prefix
from spec_tot.requests import FinishReason, GenerateResult

from .block_manager import BlockManager
from .scheduler import Scheduler
from .sequence import RequestState, Sequence, SequenceStatus, finish_member

__all__ = ["RequestTable"]


class RequestTable:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager) -> None:
        self._scheduler = scheduler
        self._block_manager = block_manager
        self._states: dict[str, RequestState] = {}
        self._seq_ids = itertools.count(1)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def add(self, request_id: str, state: RequestState) -> None:
        self._states[request_id] = state

    def pop(self, request_id: str) -> RequestState:
        return self._states.pop(request_id)

    def present(self, request_ids: Iterable[str]) -> set[str]:
        """Those of ``request_ids`` in flight."""
        return {r for r in request_ids if r in self._states}

    def under(self, prefix: str) -> set[str]:
        """The ids in flight that ``prefix`` covers (the abort contract's subtree test)."""
        return {r for r in self._states if matches_prefix(r, prefix)}

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def release(self, seq: Sequence, status: SequenceStatus) -> None:
        """``seq`` is done: out of the scheduler, its KV blocks freed, its status set."""
        self._scheduler.remove(seq)
        self._block_manager.deallocate(seq)
        seq.status = status

    def abort(self, ids: set[str], decode: Callable[[list[int]], str]) -> list[GenerateResult]:
        """End the requests ``ids`` now with what they have (``FinishReason.ABORT``): their
        members leave their sequences, a sequence left with none is released."""
        if not ids:
            return []
        scheduler = self._scheduler
        for seq in [*scheduler.running, *(s for q in scheduler.waiting.values() for s in q)]:
            gone = [m for m in seq.members if m.request.request_id in ids]
            if not gone:
                continue
            text = decode(seq.output_ids)
            for member in gone:
                finish_member(member, text, seq, FinishReason.ABORT)
            seq.members = [m for m in seq.members if m.request.request_id not in ids]
            if not seq.members:
                self.release(seq, SequenceStatus.ABORTED)
        return [self._states.pop(rid).result() for rid in sorted(ids)]
