"""Process-reward scoring with a causal LM (Math-Shepherd style), with prefix reuse.

The folder holds a Llama/Qwen2 checkpoint and ``prm.json`` ``{"step_tag", "good_token",
"bad_token"}``. Text = question + "\\n" + "".join(step + step_tag + "\\n"); the score of step
i is p(good) / (p(good) + p(bad)) = sigmoid(logit_good - logit_bad) at the token that ends
the i-th step tag. Tag positions come from character offsets, so a tag inside the question
or merged into a neighbouring token by the tokenizer is still placed right.

Scoring is an engine client, radix-style: the PRM keeps its own paged KV pool with prefix
caching (the engine's block manager) and a cache of step scores keyed by the tokens up to
each tag. Scoring step k of a trace whose first k-1 steps were scored computes only the new
step's tokens: its earlier scores come from the score cache, the question and earlier steps'
K/V from the pool. One packed forward covers a whole batch (items sharing a prefix in the
same batch share its blocks too); only tag rows reach the LM head.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from spec_tot.errors import ConfigError
from spec_tot.requests import Priority, RewardItem, SamplingParams, check_text

from ..model.loader import load_model_folder
from ..model.model import KVCache
from ..model.runner import ModelRunner
from ..stage_clock import StageClock
from .block_manager import BlockManager
from .sequence import ScheduledRow, Sequence
from .validate import max_token_chars

__all__ = ["PrmScorer", "build_prm_text"]

_NO_SAMPLING = SamplingParams(temperature=0.0, max_tokens=0)
# an item still to run: (its index, the ids to run, (tag index, tag position) of each
# missing score, and its cache key)
_Todo = tuple[int, list[int], list[tuple[int, int, bytes]]]
_SCORE_CACHE = 1 << 13  # step scores remembered (LRU): the live queries' trees, ~1 MB
_PROBE = RewardItem("probe", "1 2 3 4", ("1+2=3 (left: 3 3 4)", "3*3=9 (left: 4 9)"))


def build_prm_text(item: RewardItem, step_tag: str) -> tuple[str, list[int]]:
    """The scored text and, per step, the index of the last character of its tag."""
    text = item.question + "\n"
    ends = []
    for step in item.steps:
        text += step + step_tag
        ends.append(len(text) - 1)
        text += "\n"
    return text, ends


def _single_token(tokenizer: Any, token: str, field: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ConfigError(f"prm.json:{field}", f"{token!r} must be one token, got {ids}")
    return int(ids[0])


def prefix_keys(ids: list[int], tags: Seq[int]) -> list[bytes]:
    """The score cache's key of ``ids[: tag + 1]`` for each tag: a 128-bit
    BLAKE2 digest of the prefix, built in one pass. A digest instead of the token tuple keeps
    a full cache at ~3 MB instead of ~40 MB (prefixes run to hundreds of tokens), and two
    prefixes share a key only with probability 2**-128."""
    digest = hashlib.blake2b(digest_size=16)
    out, done = [], 0
    for tag in tags:
        if tag + 1 < done:  # out of order: start again (tags come ascending in practice)
            digest, done = hashlib.blake2b(digest_size=16), 0
        digest.update(array("q", ids[done : tag + 1]).tobytes())
        done = tag + 1
        out.append(digest.copy().digest())
    return out


class PrmScorer:
    """Not thread-safe: one thread scores at a time (``LocalBackend`` keeps one for it).

    The KV pool holds ``num_kv_blocks * block_size`` tokens (16k by default); small blocks,
    because a prefix is reused in whole blocks and a step is a few dozen tokens.
    """

    def __init__(
        self,
        path: str | Path,
        device: str,
        dtype: torch.dtype,
        num_kv_blocks: int = 4096,
        block_size: int = 4,
        max_batch_tokens: int = 4096,
    ) -> None:
        folder = Path(path)
        spec_file = folder / "prm.json"
        if not spec_file.is_file():
            raise ConfigError("prm_path", f"{folder} has no prm.json")
        spec = json.loads(spec_file.read_text())
        for key in ("step_tag", "good_token", "bad_token"):
            if not isinstance(spec.get(key), str) or not spec[key]:
                raise ConfigError(f"prm.json:{key}", "must be a non-empty string")
        self.folder = folder
        self.loaded = load_model_folder(folder, device, dtype)
        if self.loaded.tokenizer is None:
            raise ConfigError("prm_path", f"{folder} has no tokenizer")
        self.tokenizer: Any = self.loaded.tokenizer
        self.device = device
        self.step_tag: str = spec["step_tag"]
        self.good_id = _single_token(self.tokenizer, spec["good_token"], "good_token")
        self.bad_id = _single_token(self.tokenizer, spec["bad_token"], "bad_token")
        self.tag_ids: list[int] = list(
            self.tokenizer.encode(self.step_tag, add_special_tokens=False)
        )
        model = self.loaded.model
        self.max_len = min(model.args.max_position_embeddings, num_kv_blocks * block_size)
        self.max_chars = self.max_len * max_token_chars(self.tokenizer)
        self.max_batch_tokens = max(max_batch_tokens, self.max_len)
        self.block_manager = BlockManager(num_kv_blocks, block_size, True)
        cache = KVCache.allocate(model.args, num_kv_blocks, block_size, device, dtype)
        # per call: tokenize, then the forward waves (cache lookups and bookkeeping inside)
        self.clock = StageClock("tokenize", "forward")
        self._stream = torch.cuda.Stream(device) if device.startswith("cuda") else None
        self.num_calls = 0
        self.runner = ModelRunner(model, cache, device)
        self._scores: OrderedDict[bytes, float] = OrderedDict()  # prefix_keys -> score
        self._seq_ids = 0
        self.num_computed_tokens = 0  # tokens run through the model (what scoring cost)
        probe = build_prm_text(_PROBE, self.step_tag)[0]
        self.tokens_per_char = len(self.tokenizer.encode(probe)) / len(probe)

    def count_tokens(self, item: RewardItem) -> int:
        return len(self.tokenizer.encode(build_prm_text(item, self.step_tag)[0]))

    def _own_stream(self) -> Any:
        """On CUDA a stream of the PRM's own: beside the engine's thread in one process its
        kernels may overlap the engine's, and its read-backs wait for its own work only."""
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def stats(self) -> dict[str, float]:
        """Seconds per stage of scoring (``prm_tokenize_s``, ``prm_forward_s``), calls."""
        return {**self.clock.as_stats("prm_"), "prm_calls": float(self.num_calls)}

    def clear_cache(self) -> None:
        """Forget cached scores (the KV pool's prefix cache stays: it only saves work)."""
        self._scores.clear()

    def flush(self) -> bool:
        """Forget cached scores and cached prefixes, only while no block is in use (a
        benchmark's cold start). Returns whether it did."""
        if not self.block_manager.reset_prefix_cache():
            return False
        self._scores.clear()
        return True

    # -- encoding ---------------------------------------------------------------------------
    def _encode(self, texts: Seq[tuple[str, list[int], str]]) -> list[tuple[list[int], list[int]]]:
        """Per ``(text, ends, where)``: the token ids of ``text`` and the token covering each
        character index in ``ends``. One tokenizer call for them all (a fast tokenizer
        encodes a batch in one pass: per-call overhead was most of a small PRM's time)."""
        for text, _, where in texts:
            check_text(text, where)  # a lone surrogate would reach the tokenizer as a TypeError
            if len(text) > self.max_chars:
                raise ConfigError(
                    where, f"{len(text)} characters cannot fit in {self.max_len} tokens"
                )
        if not texts:
            return []
        enc = self.tokenizer([t for t, _, _ in texts], return_offsets_mapping=True)
        return [
            self._tag_positions(list(ids), offsets, ends, where)
            for ids, offsets, (_, ends, where) in zip(
                enc["input_ids"], enc["offset_mapping"], texts, strict=True
            )
        ]

    def _tag_positions(
        self, ids: list[int], offsets: Seq[tuple[int, int]], ends: list[int], where: str
    ) -> tuple[list[int], list[int]]:
        if len(ids) > self.max_len:
            raise ConfigError(where, f"{len(ids)} tokens; the PRM reads at most {self.max_len}")
        positions, t = [], 0
        for end in ends:  # token whose span covers the tag's last character
            while t < len(ids) and not (offsets[t][0] <= end < offsets[t][1]):
                t += 1
            if t == len(ids):
                raise ConfigError("step_tag", f"tag not found in the tokens of {where}")
            positions.append(t)
        return ids, positions

    # -- scoring ----------------------------------------------------------------------------
    def score(self, items: Seq[RewardItem]) -> list[tuple[float, ...]]:
        """Per item, one score per step (in [0, 1])."""
        clock = self.clock
        clock.start()
        texts = []
        for item in items:
            text, ends = build_prm_text(item, self.step_tag)
            texts.append((text, ends, f"item {item.request_id!r}"))
        encoded = self._encode(texts)
        clock.lap("tokenize")
        with self._own_stream():
            logits = self._tag_logits(encoded)
        clock.lap("forward")
        self.num_calls += 1
        return [tuple(1.0 / (1.0 + math.exp(-x)) for x in row) for row in logits]

    def classify(self, texts: Seq[str | Seq[int]]) -> list[float]:
        """The reward of each raw text (SGLang's ``/classify`` of a reward model): the PRM's
        ``logit(good) - logit(bad)`` after the text's last step (a step tag is appended
        unless the text already ends with one); ``sigmoid`` of it is the step score. A list
        of token ids is scored the same way (the tag's ids appended unless it ends with
        them). A text longer than the model reads is a ``ConfigError`` naming it."""
        encoded: list[tuple[list[int], list[int]]] = []
        for i, text in enumerate(texts):
            if isinstance(text, str):
                full = text if text.endswith(self.step_tag) else text + self.step_tag
                encoded += self._encode([(full, [len(full) - 1], f"text[{i}]")])
            elif isinstance(text, list | tuple):
                ids = self._tagged_ids(text, f"input_ids[{i}]")
                encoded.append((ids, [len(ids) - 1]))
            else:
                raise ConfigError(f"text[{i}]", f"must be a string, got {type(text).__name__}")
        with self._own_stream():
            return [row[-1] for row in self._tag_logits(encoded)]

    def _tagged_ids(self, ids: Seq[int], where: str) -> list[int]:
        vocab = int(self.loaded.args.vocab_size)
        if not ids:
            raise ConfigError(where, "is empty")
        for j, tok in enumerate(ids):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise ConfigError(f"{where}[{j}]", f"{tok!r} is not a token id in [0, {vocab})")
        row = list(ids)
        if row[-len(self.tag_ids) :] != self.tag_ids:
            row += self.tag_ids
        if len(row) > self.max_len:
            raise ConfigError(where, f"{len(row)} tokens; the PRM reads at most {self.max_len}")
        return row

    def _tag_logits(self, encoded: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """``logit(good) - logit(bad)`` at every tag position, from the cache where known."""
        out: list[list[float]] = []
        todo: list[_Todo] = []
        for i, (ids, tags) in enumerate(encoded):
            row = []
            missing: list[tuple[int, int, bytes]] = []
            for j, (tag, key) in enumerate(zip(tags, prefix_keys(ids, tags), strict=True)):
                value = self._cached(key)
                row.append(math.nan if value is None else value)
                if value is None:
                    missing.append((j, tag, key))
            out.append(row)
            if missing:
                todo.append((i, ids[: missing[-1][1] + 1], missing))
        while todo:
            todo = self._run_wave(todo, out)
        return out

    def _cached(self, key: bytes) -> float | None:
        value = self._scores.get(key)
        if value is not None:
            self._scores.move_to_end(key)
        return value

    def _run_wave(self, todo: list[_Todo], out: list[list[float]]) -> list[_Todo]:
        """One forward over as many items as the pool and the token budget hold; returns the
        items left for the next wave."""
        bm = self.block_manager
        rows: list[ScheduledRow] = []
        budget = self.max_batch_tokens
        for _, ids, missing in todo:
            self._seq_ids += 1
            seq = Sequence(self._seq_ids, ids, len(ids), _NO_SAMPLING, Priority.COMMITTED, 0, [])
            first = missing[0][1]  # hidden states are needed from the first missing tag on
            if rows and (not bm.can_allocate(seq, first) or budget < len(ids)):
                break
            bm.allocate(seq, first)
            bm.publish(seq, len(ids))  # rows of this forward may share these blocks
            start = seq.num_computed_tokens
            rows.append(ScheduledRow(seq, start, len(ids) - start))
            budget -= rows[-1].num_tokens
        taken = todo[: len(rows)]
        tokens: list[int] = []
        offset = 0
        for row, (_, _, missing) in zip(rows, taken, strict=True):
            tokens.extend(offset + tag - row.start for _, tag, _ in missing)
            offset += row.num_tokens
        try:
            logits = self.runner.run(rows, 0, tokens, [])
        except BaseException:
            for row in rows:
                bm.forget(row.seq, row.start)
            raise
        finally:
            for row in rows:
                bm.deallocate(row.seq)
        self.num_computed_tokens += offset
        diffs = iter((logits[:, self.good_id] - logits[:, self.bad_id]).tolist())
        for item, _, missing in taken:
            for j, _, key in missing:
                value = next(diffs)
                out[item][j] = value
                self._scores[key] = value
        while len(self._scores) > _SCORE_CACHE:
            self._scores.popitem(last=False)
        return todo[len(rows) :]
