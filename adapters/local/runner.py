"""Turns a scheduled batch into model inputs and runs one forward pass.

Per step, block tables become one ``[B, L]`` slot index (``gather_index``); the write slots
are read out of it at the step's positions, and the mask is a single comparison. Nothing
here loops over layers, and the per-sequence Python work is building a few small lists.
"""

from __future__ import annotations

import time

import torch

from .model import DecoderModel, KVCache, StepInputs
from .sequence import Sequence

__all__ = ["ModelRunner"]


class ModelRunner:
    def __init__(self, model: DecoderModel, cache: KVCache, device: str) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size
        self._scratch = cache.scratch_block
        self._slot_offsets = torch.arange(self.block_size, device=device)
        self._arange_cache = torch.arange(model.args.max_position_embeddings + 1, device=device)

    def additive_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """``[B, Q, L]`` bool -> ``[B, 1, Q, L]`` 0/-inf in the model dtype (SDPA adds it;
        a bool mask would be converted again in every layer)."""
        zeros = torch.zeros(allowed.shape, dtype=self.model.embed.dtype, device=self.device)
        return zeros.masked_fill_(~allowed, float("-inf")).unsqueeze(1)

    def _tensor(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def prepare(self, seqs: list[Sequence], is_prefill: bool) -> StepInputs:
        bs = self.block_size
        max_len = max(len(s) for s in seqs)
        num_table = -(-max_len // bs)
        tables = [s.block_table + [self._scratch] * (num_table - len(s.block_table)) for s in seqs]
        table = self._tensor(tables)
        gather_index = (table[:, :, None] * bs + self._slot_offsets).view(len(seqs), -1)
        gather_index = gather_index[:, :max_len].contiguous()
        if is_prefill:
            q_len = max(len(s) - s.num_computed_tokens for s in seqs)
            ids, pos, last = [], [], []
            for s in seqs:
                start = s.num_computed_tokens
                pad = q_len - (len(s) - start)
                ids.append(s.token_ids[start:] + [0] * pad)
                pos.append(list(range(start, len(s))) + [0] * pad)
                last.append(len(s) - start - 1)
            input_ids, positions = self._tensor(ids), self._tensor(pos)
            slots = gather_index.gather(1, positions)
            valid = self._arange_cache[:q_len][None, :] <= self._tensor([last]).T
            slots = torch.where(valid, slots, self._scratch * bs)
            last_index = self._tensor([last])[0]
        else:
            input_ids = self._tensor([[s.token_ids[-1]] for s in seqs])
            positions = self._tensor([[len(s) - 1] for s in seqs])
            slots = gather_index.gather(1, positions)
            last_index = torch.zeros(len(seqs), dtype=torch.int64, device=self.device)
        mask = self.additive_mask(
            self._arange_cache[:max_len][None, None, :] <= positions[:, :, None]
        )
        cos, sin = self.model.rope(positions)
        return StepInputs(input_ids, slots.reshape(-1), gather_index, mask, cos, sin, last_index)

    @torch.inference_mode()
    def run(
        self, seqs: list[Sequence], is_prefill: bool, cow: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Copy-on-write copies first, then the forward; returns ``[B, vocab]`` logits."""
        self.cache.copy_blocks(cow)
        logits: torch.Tensor = self.model(self.prepare(seqs, is_prefill), self.cache)
        return logits

    @torch.inference_mode()
    def time_decode(self, batch: int, reps: int, context: int = 64) -> float:
        """Fastest of ``reps`` decode steps of ``batch`` rows over ``context`` tokens, reading
        and writing only the scratch block (the pool is untouched). The minimum, because
        other load on the machine only ever adds time."""
        dev, bs = self.device, self.block_size
        scratch = self._scratch * bs + torch.arange(context, device=dev) % bs
        positions = torch.full((batch, 1), context - 1, dtype=torch.int64, device=dev)
        cos, sin = self.model.rope(positions)
        step = StepInputs(
            input_ids=torch.ones(batch, 1, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((batch,), self._scratch * bs, device=dev),
            gather_index=scratch.expand(batch, context),
            mask=torch.zeros(batch, 1, 1, context, dtype=self.model.embed.dtype, device=dev),
            cos=cos,
            sin=sin,
            last_index=torch.zeros(batch, dtype=torch.int64, device=dev),
        )
        times = []
        for _ in range(reps + 1):  # the first run warms up
            start = time.perf_counter()
            self.model(step, self.cache)
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times[1:])
