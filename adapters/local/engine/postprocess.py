"""After a forward: sample, append, fork where CD members drew differently, stop, finish.

CD lives here: one forward per physical sequence, one draw per member, a fork only where
members drew different tokens (blocks shared, copy-on-write of the last partial block).
Stops: stop ids and EOS on the token id; stop strings through ``StopChecker`` (a table
lookup per token, a short tail decode only when a token may complete one). Streaming
requests get a ``StreamUpdate`` per member and token.
"""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field
from typing import Any

import torch

from spec_tot.requests import FinishReason, GenerateResult, StreamUpdate, TokenLogprob

from ..config import SyntheticWorkload
from .block_manager import BlockManager
from .detokenizer import StopChecker, decode_incremental
from .request_table import RequestTable
from .sampler import token_logprobs
from .scheduler import Scheduler, StepPlan
from .sequence import (
    Member,
    ScheduledRow,
    Sequence,
    SequenceStatus,
    finish_member,
)

__all__ = ["LogitPlan", "Postprocessor", "plan_logits", "record_prompt_logprobs"]


def _without_stop_prefix(text: str, stops: tuple[str, ...]) -> str:
    """``text`` less its longest tail that is the start of a stop string (it may still
    become one): streamed text then only grows."""
    longest = max((len(s) for s in stops), default=1)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return text[:-k]
    return text


@dataclass(slots=True)
class LogitPlan:
    """Which packed tokens need logits: rows that sample, prompt-logprob positions. Sample
    ``i`` (``samples[i]``, its row ``rows[i]``) owns the next ``1 + len(rows[i].draft)``
    logits rows: one per position a verify row checks, one for any other row."""

    tokens: list[int]
    samples: list[Sequence]  # logits rows 0..sum(widths)-1
    prompt: list[tuple[Sequence, int]]  # then one row per (sequence, prompt position j)
    finish_empty: list[Sequence]  # prompts done with max_tokens == 0: finish, no sample
    rows: list[ScheduledRow] = field(default_factory=list)  # aligned with ``samples``
    num_sample_rows: int = 0  # logits rows the samples own
    num_decode: int = 0  # samples[:num_decode] are decode rows (the rest end prompts)

    def offsets(self) -> list[int]:
        """For each sample logits row, its position past the end of its sequence."""
        return [j for row in self.rows for j in range(1 + len(row.draft))]

    def sample_seqs(self) -> list[Sequence]:
        return [row.seq for row in self.rows for _ in range(1 + len(row.draft))]


def plan_logits(plan: StepPlan) -> LogitPlan:
    """The logits a step needs. A decode row samples at each of its tokens (one, or a
    verify row's ``1 + k``; its position is past the prompt: a prompt's last token is its
    own row only once all before it are computed), unless it ends a prompt of
    ``max_tokens`` 0."""
    num_decode = plan.num_decode
    tokens: list[int] = []
    samples: list[Sequence] = []
    rows: list[ScheduledRow] = []
    empty: list[Sequence] = []
    offset = 0
    for row in plan.rows[:num_decode]:
        seq = row.seq
        if seq.num_output_tokens == 0 and seq.params.max_tokens == 0:
            empty.append(seq)
        else:
            tokens.extend(range(offset, offset + row.num_tokens))
            samples.append(seq)
            rows.append(row)
        offset += row.num_tokens
    decode_samples = len(samples)
    prompt: list[tuple[Sequence, int]] = []
    prompt_tokens: list[int] = []
    for row in plan.rows[num_decode:]:
        seq = row.seq
        if row.completes:
            if seq.num_output_tokens == 0 and seq.params.max_tokens == 0:
                empty.append(seq)
            else:
                tokens.append(offset + row.num_tokens - 1)
                samples.append(seq)
                rows.append(row)
        if seq.prompt_logprobs_from is not None:  # logits at j - 1 give j's logprob
            first = max(1, seq.prompt_logprobs_from, row.start + 1)
            for j in range(first, min(row.end + 1, seq.num_prompt_tokens)):
                if j not in seq.prompt_logprobs:
                    prompt.append((seq, j))
                    prompt_tokens.append(offset + j - 1 - row.start)
        offset += row.num_tokens
    return LogitPlan(
        tokens + prompt_tokens, samples, prompt, empty, rows, len(tokens), decode_samples
    )


def record_prompt_logprobs(wanted: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
    """Prompt position ``j``'s logprob for each ``(sequence, j)``, from its logits row."""
    entries = token_logprobs(
        logits, [seq.params for seq, _ in wanted], [[seq.token_ids[j]] for seq, j in wanted]
    )
    for (seq, j), entry in zip(wanted, entries, strict=True):
        seq.prompt_logprobs[j] = entry[seq.token_ids[j]]


class Postprocessor:
    def __init__(
        self,
        tokenizer: Any,
        eos_ids: frozenset[int],
        max_len: int,
        synthetic: SyntheticWorkload | None,
        block_manager: BlockManager,
        scheduler: Scheduler,
        requests: RequestTable,
        stops: StopChecker,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_len = max_len
        self.synthetic = synthetic
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.requests = requests
        self.stops = stops
        self.stream_updates: list[StreamUpdate] = []
        self.num_generated_tokens = 0
        self.num_forks = 0

    # -- tokens -----------------------------------------------------------------------------
    def take(
        self,
        row: ScheduledRow,
        draws: Sequence_[tuple[list[int], dict[int, TokenLogprob] | None] | None],
        finished: list[GenerateResult],
    ) -> tuple[int, int]:
        """Record a sampled row's draws (one ``(tokens, logprobs)`` per logits row it owns);
        returns ``(accepted drafted tokens, tokens emitted)`` of its sequence's path."""
        if not row.draft:
            (tokens, logprobs), *_ = (d for d in draws if d is not None)
            self.append(row.seq, tokens, logprobs, finished)
            return 0, 1
        kept = [d for d in draws if d is not None]
        return self.accept(row, [d[0] for d in kept], [d[1] for d in kept], finished)

    def append(
        self,
        seq: Sequence,
        tokens: list[int],
        logprobs: dict[int, TokenLogprob] | None,
        finished: list[GenerateResult],
    ) -> None:
        """Record one row's draws: one token per member."""
        self.num_generated_tokens += len(tokens)
        for member in seq.members:
            member.consume(1)
        tok = tokens[0]
        if len(tokens) == 1 or all(t == tok for t in tokens):
            pairs = [(seq, tok)]  # the usual case: no fork
        else:
            pairs = self._split(seq, tokens)
        for child, tok in pairs:
            child.token_ids.append(tok)
            if logprobs is not None:
                child.logprobs.append(logprobs[tok])
            if not self._check_stop(child, tok, finished) and child.streaming:
                self._stream(child)

    def accept(
        self,
        row: ScheduledRow,
        tokens: list[list[int]],
        logprobs: list[dict[int, TokenLogprob] | None],
        finished: list[GenerateResult],
    ) -> tuple[int, int]:
        """Record a verify row: ``tokens[j]`` holds each member's draw at position ``j`` (in
        the row's member order), ``logprobs[j]`` the logprobs there. A member keeps drafted
        token ``j`` iff it drew that very token; the first position where it drew another
        (or the position past the draft) gives its own token, and it stops there. With
        inverse-CDF draws this is the speculative-sampling rule for a point-mass draft:
        the drafted token is kept with probability p(token), else the draw is from p with
        that token removed, renormalised; greedy keeps the longest agreeing prefix. Each
        member uses exactly one uniform per token it emits, so its stream, and its tokens,
        are those of plain decoding. Members that leave the draft fork at their position;
        the KV of rejected tokens is dropped. Returns ``(accepted drafted tokens, tokens
        emitted)`` of the path that keeps ``row.seq``."""
        seq, draft = row.seq, row.draft
        column = {id(m): i for i, m in enumerate(seq.members)}
        before = len(seq.token_ids)
        accepted = 0
        for j in range(len(draft) + 1):
            want = draft[j] if j < len(draft) else None
            toks = [tokens[j][column[id(m)]] for m in seq.members]
            self.num_generated_tokens += len(toks)
            for member in seq.members:
                member.consume(1)
            first = toks[0]
            if all(t == first for t in toks):
                pairs = [(seq, first)]
            else:
                pairs = self._split(seq, toks, keep=want)
            follows = False
            for child, tok in pairs:
                child.token_ids.append(tok)
                if logprobs[j] is not None:
                    child.logprobs.append(logprobs[j][tok])
                # blocks the kept drafts filled are published even if the sequence ends now
                self.block_manager.publish(child, len(child.token_ids) - 1)
                if self._check_stop(child, tok, finished):
                    continue
                if child.streaming:
                    self._stream(child)
                if child is seq and tok == want:
                    follows = True
                else:
                    self._settle(child)
            if not follows:
                break
            accepted += 1
        return accepted, len(seq.token_ids) - before

    def _settle(self, seq: Sequence) -> None:
        """After a verify row: every token but the last has its K/V; blocks past them (the
        rejected drafts') go back."""
        if seq.status != SequenceStatus.RUNNING:
            return
        seq.num_computed_tokens = len(seq.token_ids) - 1
        self.block_manager.trim(seq, seq.num_computed_tokens)

    def _split(
        self, seq: Sequence, toks: list[int], keep: int | None = None
    ) -> list[tuple[Sequence, int]]:
        """Group members by drawn token; the group that drew ``keep`` (default: the first
        group) keeps ``seq``, the others fork it."""
        groups: dict[int, list[Member]] = {}
        if keep is not None:
            groups[keep] = []
        for member, tok in zip(seq.members, toks, strict=True):
            groups.setdefault(tok, []).append(member)
        if keep is not None and not groups[keep]:
            del groups[keep]
        out = []
        for i, (tok, members) in enumerate(groups.items()):
            if i == 0:
                seq.members = members
                seq.streaming = any(m.request.stream for m in members)
                out.append((seq, tok))
                continue
            child = seq.fork(self.requests.next_seq_id(), members)
            self.block_manager.fork(seq, child)
            self.scheduler.add_running(child)
            self.num_forks += 1
            out.append((child, tok))
        return out

    # -- stops ------------------------------------------------------------------------------
    def _check_stop(self, seq: Sequence, tok: int, finished: list[GenerateResult]) -> bool:
        """Finish ``seq`` (or some of its synthetic members) if it stops here; True when the
        whole sequence finished."""
        params, syn = seq.params, self.synthetic
        length = len(seq.token_ids)
        generated = length - seq.num_prompt_tokens
        reason: FinishReason | None = None
        matched: str | int | None = None
        text: str | None = None
        drop_last = False
        if syn is None:
            if tok in params.stop_token_ids or (not params.ignore_eos and tok in self.eos_ids):
                reason, matched, drop_last = FinishReason.STOP, tok, True
            elif (
                params.stop
                and generated >= params.min_tokens
                and self.stops.triggers(params.stop)[tok]
            ):
                found = self.stops.match(seq.output_ids, params.stop)
                if found is not None:
                    reason, (text, matched) = FinishReason.STOP, found
        if reason is None and (generated >= params.max_tokens or length >= self.max_len):
            reason = FinishReason.LENGTH
        if reason is None and syn is not None:
            done = [m for m in seq.members if m.target_len <= seq.num_output_tokens]
            if done and len(done) < len(seq.members):
                self.finish(seq, done, FinishReason.STOP, self._text(seq, False), None, finished)
                seq.members = [m for m in seq.members if m.target_len > seq.num_output_tokens]
                return False
            reason = FinishReason.STOP if done else None
        if reason is None:
            return False
        if text is None:
            text = self._text(seq, drop_last)
        self.finish(seq, seq.members, reason, text, matched, finished)
        self.requests.release(seq, SequenceStatus.FINISHED)
        return True

    def _text(self, seq: Sequence, drop_last: bool) -> str:
        out = seq.output_ids
        return str(self.tokenizer.decode(out[:-1] if drop_last else out, skip_special_tokens=True))

    def finish(
        self,
        seq: Sequence,
        members: list[Member],
        reason: FinishReason,
        text: str,
        matched: str | int | None,
        finished: list[GenerateResult],
    ) -> None:
        for member in members:
            done = finish_member(member, text, seq, reason, matched)
            req = member.request
            if req.stream:
                completion = req.completions[member.index]
                assert completion is not None  # internal: just recorded
                ids = completion.token_ids
                self.stream_updates.append(
                    StreamUpdate(req.request_id, member.index, ids, text, completion)
                )
            if done:
                finished.append(self.requests.pop(req.request_id).result())

    # -- streaming --------------------------------------------------------------------------
    def _stream(self, seq: Sequence) -> None:
        out = seq.output_ids
        decode_incremental(self.tokenizer, out, seq.detok)
        text = _without_stop_prefix(seq.detok.text, seq.params.stop)
        ids = tuple(out)
        for member in seq.members:
            if member.request.stream:
                self.stream_updates.append(
                    StreamUpdate(member.request.request_id, member.index, ids, text)
                )

    def take_stream_updates(self) -> list[StreamUpdate]:
        updates, self.stream_updates = self.stream_updates, []
        return updates
