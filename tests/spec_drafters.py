"""Drafters and a cost model for token-speculation tests: an oracle that knows reference
outputs (right most of the time, wrong on purpose now and then), one that is always wrong,
and a cost model under which every draft pays (so tests verify every draft proposed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spec_tot.drafting import DraftContext, Drafter

__all__ = ["FreeCost", "OracleDrafter", "WrongDrafter", "use_drafters", "wrong_drafter"]


class OracleDrafter(Drafter):
    """Proposes the continuation of a reference output that the sequence follows so far,
    with one token in a varying place (within ``2 * wrong_every``) replaced by another;
    ``fallback`` tokens where no reference matches (so those drafts are rejected)."""

    name = "oracle"

    def __init__(
        self,
        references: Sequence[Sequence[int]],
        vocab: int,
        wrong_every: int = 3,
        fallback: Sequence[int] = (5, 6, 7),
    ) -> None:
        self.references = [list(r) for r in references]
        self.vocab, self.wrong_every, self.fallback = vocab, wrong_every, tuple(fallback)
        self.calls = 0

    def propose(self, context: DraftContext) -> Sequence[int]:
        self.calls += 1
        tokens = list(context.token_ids)
        n = len(tokens)
        for ref in self.references:
            if len(ref) > n and ref[:n] == tokens:
                out = ref[n : n + context.limit]
                if self.wrong_every:  # one wrong token at a varying place, or none
                    j = (7 * n + self.calls) % (2 * self.wrong_every)
                    if j < len(out):
                        out[j] = (out[j] + 1) % self.vocab
                return out
        return self.fallback[: context.limit]


class WrongDrafter(Drafter):
    """Always proposes a token the tiny models almost never pick first."""

    name = "wrong"

    def propose(self, context: DraftContext) -> Sequence[int]:
        return [3] * min(4, context.limit)


def wrong_drafter(tokenizer: Any) -> WrongDrafter:
    """A factory for ``EngineConfig.drafter`` (``"spec_drafters:wrong_drafter"``)."""
    del tokenizer
    return WrongDrafter()


class FreeCost:
    """A step-cost model under which a drafted token costs nothing: every draft is used."""

    per_token = 0.0

    def predict(self, rows: int, drafted: int, prompt: int) -> float:
        return 1.0

    def observe(self, rows: int, drafted: int, prompt: int, seconds: float) -> None:
        return None

    def set_curve(self, curve: dict[int, float]) -> None:
        return None


def use_drafters(engine: Any, *drafters: Drafter, free: bool = True) -> Any:
    """Give ``engine``'s speculator these drafters (and, with ``free``, the free cost)."""
    spec = engine.speculator
    assert spec is not None, "token speculation is off"
    spec.drafters = list(drafters)
    if free:
        spec.cost = FreeCost()
    return engine
