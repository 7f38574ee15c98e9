"""Ranking and choosing among nodes: the canonical ranking, softmax width allocation, budget
fitting of candidates, and answer votes.

Ranking is always by ``(-score, key)``: higher score first, ties to the node whose id path
(``Node.key``, child indices compared as integers) is smallest, so every policy makes the same
choice for a given tree whatever order its nodes were created or scored in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from spec_tot.policies.base import Answer, Candidate
from spec_tot.tree import Node, NodeStatus

__all__ = [
    "ScoreFn",
    "Vote",
    "allocate",
    "fit_budget",
    "rank",
    "softmax",
    "vote_answer",
]

Vote = Literal["majority", "weighted", "best"]
ScoreFn = Callable[[Node], float]


def rank(nodes: Iterable[Node], score: ScoreFn) -> list[Node]:
    """Best first; ties broken by the canonical key (the id path)."""
    return sorted(nodes, key=lambda n: (-score(n), n.key))


def softmax(scores: Sequence[float], temperature: float) -> list[float]:
    """Numerically stable softmax(score / temperature); -inf scores get weight 0."""
    if not scores:
        return []
    top = max(scores)
    if top == -math.inf:  # nothing scored: share uniformly rather than divide by zero
        return [1.0 / len(scores)] * len(scores)
    exps = [math.exp((s - top) / temperature) if s != -math.inf else 0.0 for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def allocate(shares: Sequence[float], total: int) -> list[int]:
    """Split ``total`` integer units in proportion to ``shares`` (which sum to 1) by the
    largest-remainder (Hamilton) method: everyone gets ``floor(total * share)``, and the units
    left go one each to the largest fractional parts, ties to the earlier index. The result
    sums to exactly ``total`` (plain rounding would not)."""
    if total <= 0 or not shares:
        return [0] * len(shares)
    exact = [total * s for s in shares]
    out = [math.floor(x) for x in exact]
    left = total - sum(out)
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[:left]:
        out[i] += 1
    return out


def fit_budget(candidates: Sequence[Candidate], budget: int) -> list[Candidate]:
    """Keep candidates in order until ``budget`` children are used; the last one may be cut
    to a smaller width (a partial expansion is still useful speculation)."""
    out: list[Candidate] = []
    left = budget
    for cand in candidates:
        if left <= 0:
            break
        width = min(cand.width, left)
        if width > 0:
            out.append(Candidate(cand.parent_id, width, cand.utility))
            left -= width
    return out


def vote_answer(nodes: Iterable[Node], mode: Vote, score: ScoreFn) -> Answer | None:
    """The answer among terminal SCORED ``nodes``.

    - majority: one vote per node; weighted: votes summed by score; best: the single best node.
    Winner ties go to the answer whose best node ranks first. Nodes without an extracted answer
    take part only in ``best`` (and as a fallback when no node has an answer).
    """
    finals = rank((n for n in nodes if n.terminal and n.status is NodeStatus.SCORED), score)
    if not finals:
        return None
    votes: dict[str, float] = {}
    best_node: dict[str, Node] = {}  # first in rank order = best node of that answer
    for node in finals:
        if node.answer is None:
            continue
        s = score(node)
        if mode == "majority":
            votes[node.answer] = votes.get(node.answer, 0.0) + 1.0
        elif mode == "weighted":
            votes[node.answer] = votes.get(node.answer, 0.0) + (s if math.isfinite(s) else 0.0)
        else:
            votes.setdefault(node.answer, s)
        best_node.setdefault(node.answer, node)
    if mode == "best" or not votes:
        chosen = finals[0]
    else:
        position = {n.id: i for i, n in enumerate(finals)}
        winner = min(votes, key=lambda a: (-votes[a], position[best_node[a].id]))
        chosen = best_node[winner]
    return Answer(text=chosen.answer, node_id=chosen.id, score=score(chosen), votes=votes)
