"""Sampling: temperature / top-k / top-p, greedy at temperature 0, per-member generators.

Every logical member draws one uniform from its own ``torch.Generator`` per step and takes
the inverse CDF of its row's distribution at that uniform. So a member's token depends only on
(its distribution, its generator): identical whether it shares a row with other members (CD)
or has a row of its own, and whatever else is in the batch. Rows without top-k/top-p use the
CDF in vocabulary order (no sort); filtered rows use the CDF of the sorted, truncated
distribution. The choice depends on the row's own parameters only, never on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from spec_tot.requests import SamplingParams

__all__ = ["Sampler", "draw_uniforms", "filtered_cdf"]


def draw_uniforms(generators: Seq[torch.Generator | None]) -> list[float]:
    """One uniform in [0, 1) per member (greedy members draw nothing)."""
    return [0.0 if g is None else float(torch.rand(1, generator=g)) for g in generators]


def filtered_cdf(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted CDF after top-k then top-p truncation, and the sort order (``[R, V]`` each)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    sorted_probs = sorted_probs.masked_fill(ranks[None, :] >= top_k[:, None], 0.0)
    cum = sorted_probs.cumsum(dim=-1)
    total = cum[:, -1:]
    # keep a token while the mass before it is below top_p (the first token always stays)
    keep = (cum - sorted_probs) < top_p[:, None] * total
    return sorted_probs.masked_fill(~keep, 0.0).cumsum(dim=-1), order


class Sampler:
    """``sample(logits, params, members_uniforms)`` -> one token per member, per row."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Seq[SamplingParams],
        uniforms: Seq[Seq[float]],
    ) -> list[list[int]]:
        rows = logits.shape[0]
        out: list[list[int]] = [[] for _ in range(rows)]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            tokens = logits[greedy].argmax(dim=-1).tolist()
            for i, tok in zip(greedy, tokens, strict=True):
                out[i] = [tok] * len(uniforms[i])
        plain = [i for i, p in enumerate(params) if not p.greedy and p.top_k == -1 and p.top_p >= 1]
        filtered = [i for i, p in enumerate(params) if not p.greedy and i not in set(plain)]
        for group, is_filtered in ((plain, False), (filtered, True)):
            if not group:
                continue
            temps = torch.tensor([params[i].temperature for i in group], device=logits.device)
            probs = torch.softmax(logits[group] / temps[:, None], dim=-1)
            order = None
            if is_filtered:
                vocab = probs.shape[-1]
                k = [vocab if params[i].top_k == -1 else params[i].top_k for i in group]
                top_k = torch.tensor(k, device=logits.device)
                top_p = torch.tensor([params[i].top_p for i in group], device=logits.device)
                cdf, order = filtered_cdf(probs, top_k, top_p)
            else:
                cdf = probs.cumsum(dim=-1)
            # one (row, uniform) pair per member, resolved in a single searchsorted
            member_rows = [r for r, i in enumerate(group) for _ in uniforms[i]]
            u = [x for i in group for x in uniforms[i]]
            row_idx = torch.tensor(member_rows, device=logits.device)
            member_cdf = cdf[row_idx]
            target = torch.tensor(u, device=logits.device, dtype=cdf.dtype) * member_cdf[:, -1]
            pick = torch.searchsorted(member_cdf, target[:, None], right=True).squeeze(1)
            pick = pick.clamp_(max=cdf.shape[-1] - 1)
            if order is not None:
                pick = order[row_idx, pick]
            picked = pick.tolist()
            pos = 0
            for i in group:
                n = len(uniforms[i])
                out[i] = picked[pos : pos + n]
                pos += n
        return out
