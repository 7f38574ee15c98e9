"""Incremental detokenization (streaming) and stop-string detection on token ids.

Stop strings are found without decoding every sequence on every token. Once per tokenizer,
each token's text is decoded alone and after an anchor token (SentencePiece drops a leading
space at the start of a text); per stop set, a table marks the tokens whose text contains
the last character of some stop string, or an incomplete character (U+FFFD: a multi-byte
character split over tokens). A stop string can only be completed by such a token, so only
then is a short tail of the output decoded and searched. Conservative by construction: a
marked token that completes nothing costs one tail decode, never a missed stop.

Streaming text decodes a short window and emits the stable suffix (a trailing U+FFFD means a
multi-byte character is still incomplete).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import Any

from .sequence import DetokState

__all__ = ["StopChecker", "decode_incremental", "find_stop"]

_MAX_TABLES = 256  # distinct stop sets remembered (LRU)


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
    """Index of the earliest stop string that ends in the last ``piece_len`` characters."""
    best = -1
    for stop in stops:
        start = max(0, len(text) - piece_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best == -1 or idx < best):
            best = idx
    return best


class StopChecker:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._pieces: list[str] | None = None
        self._tables: OrderedDict[tuple[str, ...], bytes] = OrderedDict()

    def _decode(self, ids: Seq[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _piece_texts(self) -> list[str]:
        """Each token's text alone and after an anchor, joined (only membership matters)."""
        if self._pieces is None:
            anchor = [int(t) for t in self.tokenizer.encode("a", add_special_tokens=False)][-1:]
            head = self._decode(anchor)
            singles = [[tok] for tok in range(self.vocab_size)]
            anchored = [[*anchor, tok] for tok in range(self.vocab_size)]
            try:  # one call into a fast tokenizer for the whole vocabulary
                alone = list(self.tokenizer.batch_decode(singles, skip_special_tokens=True))
                after = list(self.tokenizer.batch_decode(anchored, skip_special_tokens=True))
            except Exception:
                alone, after = [], []
                for one, two in zip(singles, anchored, strict=True):
                    try:
                        alone.append(self._decode(one))
                        after.append(self._decode(two))
                    except Exception:  # an id the tokenizer cannot decode: always check
                        alone.append("\ufffd")
                        after.append("\ufffd")
            self._pieces = [
                a + "\x00" + (b[len(head) :] if b.startswith(head) else "\ufffd")
                for a, b in zip(alone, after, strict=True)
            ]
        return self._pieces

    def triggers(self, stops: tuple[str, ...]) -> bytes:
        """``table[token]`` is 1 when ``token`` may complete one of ``stops``."""
        table = self._tables.get(stops)
        if table is not None:
            self._tables.move_to_end(stops)
            return table
        lasts = {s[-1] for s in stops} | {"\ufffd"}
        table = bytes(any(c in piece for c in lasts) for piece in self._piece_texts())
        self._tables[stops] = table
        if len(self._tables) > _MAX_TABLES:
            self._tables.popitem(last=False)
        return table

    def match(self, output_ids: list[int], stops: tuple[str, ...]) -> tuple[str, str] | None:
        """If the last token completed a stop string: the output text cut before it (the
        earliest such stop) and the stop string; else None."""
        longest = max(len(s) for s in stops)
        width = longest + 8
        start = max(0, len(output_ids) - width)
        while True:
            before = self._decode(output_ids[start:-1])
            now = self._decode(output_ids[start:])
            if start == 0 or len(before) >= longest + 2:
                break
            start = max(0, start - 2 * width)  # tokens with little text: widen the tail
        common = 0  # length of the text both decodes agree on
        while common < min(len(before), len(now)) and before[common] == now[common]:
            common += 1
        best: tuple[int, str] | None = None
        for stop in stops:
            idx = now.find(stop, max(0, common - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        full = self._decode(output_ids)
        return full[: max(0, len(full) - (len(now) - best[0]))], best[1]
