"""Synthetic workload pieces: a pseudo tokenizer and seeded lognormal lengths.

Used with random-weight models of real size: the forward passes are real, only the lengths
(and the text) are drawn from the workload model, reproducibly from the workload seed.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence as Seq

from ..config import SyntheticWorkload

__all__ = ["PseudoTokenizer", "synthetic_prompt_ids", "synthetic_step_len"]


class PseudoTokenizer:
    """Text <-> ids without a vocabulary file: 4 characters a token, each chunk hashed into
    the vocabulary, so equal text prefixes give equal id prefixes (prefix caching still
    works)."""

    chars_per_token = 4

    def __init__(self, vocab_size: int, reserved: int = 4) -> None:
        self.vocab_size = vocab_size
        self.reserved = reserved
        self.eos_token_id: int | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        span = self.vocab_size - self.reserved
        step = self.chars_per_token
        chunks = [text[i : i + step] for i in range(0, len(text), step)]
        return [self.reserved + zlib.crc32(c.encode()) % span for c in chunks]

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i < self.reserved))


def _rng(workload: SyntheticWorkload, key: str, index: int) -> random.Random:
    return random.Random(zlib.crc32(f"{workload.seed}/{key}/{index}".encode()))


def synthetic_step_len(workload: SyntheticWorkload, request_id: str, index: int) -> int:
    """Tokens member ``index`` of ``request_id`` generates before it stops (lognormal)."""
    draw = _rng(workload, request_id, index).lognormvariate(
        workload.step_len_mu, workload.step_len_sigma
    )
    return max(workload.min_step_len, round(draw))


def synthetic_prompt_ids(workload: SyntheticWorkload, index: int, vocab_size: int) -> list[int]:
    """Prompt ``index`` of a synthetic workload: lognormal length, uniform random ids."""
    rng = _rng(workload, "prompt", index)
    length = max(1, round(math.exp(rng.gauss(workload.prompt_len_mu, workload.prompt_len_sigma))))
    return [rng.randrange(4, vocab_size) for _ in range(length)]
