"""Incremental detokenization and stop-string search.

Decoding the whole output every step costs O(n^2); instead decode a short window (from
``prefix_offset``) and emit only what became stable (a trailing U+FFFD means a multi-byte
character is still incomplete). Stop strings are searched only in the tail that could contain
a new match.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from .sequence import DetokState

__all__ = ["decode_incremental", "find_stop"]


def decode_incremental(tokenizer: Any, output_ids: list[int], state: DetokState) -> str:
    """Append newly stable text to ``state.text``; returns the new piece."""
    prefix = str(
        tokenizer.decode(
            output_ids[state.prefix_offset : state.read_offset], skip_special_tokens=True
        )
    )
    full = str(tokenizer.decode(output_ids[state.prefix_offset :], skip_special_tokens=True))
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    piece = full[len(prefix) :]
    state.prefix_offset, state.read_offset = state.read_offset, len(output_ids)
    state.text += piece
    return piece


def find_stop(text: str, piece_len: int, stops: Seq[str]) -> int:
    """Index of the earliest stop string that ends in the new piece, or -1."""
    best = -1
    for stop in stops:
        start = max(0, len(text) - piece_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best == -1 or idx < best):
            best = idx
    return best
