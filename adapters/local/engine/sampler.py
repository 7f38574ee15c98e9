"""Sampling: temperature / top-k / top-p, greedy at temperature 0, per-member generators.

Every logical member takes one uniform per token from its own ``torch.Generator`` (drawn in
blocks, the same stream as one draw per token) and the inverse CDF of its row's distribution
at that uniform. So a member's token depends only on (its distribution, its generator):
identical whether it shares a row with other members (CD) or has a row of its own, and
whatever else is in the batch. The sampler only reads the uniforms
(``Member.peek_uniform``); the caller uses up one per token a member emits, so a verify row
(token speculation) draws at every drafted position and keeps the stream of plain
decoding. The whole step is one pass: one tensor of uniforms, one softmax per group of
rows, one ``searchsorted`` for every member. Rows without top-k/top-p
use the CDF in vocabulary order (no sort); filtered rows use the CDF of the sorted,
truncated distribution. The choice depends on the row's own parameters only.

Logprobs (when asked) are ``log_softmax(logits / temperature)`` (temperature 1 for greedy)
after the ``min_tokens`` mask and before top-k/top-p truncation, as SGLang reports them.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from spec_tot.requests import SamplingParams, TokenLogprob

from ..model.host_copy import to_device
from .sequence import Sequence, SequenceStatus

__all__ = ["Sampler", "filtered_cdf", "token_logprobs"]


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


def _temperature(params: SamplingParams) -> float:
    return params.temperature if params.temperature > 0 else 1.0


def token_logprobs(
    logits: torch.Tensor, params: Seq[SamplingParams], tokens: Seq[Seq[int]]
) -> list[dict[int, TokenLogprob]]:
    """For each row, a ``TokenLogprob`` of each of its ``tokens`` (top-k and given ids as
    its params ask)."""
    temps = torch.tensor([_temperature(p) for p in params], device=logits.device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    k = max((p.logprobs or 0) for p in params)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k:
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    width = max(len(p.logprob_token_ids) for p in params)
    given: list[list[float]] = []
    if width:
        ids = [list(p.logprob_token_ids) + [0] * (width - len(p.logprob_token_ids)) for p in params]
        given = logp.gather(1, torch.tensor(ids, device=logits.device)).tolist()
    rows = [r for r, toks in enumerate(tokens) for _ in toks]
    cols = [t for toks in tokens for t in toks]
    chosen = logp[torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64)]
    values = chosen.tolist()
    out: list[dict[int, TokenLogprob]] = []
    pos = 0
    for r, (p, toks) in enumerate(zip(params, tokens, strict=True)):
        kr = p.logprobs or 0
        top_pairs = tuple(zip(top_ids[r][:kr], top_vals[r][:kr], strict=True)) if kr else ()
        ids_r = p.logprob_token_ids
        given_pairs = tuple(zip(ids_r, given[r][: len(ids_r)], strict=True)) if ids_r else ()
        entries: dict[int, TokenLogprob] = {}
        for tok in toks:
            entries[tok] = TokenLogprob(tok, values[pos], top_pairs, given_pairs)
            pos += 1
        out.append(entries)
    return out


class Sampler:
    """``sample(logits, seqs)`` -> one token per member of each row, and (rows that ask
    for logprobs) a ``TokenLogprob`` per distinct drawn token."""

    def __init__(self, eos_ids: frozenset[int]) -> None:
        self.eos_ids = tuple(sorted(eos_ids))

    def _mask_min_tokens(
        self, logits: torch.Tensor, seqs: Seq[Sequence], offsets: Seq[int]
    ) -> None:
        """Before ``min_tokens`` tokens, EOS and stop ids cannot be drawn."""
        rows: list[int] = []
        cols: list[int] = []
        for r, (seq, offset) in enumerate(zip(seqs, offsets, strict=True)):
            p = seq.params
            if p.min_tokens and seq.num_output_tokens + offset < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(self.eos_ids)
                rows.extend([r] * len(banned))
                cols.extend(sorted(banned))
        if rows:
            dev = logits.device
            index = (to_device(rows, torch.int64, dev), to_device(cols, torch.int64, dev))
            logits.index_put_(index, to_device(float("-inf"), logits.dtype, dev))

    def sample_or_isolate(
        self,
        logits: torch.Tensor,
        seqs: Seq[Sequence],
        offsets: Seq[int],
        fail: Callable[[Sequence, BaseException], None],
    ) -> list[tuple[list[int], dict[int, TokenLogprob] | None] | None]:
        """One draw for the whole batch (``sample``); if that raises, row by row: a row
        that still raises is None and its sequence fails (``fail``), the others draw."""
        try:
            tokens, logprobs = self.sample(logits, seqs, offsets)
            return list(zip(tokens, logprobs, strict=True))
        except Exception:
            out: list[tuple[list[int], dict[int, TokenLogprob] | None] | None] = []
            for i, seq in enumerate(seqs):
                try:
                    (toks,), (lps,) = self.sample(logits[i : i + 1].clone(), [seq], [offsets[i]])
                    out.append((toks, lps))
                except Exception as exc:
                    out.append(None)
                    if seq.status == SequenceStatus.RUNNING:
                        fail(seq, exc)
            return out

    def sample(
        self, logits: torch.Tensor, seqs: Seq[Sequence], offsets: Seq[int] | None = None
    ) -> tuple[list[list[int]], list[dict[int, TokenLogprob] | None]]:
        """Row ``i`` of ``logits`` is position ``offsets[i]`` (default 0) past the end of
        ``seqs[i]``: its members draw with the uniform that many places ahead."""
        offsets = offsets if offsets is not None else [0] * len(seqs)
        self._mask_min_tokens(logits, seqs, offsets)
        params = [s.params for s in seqs]
        dev = logits.device
        # every group's picks stay on the device until one read-back for the whole step
        picks: list[torch.Tensor] = []
        parts: list[tuple[list[int], list[int] | None, int]] = []  # rows, draws/row, width
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            all_rows = len(greedy) == len(seqs)
            rows = logits if all_rows else logits[to_device(greedy, torch.int64, dev)]
            picks.append(rows.argmax(dim=-1))
            parts.append((greedy, None, 1))
        plain: list[int] = []
        filtered: list[int] = []
        for i, p in enumerate(params):
            if not p.greedy:
                (plain if p.top_k == -1 and p.top_p >= 1 else filtered).append(i)
        for group, is_filtered in ((plain, False), (filtered, True)):
            if group:
                pick, counts = self._draw(logits, seqs, offsets, group, is_filtered)
                picks.append(pick.reshape(-1))
                parts.append((group, counts, pick.shape[1]))
        out: list[list[int]] = [[] for _ in seqs]
        flat = (picks[0] if len(picks) == 1 else torch.cat(picks)).tolist() if picks else []
        pos = 0
        for group, counts, width in parts:
            for j, i in enumerate(group):
                start = pos + j * width
                if counts is None:  # greedy: every member takes the row's argmax
                    out[i] = [flat[start]] * len(seqs[i].members)
                else:
                    out[i] = flat[start : start + counts[j]]
            pos += len(group) * width
        logprobs: list[dict[int, TokenLogprob] | None] = [None] * len(seqs)
        wanted = [i for i, p in enumerate(params) if p.wants_logprobs]
        if wanted:
            entries = token_logprobs(
                logits[to_device(wanted, torch.int64, dev)],
                [params[i] for i in wanted],
                [sorted(set(out[i])) for i in wanted],
            )
            for i, entry in zip(wanted, entries, strict=True):
                logprobs[i] = entry
        return out, logprobs

    def _draw(
        self,
        logits: torch.Tensor,
        seqs: Seq[Sequence],
        offsets: Seq[int],
        group: list[int],
        is_filtered: bool,
    ) -> tuple[torch.Tensor, list[int]]:
        """``[rows, widest]`` drawn token ids on the device, and how many of each row's
        are its members' (the rest is padding)."""
        dev = logits.device
        params = [seqs[i].params for i in group]
        temps = to_device([p.temperature for p in params], logits.dtype, dev)
        # the usual step samples every row: no gather (and no index to send) then
        rows = logits if len(group) == len(seqs) else logits[to_device(group, torch.int64, dev)]
        probs = torch.softmax(rows / temps[:, None], dim=-1)
        order = None
        if is_filtered:
            vocab = probs.shape[-1]
            top_k = to_device(
                [vocab if p.top_k == -1 else p.top_k for p in params], torch.int64, dev
            )
            top_p = to_device([p.top_p for p in params], probs.dtype, dev)
            cdf, order = filtered_cdf(probs, top_k, top_p)
        else:
            cdf = probs.cumsum(dim=-1)
        # every member's uniform, rows padded to the widest: one batched searchsorted, and
        # no copy of any row's CDF
        draws = [[m.peek_uniform(offsets[i]) for m in seqs[i].members] for i in group]
        width = max(len(d) for d in draws)
        padded = [d + [0.0] * (width - len(d)) for d in draws]
        target = to_device(padded, cdf.dtype, dev) * cdf[:, -1:]
        pick = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
        if order is not None:
            pick = order.gather(1, pick)
        return pick, [len(d) for d in draws]
