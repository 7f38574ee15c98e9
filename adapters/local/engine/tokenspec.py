"""Token-level speculative decoding: which decode rows verify drafted tokens, and how many.

After the scheduler has fixed a step's rows, ``TokenSpeculator.extend`` asks the drafters
(``drafter.py``) for tokens to follow each decoding sequence and turns the rows whose drafts
pay for themselves into *verify rows*: ``1 + k`` tokens over the paged KV, in the same
forward pass as the rest of the batch. Acceptance (exact, see ``postprocess.py``) then keeps
the longest prefix the model agrees with and one token of its own.

What pays is decided per step, from two estimates:

- **Step cost** (``StepCost``): a step takes ``fixed + per_row * rows + per_token *
  tokens``, where ``tokens`` counts the tokens past one per row (drafted tokens and prompt
  chunks). The prior is the engine's calibrated step-cost curve (decode batches: their per-
  row slope stands in for a token's, which over-charges a drafted token); the engine's own
  steps, verify rows included, refine it (decayed least squares), since the curve never
  measured a drafted token.
- **Acceptance** (``AcceptanceStats``): per drafter, ``q[j]`` = the share of its drafts of
  length > j whose first ``j + 1`` tokens were all accepted (decayed counts and a prior);
  per sequence, its own recent acceptance relative to its drafter's scales that (the
  adaptive ``k`` per sequence).

A drafted token at position ``j`` of a row adds ``q[j]`` expected tokens and ``per_token``
seconds to a step that emits ``E`` tokens in ``c`` seconds: it is worth it while ``q[j] >
per_token * E / c`` (the throughput of the step rises). Rows are given the longest drafts
that pass, at the fixed point of that threshold; where the curve is steep (a large batch on
a compute-bound machine) few or none pass, where a step is mostly fixed cost (small batches,
the overhead- and memory-bound regime) long drafts do. Drafts never evict anyone: their KV
comes from free blocks only, and a row that cannot get them verifies fewer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from spec_tot.drafting import DraftContext, Drafter

from .block_manager import BlockManager
from .scheduler import StepPlan
from .sequence import ScheduledRow, Sequence

__all__ = ["AcceptanceStats", "SpecCounters", "StepCost", "TokenSpeculator"]

# Prior acceptance of a drafter never measured (optimistic enough to be tried), and its weight
# in drafts.
_PRIOR_FIRST, _PRIOR_WEIGHT = 0.6, 4.0
# Memory of the acceptance counts (per recorded draft) and of the step-cost fit (per step).
_ACCEPT_DECAY, _COST_DECAY = 0.998, 0.99
# One drafted token in this many rows that would not be drafted is tried anyway, so a
# drafter whose estimate fell below the threshold is measured again.
_EXPLORE_EVERY = 32


@dataclass(slots=True)
class SpecCounters:
    """Plain counters (they cross a process boundary as they are): drafted and accepted
    tokens, in total and per drafter, verify rows, and decode rows with what they emitted."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_rows: int = 0
    decode_rows: int = 0
    decode_tokens: int = 0
    by_drafter: dict[str, list[int]] = field(default_factory=dict)  # name -> [drafted, ok]

    def as_stats(self) -> dict[str, float]:
        out = {
            "num_draft_tokens": float(self.draft_tokens),
            "num_accepted_tokens": float(self.accepted_tokens),
            "num_verify_rows": float(self.verify_rows),
            "num_decode_rows": float(self.decode_rows),
            "num_decode_tokens": float(self.decode_tokens),
        }
        for name, (drafted, accepted) in sorted(self.by_drafter.items()):
            out[f"num_draft_tokens_{name}"] = float(drafted)
            out[f"num_accepted_tokens_{name}"] = float(accepted)
        return out


class StepCost:
    """``seconds ~ fixed + per_row * rows + per_token * drafted + per_prompt * prompt``
    (tokens past one per row), fitted by decayed least squares to a prior (the calibrated
    decode curve, as pseudo-observations) and to measured steps."""

    # A decode curve's shape, for an engine given none: scaled to its first measured steps.
    _SHAPE: ClassVar[dict[int, float]] = {1: 1.0, 8: 1.7, 32: 4.2}

    def __init__(self, curve: dict[int, float] | None = None) -> None:
        self._a = np.zeros((4, 4))
        self._b = np.zeros(4)
        self._prior_a = np.zeros((4, 4))
        self._prior_b = np.zeros(4)
        self._pending: list[tuple[float, float, float, float, float]] = []
        self.coef = (0.0, 0.0, 0.0, 0.0)
        self._scaled = False
        self._prior(self._SHAPE)
        if curve is not None:
            self.set_curve(curve)

    def set_curve(self, curve: dict[int, float]) -> None:
        """The calibrated decode curve (``rows -> seconds``) as the prior."""
        self._scaled = True
        self._prior(curve)

    def _prior(self, curve: dict[int, float]) -> None:
        """Prior pseudo-observations from a decode-batch curve: rows as measured, drafted and
        prompt tokens charged like rows (conservative: a drafted token costs less than a
        row, which also pays for sampling and bookkeeping)."""
        self._prior_a[:] = 0.0
        self._prior_b[:] = 0.0
        points = sorted(curve.items())
        slope = (points[-1][1] - points[0][1]) / max(1, points[-1][0] - points[0][0])
        for rows, seconds in points:
            for drafted, prompt in ((0, 0), (2 * rows, 0), (0, 2 * rows)):
                x = np.array([1.0, rows, drafted, prompt])
                self._prior_a += np.outer(x, x)
                self._prior_b += x * (seconds + slope * (drafted + prompt))
        self.coef = self._solve()

    def _solve(self) -> tuple[float, float, float, float]:
        if self._pending:  # fold the buffered steps in, each decayed by its age
            x = np.array([p[:4] for p in self._pending])
            y = np.array([p[4] for p in self._pending])
            w = _COST_DECAY ** np.arange(len(x) - 1, -1, -1)
            keep = _COST_DECAY ** len(x)
            self._a = keep * self._a + (x * w[:, None]).T @ x
            self._b = keep * self._b + (x * w[:, None]).T @ y
            self._pending.clear()
        try:
            coef = np.linalg.solve(
                self._a + self._prior_a + 1e-12 * np.eye(4), self._b + self._prior_b
            )
        except np.linalg.LinAlgError:
            return self.coef
        fixed, per_row, per_token, per_prompt = (max(float(c), 1e-7) for c in coef)
        return fixed, per_row, per_token, per_prompt  # a cost is never negative

    def predict(self, rows: float, drafted: float, prompt: float) -> float:
        fixed, per_row, per_token, per_prompt = self.coef
        return fixed + per_row * rows + per_token * drafted + per_prompt * prompt

    @property
    def per_token(self) -> float:
        return self.coef[2]

    def observe(self, rows: int, drafted: int, prompt: int, seconds: float) -> None:
        if self._scaled:  # a step the machine stalled says little about this engine's costs
            seconds = min(seconds, 3.0 * self.predict(rows, drafted, prompt))
        self._pending.append((1.0, rows, drafted, prompt, seconds))
        if len(self._pending) < 16:
            return
        if not self._scaled:  # no curve given: the shape, scaled to the median step seen
            ratios = sorted(p[4] / max(self.predict(*p[1:4]), 1e-12) for p in self._pending)
            scale = ratios[len(ratios) // 2]
            self._pending = [
                (*p[:4], min(p[4], 3.0 * scale * self.predict(*p[1:4]))) for p in self._pending
            ]
            self.set_curve({b: t * scale for b, t in self._SHAPE.items()})
        self.coef = self._solve()


class AcceptanceStats:
    """Per drafter, per position ``j``: of the drafts whose first ``j`` tokens were kept and
    that had a token ``j``, the share that kept it too (``c[j]``, decayed counts). Where a
    position has few observations its prior is the position before it (a drafter that is
    right about one token is usually right about the next: Game of 24's forced text), so
    ``q[j] = c[0] * ... * c[j]``, the chance that a draft's first ``j + 1`` tokens are all
    kept, is learnt for long drafts from the first draft on."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._tested: dict[str, np.ndarray] = {}
        self._kept: dict[str, np.ndarray] = {}
        self._q: dict[str, list[float]] = {}
        self._mean: dict[str, float] = {}

    def q(self, name: str) -> list[float]:
        cached = self._q.get(name)
        if cached is None:
            tested = self._tested.get(name)
            kept = self._kept.get(name)
            out, prior, survive = [], _PRIOR_FIRST, 1.0
            for j in range(self.max_tokens):
                n = tested[j] if tested is not None else 0.0
                k = kept[j] if kept is not None else 0.0
                rate = (k + _PRIOR_WEIGHT * prior) / (n + _PRIOR_WEIGHT)
                survive *= rate
                out.append(survive)
                prior = rate
            cached = self._q[name] = out
        return cached

    def mean(self, name: str) -> float:
        """The share of this drafter's drafted tokens accepted (smoothed)."""
        return self._mean.get(name, _PRIOR_FIRST)

    def record(self, name: str, drafted: int, accepted: int) -> None:
        if name not in self._tested:
            self._tested[name] = np.zeros(self.max_tokens)
            self._kept[name] = np.zeros(self.max_tokens)
        tested, kept = self._tested[name], self._kept[name]
        tested *= _ACCEPT_DECAY
        kept *= _ACCEPT_DECAY
        tested[: min(accepted + 1, drafted)] += 1.0  # positions 0..accepted were judged
        kept[:accepted] += 1.0
        share = accepted / drafted
        self._mean[name] = 0.95 * self._mean.get(name, _PRIOR_FIRST) + 0.05 * share
        self._q.pop(name, None)


@dataclass(slots=True)
class _Candidate:
    row: ScheduledRow
    draft: Seq[int]
    source: str
    q: list[float]
    length: int = 0


class TokenSpeculator:
    """Drafts for a step's decode rows (``extend``) and what acceptance taught
    (``record``); see the module docstring."""

    def __init__(
        self,
        drafters: Seq[Drafter],
        block_manager: BlockManager,
        *,
        max_draft_tokens: int,
        max_len: int,
        curve: dict[int, float] | None = None,
    ) -> None:
        self.drafters = list(drafters)
        self.block_manager = block_manager
        self.max_draft_tokens = max_draft_tokens
        self.max_len = max_len
        self.cost = StepCost(curve)
        self.acceptance = AcceptanceStats(max_draft_tokens)
        self.counters = SpecCounters()
        self._explore = 0
        self._rows = self._drafted = self._prompt = 0
        self._started = 0.0

    def forget(self) -> None:
        """Every drafter drops its history (the engine's prefix-cache flush)."""
        for drafter in self.drafters:
            drafter.forget()

    def reset_counters(self) -> None:
        self.counters = SpecCounters()

    # -- a step -----------------------------------------------------------------------------
    def begin(self) -> None:
        self._started = time.perf_counter()

    def extend(self, plan: StepPlan, budget: int) -> None:
        """Turn decode rows of ``plan`` into verify rows, within ``budget`` extra tokens."""
        decode = plan.rows[: plan.num_decode]
        rows = len(decode)
        prompt_tokens = plan.num_tokens - rows
        self._rows, self._drafted, self._prompt = rows, 0, prompt_tokens
        if not decode or budget <= 0:
            return
        threshold = self.cost.per_token * rows / self.cost.predict(rows, 0, prompt_tokens)
        wanted = [(row, limit) for row in decode if (limit := self._limit(row.seq)) > 0]
        if not wanted:
            return
        cands = self._draft(wanted, threshold)
        if not cands:
            return
        self._choose(cands, rows, prompt_tokens)
        bm = self.block_manager
        spent = 0
        for cand in cands:  # rank order (committed first): who gets the budget and blocks
            n = min(cand.length, budget - spent)
            if n <= 0:
                continue
            seq, row = cand.row.seq, cand.row
            end = len(seq.token_ids)
            n = bm.reserve_range(seq, end, end + n) - end
            if n <= 0:
                continue
            row.draft, row.source, row.num_tokens = tuple(cand.draft[:n]), cand.source, 1 + n
            spent += n
        self._drafted = spent

    def _limit(self, seq: Sequence) -> int:
        """Most tokens worth drafting for ``seq``: its row emits at most one more than it
        verifies, within ``max_tokens`` and the model's length."""
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_len - len(seq.token_ids))
        return min(self.max_draft_tokens, room - 1)

    def _factor(self, seq: Sequence, source: str) -> float:
        if seq.accept_rate is None:
            return 1.0
        mean = max(self.acceptance.mean(source), 1e-3)
        return min(2.0, max(0.25, seq.accept_rate / mean))

    def _draft(self, wanted: list[tuple[ScheduledRow, int]], threshold: float) -> list[_Candidate]:
        """Each drafter in turn on the rows still without a draft; a row is asked only if
        the drafter's first token could pass ``threshold`` (or, now and then, to explore)."""
        out: list[_Candidate] = []
        for drafter in self.drafters:
            q = self.acceptance.q(drafter.name)
            ask: list[tuple[ScheduledRow, int]] = []
            for row, limit in wanted:
                if q[0] * self._factor(row.seq, drafter.name) > threshold:
                    ask.append((row, limit))
                else:
                    self._explore += 1
                    if self._explore % _EXPLORE_EVERY == 0:
                        ask.append((row, 1))
            if not ask:
                continue
            contexts = [
                DraftContext(
                    row.seq.members[0].request.request_id,
                    row.seq.token_ids,
                    row.seq.num_prompt_tokens,
                    limit,
                )
                for row, limit in ask
            ]
            proposals = drafter.propose_batch(contexts)
            done = set()
            for (row, limit), draft in zip(ask, proposals, strict=True):
                if draft:
                    draft = list(draft[:limit])
                    scale = self._factor(row.seq, drafter.name)
                    qs = [min(1.0, v * scale) for v in q[: len(draft)]]
                    out.append(_Candidate(row, draft, drafter.name, qs))
                    done.add(id(row))
            wanted = [(row, limit) for row, limit in wanted if id(row) not in done]
            if not wanted:
                break
        out.sort(key=lambda c: c.row.seq.rank)
        return out

    def _choose(self, cands: list[_Candidate], rows: int, prompt_tokens: int) -> None:
        """Lengths at the fixed point of the threshold ``per_token * E / cost``. An
        exploring candidate (asked for one token) keeps it."""
        per_token = self.cost.per_token
        emitted, drafted = float(rows), 0
        for _ in range(3):
            threshold = per_token * emitted / self.cost.predict(rows, drafted, prompt_tokens)
            emitted, drafted = float(rows), 0
            for cand in cands:
                n = 0
                while n < len(cand.q) and cand.q[n] > threshold:
                    n += 1
                if n == 0 and len(cand.draft) == 1:
                    n = 1  # exploring
                cand.length = n
                emitted += sum(cand.q[:n])
                drafted += n

    # -- after the step ---------------------------------------------------------------------
    def record(self, row: ScheduledRow, accepted: int, emitted: int) -> None:
        """A verify row's outcome (``accepted`` of its drafted tokens kept), or a plain
        decode row's (``emitted`` tokens)."""
        c = self.counters
        c.decode_rows += 1
        c.decode_tokens += emitted
        drafted = len(row.draft)
        if not drafted:
            return
        c.verify_rows += 1
        c.draft_tokens += drafted
        c.accepted_tokens += accepted
        pair = c.by_drafter.setdefault(row.source, [0, 0])
        pair[0] += drafted
        pair[1] += accepted
        self.acceptance.record(row.source, drafted, accepted)
        seq = row.seq
        share = accepted / drafted
        seq.accept_rate = share if seq.accept_rate is None else 0.5 * seq.accept_rate + 0.5 * share

    def end(self) -> None:
        """The step is over: its time refines the cost model."""
        seconds = time.perf_counter() - self._started
        self.cost.observe(self._rows, self._drafted, self._prompt, seconds)
