"""Process-reward scoring with a causal LM (Math-Shepherd style).

The folder holds a Llama/Qwen2 checkpoint and ``prm.json`` ``{"step_tag", "good_token",
"bad_token"}``. Text = question + "\\n" + "".join(step + step_tag + "\\n"); the score of step
i is p(good) / (p(good) + p(bad)) = sigmoid(logit_good - logit_bad) at the token that ends
the i-th step tag. Tag positions come from character offsets, so a tag inside the question
or merged into a neighbouring token by the tokenizer is still placed right. One padded,
cache-free forward pass scores a whole batch; only tag rows reach the LM head.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from spec_tot.errors import ConfigError
from spec_tot.requests import RewardItem

from .loader import load_model_folder
from .model import StepInputs

__all__ = ["PrmScorer", "build_prm_text"]


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


class PrmScorer:
    def __init__(self, path: str | Path, device: str, dtype: torch.dtype) -> None:
        folder = Path(path)
        spec_file = folder / "prm.json"
        if not spec_file.is_file():
            raise ConfigError("prm_path", f"{folder} has no prm.json")
        spec = json.loads(spec_file.read_text())
        for key in ("step_tag", "good_token", "bad_token"):
            if not isinstance(spec.get(key), str) or not spec[key]:
                raise ConfigError(f"prm.json:{key}", "must be a non-empty string")
        self.loaded = load_model_folder(folder, device, dtype)
        self.tokenizer: Any = self.loaded.tokenizer
        self.device = device
        self.step_tag: str = spec["step_tag"]
        self.good_id = _single_token(self.tokenizer, spec["good_token"], "good_token")
        self.bad_id = _single_token(self.tokenizer, spec["bad_token"], "bad_token")

    def count_tokens(self, item: RewardItem) -> int:
        return len(self.tokenizer.encode(build_prm_text(item, self.step_tag)[0]))

    def _encode(self, items: Seq[RewardItem]) -> tuple[list[list[int]], list[list[int]]]:
        ids_all, tag_pos_all = [], []
        for item in items:
            text, ends = build_prm_text(item, self.step_tag)
            enc = self.tokenizer(text, return_offsets_mapping=True)
            ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
            positions, t = [], 0
            for end in ends:  # token whose span covers the tag's last character
                while t < len(ids) and not (offsets[t][0] <= end < offsets[t][1]):
                    t += 1
                if t == len(ids):
                    raise ConfigError(
                        "step_tag", f"tag not found in the tokens of {item.request_id!r}"
                    )
                positions.append(t)
            ids_all.append(ids)
            tag_pos_all.append(positions)
        return ids_all, tag_pos_all

    @torch.inference_mode()
    def score(self, items: Seq[RewardItem]) -> list[tuple[float, ...]]:
        """One batched forward pass for every item (right padding, causal + key mask)."""
        if not items:
            return []
        ids_all, tag_pos = self._encode(items)
        model, dev = self.loaded.model, self.device
        max_len = max(len(ids) for ids in ids_all)
        input_ids = torch.zeros(len(items), max_len, dtype=torch.int64, device=dev)
        lengths = torch.tensor([len(ids) for ids in ids_all], device=dev)
        for row, ids in enumerate(ids_all):
            input_ids[row, : len(ids)] = torch.tensor(ids, device=dev)
        positions = torch.arange(max_len, device=dev).expand(len(items), max_len)
        keys = torch.arange(max_len, device=dev)
        causal = keys[None, None, :] <= positions[:, :, None]
        mask = (causal & (keys[None, None, :] < lengths[:, None, None])).unsqueeze(1)
        cos, sin = model.rope(positions)
        step = StepInputs(input_ids, None, None, mask, cos, sin, lengths - 1)
        hidden = model.hidden_states(step, None)
        rows = torch.tensor([r for r, pos in enumerate(tag_pos) for _ in pos], device=dev)
        cols = torch.tensor([p for pos in tag_pos for p in pos], device=dev)
        if rows.numel() == 0:
            return [() for _ in items]
        logits = model.logits(hidden[rows, cols])
        scores = torch.sigmoid(logits[:, self.good_id] - logits[:, self.bad_id]).tolist()
        out, k = [], 0
        for pos in tag_pos:
            out.append(tuple(scores[k : k + len(pos)]))
            k += len(pos)
        return out
