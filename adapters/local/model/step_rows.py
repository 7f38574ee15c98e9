"""What the model layer reads of a step's rows: a row's tokens and where its sequence's KV
lives. The scheduler's ``ScheduledRow`` (``engine/sequence.py``) has this shape; the model
layer names only the shape, so it imports nothing from the engine above it."""

from __future__ import annotations

from typing import Protocol

__all__ = ["RowSequence", "StepRow"]


class RowSequence(Protocol):
    """A sequence as the model sees it: its tokens (prompt + generated), its KV blocks."""

    token_ids: list[int]
    block_table: list[int]


class StepRow(Protocol):
    """Tokens ``start .. end`` of ``seq`` computed in one step; ``input_ids()``: the ids the
    row feeds the model (for a verify row: its last token, then the drafted ones)."""

    seq: RowSequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int: ...

    def input_ids(self) -> list[int]: ...
