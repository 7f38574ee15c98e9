"""Helpers shared by the policies: validation, ranking, softmax width allocation, answer
votes, and the bookkeeping of outstanding expansions.

Ranking is always by ``(-score, key)``: higher score first, ties to the node whose id path
(``Node.key``, child indices compared as integers) is smallest, so every policy makes the same
choice for a given tree whatever order its nodes were created or scored in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from spec_tot.errors import ConfigError
from spec_tot.policies.base import Answer, Candidate, Expansion
from spec_tot.tree import Aggregation, Node, NodeStatus, SearchTree

__all__ = [
    "Outstanding",
    "Vote",
    "allocate",
    "check_aggregation",
    "check_beam_shape",
    "check_finite",
    "check_nonnegative",
    "check_positive",
    "check_positive_float",
    "check_range",
    "check_vote",
    "feed_known",
    "fit_budget",
    "rank",
    "softmax",
    "vote_answer",
]

Vote = Literal["majority", "weighted", "best"]
ScoreFn = Callable[[Node], float]


def check_positive(name: str, value: int) -> None:
    # bool is an int subclass: reject it so ``width=True`` does not silently mean 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if value < 1:
        raise ConfigError(name, f"must be >= 1, got {value}")


def check_positive_float(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(name, f"must be a number > 0, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(name, f"must be finite, got {value!r}")


def check_nonnegative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(name, f"must be a number >= 0, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(name, f"must be finite, got {value!r}")


def check_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value!r}")


def check_range(name: str, value: float, low: float, high: float) -> None:
    """``low <= value <= high`` (finite)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigError(name, f"must be a number in [{low}, {high}], got {value!r}")


def check_vote(value: str) -> Vote:
    if value not in ("majority", "weighted", "best"):
        raise ConfigError("vote", f"must be 'majority', 'weighted' or 'best', got {value!r}")
    return value  # type: ignore[return-value]


def check_aggregation(value: str) -> Aggregation:
    if value not in ("last", "min", "prod"):
        raise ConfigError("aggregation", f"must be 'last', 'min' or 'prod', got {value!r}")
    return value  # type: ignore[return-value]


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


@dataclass
class Outstanding:
    """Committed expansions whose children have not all come back through ``on_reward``.

    Children are counted by id (a repeated delivery counts once); nodes whose parent has no
    outstanding expansion (late, speculative, unknown) are ignored.
    """

    pending: dict[str, int] = field(default_factory=dict)  # parent id -> width
    received: dict[str, set[str]] = field(default_factory=dict)

    def add(self, expansions: Iterable[Expansion]) -> None:
        for exp in expansions:
            self.pending[exp.parent_id] = exp.width
            self.received[exp.parent_id] = set()

    def receive(self, nodes: Iterable[Node]) -> list[Node]:
        """Record ``nodes``; returns those that were newly accepted, in delivery order."""
        accepted: list[Node] = []
        for node in nodes:
            parent = node.parent
            if parent is None or parent.id not in self.pending:
                continue
            got = self.received[parent.id]
            if node.id in got or len(got) >= self.pending[parent.id]:
                continue
            got.add(node.id)
            accepted.append(node)
        return accepted

    def complete(self, parent_id: str) -> bool:
        return len(self.received.get(parent_id, ())) >= self.pending.get(parent_id, 0)

    def pop_complete(self) -> list[str]:
        """Drop and return the parents whose children are all resolved."""
        done = [p for p in self.pending if self.complete(p)]
        for p in done:
            del self.pending[p]
            del self.received[p]
        return done

    @property
    def empty(self) -> bool:
        return not self.pending


def feed_known(
    outstanding: Outstanding,
    fed: set[str],
    tree: SearchTree,
    on_reward: Callable[[SearchTree, Sequence[Node]], object],
    *,
    partial: bool = False,
) -> tuple[Node, int, bool] | None:
    """Run a shadow of a one-expansion-at-a-time policy (MCTS, ToT DFS) forward: while
    every child of the expansion in flight is known (scored or with a provisional reward)
    or failed, feed them to ``on_reward`` as if scored. With ``partial``, an expansion whose
    children all exist and at least one is known is fed too, the rest as if failed (the
    best *known* child goes on: a guess that does not wait for the slowest sibling).
    Returns the first expansion that cannot be fed, as (parent, width, guessed: whether a
    partial feed led there), or None when nothing is in flight."""
    guessed = False
    while outstanding.pending:
        parent_id, width = next(iter(outstanding.pending.items()))
        parent = tree[parent_id]
        kids = parent.children[:width]
        done = sum(1 for k in kids if k.known or k.status is NodeStatus.CANCELLED)
        if len(kids) < width or done < width:
            if not (partial and len(kids) == width and any(k.known for k in kids)):
                return parent, width, guessed
            guessed = True
        fed.update(k.id for k in kids if k.known)
        on_reward(tree, kids)
    return None


def check_beam_shape(n: int, width: int) -> None:
    """``n`` samples a round expanded ``width`` at a time: n // width >= 1 kept nodes."""
    check_positive("n", n)
    check_positive("width", width)
    if width > n:
        raise ConfigError("width", f"must be <= n ({n}) so that n // width >= 1, got {width}")
