"""Drafters for token-level speculative decoding: who proposes the tokens a verify row checks.

The engine asks each decoding sequence's drafters for up to ``limit`` tokens to follow it,
keeps as many as pay for themselves (``tokenspec.py``) and verifies them in the step's own
forward pass; a wrong draft costs compute, never correctness (the acceptance rule keeps the
target distribution exactly).

- ``NgramDrafter`` ("ngram", the generic default): prompt lookup. The longest recent suffix
  of the sequence (``max_n`` down to ``min_n`` tokens) that occurred before, in its own
  prompt and output or in another sequence of the same tree (requests whose ids share their
  first path segment: a ToT query's nodes), proposes what followed it there. ToT siblings
  share most of their text, so a sibling's continuation is often the right one.
- A program's drafter: ``EngineConfig.drafter = "module:attr"`` names a factory called with
  the engine's tokenizer that returns a ``Drafter`` (a string, so the engine can build it
  wherever it runs). It is asked first; the n-gram drafter fills in where it proposes
  nothing. The Game-of-24 program's writes the forced ``= result (left: ...)`` part.
- ``HFDraftModel`` ("model", ``EngineConfig.draft_model``): the seam for a small draft model
  beside the target (on a GPU): ``propose_batch`` gets every row of the step at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from spec_tot.drafting import DraftContext, Drafter
from spec_tot.errors import ConfigError
from spec_tot.plugins import load_target

__all__ = [
    "HFDraftModel",
    "NgramDrafter",
    "load_drafter",
    "tree_of",
]


def tree_of(request_id: str) -> str:
    """The tree a request belongs to: the first segment of its hierarchical id."""
    return request_id.partition("/")[0]


class _TreeIndex:
    """Latest occurrence of every n-gram in one tree's sequences: ``key -> (tokens, end)``,
    where ``tokens[end]`` followed the n-gram. A position is indexed once its continuation
    exists, so a sequence never finds its own unfinished suffix."""

    __slots__ = ("done", "entries", "prompts")

    def __init__(self) -> None:
        self.entries: dict[tuple[int, ...], tuple[Sequence[int], int]] = {}
        self.done: dict[int, tuple[Sequence[int], int]] = {}  # id(list) -> (list, indexed)
        self.prompts: set[int] = set()  # hashes of prompts indexed already


class NgramDrafter(Drafter):
    """Prompt lookup over the sequence and its tree (see the module docstring)."""

    name = "ngram"

    def __init__(
        self,
        max_n: int = 4,
        min_n: int = 2,
        *,
        max_trees: int = 256,
        max_entries: int = 1 << 16,
        max_total_entries: int = 1 << 18,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError("ngram", f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.max_trees, self.max_entries = max_trees, max_entries
        # All trees together: a tree holds its finished sequences' token lists alive, so
        # the least recently drafted trees (finished queries, mostly) go first; the live
        # ones are drafted every step and stay at the young end.
        self.max_total_entries = max_total_entries
        self._trees: OrderedDict[str, _TreeIndex] = OrderedDict()
        self._total = 0  # entries over all trees

    def _tree(self, request_id: str) -> _TreeIndex:
        key = tree_of(request_id)
        index = self._trees.get(key)
        if index is None or len(index.entries) > self.max_entries or len(index.done) > 4096:
            self._total -= len(index.entries) if index is not None else 0
            index = self._trees[key] = _TreeIndex()
        self._trees.move_to_end(key)
        while len(self._trees) > 1 and (
            len(self._trees) > self.max_trees or self._total > self.max_total_entries
        ):
            self._total -= len(self._trees.popitem(last=False)[1].entries)
        return index

    def _index(self, tree: _TreeIndex, tokens: Sequence[int], num_prompt: int) -> None:
        ref = tree.done.get(id(tokens))
        start = ref[1] if ref is not None and ref[0] is tokens else 0
        if start == 0 and num_prompt > self.min_n:
            # a prompt the tree holds already (siblings share theirs): index its output only
            prompt_key = hash(tuple(tokens[:num_prompt]))
            if prompt_key in tree.prompts:
                start = num_prompt - 1
            tree.prompts.add(prompt_key)
        end = len(tokens) - 1  # the last position has no continuation yet
        entries, lo, hi = tree.entries, self.min_n, self.max_n
        before = len(entries)
        for e in range(max(start, lo), end + 1):
            for n in range(lo, min(hi, e) + 1):
                entries[tuple(tokens[e - n : e])] = (tokens, e)
        self._total += len(entries) - before
        tree.done[id(tokens)] = (tokens, max(start, end + 1))

    def forget(self) -> None:
        self._trees.clear()
        self._total = 0

    def propose(self, context: DraftContext) -> Sequence[int]:
        tokens, limit = context.token_ids, context.limit
        tree = self._tree(context.request_id)
        self._index(tree, tokens, context.num_prompt_tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            hit = tree.entries.get(tuple(tokens[length - n :]))
            if hit is not None:
                source, end = hit
                return source[end : end + limit]
        return ()


class HFDraftModel(Drafter):
    """A small causal LM from a local Hugging Face folder proposing by greedy decoding: the
    draft-model seam. Every row of a step goes in one left-padded batch; the context is
    recomputed each step (no KV cache of its own: a production draft model keeps one, which
    this seam leaves to the implementation behind it). Meant for a GPU beside the target;
    on CPU it works, slowly."""

    name = "model"

    def __init__(self, folder: str, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model: Any = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
        self.model.to(device).eval()
        self.pad = int(self.model.config.pad_token_id or 0)

    def propose(self, context: DraftContext) -> Sequence[int]:
        return self.propose_batch([context])[0]

    def propose_batch(self, contexts: Sequence[DraftContext]) -> list[Sequence[int]]:
        import torch

        if not contexts:
            return []
        limit = max(c.limit for c in contexts)
        width = max(len(c.token_ids) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad, dtype=torch.int64)
        mask = torch.zeros((len(contexts), width), dtype=torch.int64)
        for i, c in enumerate(contexts):
            ids[i, width - len(c.token_ids) :] = torch.tensor(list(c.token_ids))
            mask[i, width - len(c.token_ids) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=limit,
                do_sample=False,
                pad_token_id=self.pad,
            )
        new = out[:, width:].tolist()
        return [row[: c.limit] for row, c in zip(new, contexts, strict=True)]


def load_drafter(target: str, tokenizer: Any) -> Drafter:
    """The drafter a ``"module:attr"`` factory builds for ``tokenizer`` (ConfigError naming
    ``drafter`` when the target does not import or does not give a ``Drafter``)."""
    try:
        factory = load_target(target)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError("drafter", f"cannot load {target!r}: {exc}") from None
    try:
        drafter = factory(tokenizer)
    except TypeError as exc:  # not a factory of one argument
        raise ConfigError("drafter", f"{target!r} is not a factory(tokenizer): {exc}") from None
    if not isinstance(drafter, Drafter):
        raise ConfigError("drafter", f"{target!r} returned {type(drafter).__name__}, not a Drafter")
    return drafter
