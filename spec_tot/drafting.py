"""The token-drafting seam: what a program implements to propose the tokens that token
speculation verifies (``Drafter``), and what it is shown of a sequence (``DraftContext``).

A program names its drafter's factory as ``"module:attr"`` (the embedded engine's
``EngineConfig.drafter``); the engine calls it with its tokenizer wherever it runs and asks
the drafter first, its own prompt lookup filling in where the drafter proposes nothing. A
wrong draft costs compute, never correctness: the engine's acceptance rule keeps the target
distribution exactly. The engine's own drafters (prompt lookup, a draft model) implement
the same contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DraftContext", "Drafter"]


@dataclass(frozen=True, slots=True)
class DraftContext:
    """One decoding sequence, as a drafter sees it. ``token_ids`` is the engine's own list
    (prompt then output; read it, never change it); ``limit`` is the most tokens worth
    proposing (fewer is fine, none means no draft)."""

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    limit: int


class Drafter(ABC):
    """Proposes tokens to follow a sequence. Contract: ``propose`` returns at most
    ``context.limit`` token ids of the model's vocabulary, quickly (it runs on the engine's
    step path, once per decoding row and step), and never raises for a context it cannot
    help with (it returns ``()``). It may keep state between calls; it is called from one
    thread only."""

    name: str = "drafter"

    @abstractmethod
    def propose(self, context: DraftContext) -> Sequence[int]:
        """Up to ``context.limit`` tokens that probably follow ``context.token_ids``."""

    def propose_batch(self, contexts: Sequence[DraftContext]) -> list[Sequence[int]]:
        """Every row of a step at once (a draft model batches them); by default one by one."""
        return [self.propose(c) for c in contexts]

    def forget(self) -> None:
        """Drop what it learnt from the sequences it saw (the engine's prefix-cache flush
        calls it, so a benchmark's next run starts cold); by default there is nothing."""
        return None
