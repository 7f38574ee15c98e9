"""SpecScale's early-pruning threshold (EP) and SPEX T3 adaptive early termination: small
pure functions the controller calls."""

from __future__ import annotations

from collections.abc import Sequence

from spec_tot.tree import Node, NodeStatus, SearchTree

__all__ = ["early_prune_threshold", "should_terminate"]


def early_prune_threshold(candidates: Sequence[Node], keep: int) -> float | None:
    """SpecScale EP: with >= ``keep`` non-terminal candidates scored, the k-th best score.

    A non-terminal candidate strictly below it can never be among the policy's top k, so it
    and its speculative descendants can go. Terminal candidates (finished traces) are never
    pruned: policies count them apart from the top k.
    """
    scores = sorted(
        (
            n.reward
            for n in candidates
            if n.status is NodeStatus.SCORED and not n.terminal and n.reward is not None
        ),
        reverse=True,
    )
    if keep < 1 or len(scores) < keep:
        return None
    return scores[keep - 1]


def should_terminate(tree: SearchTree, min_answers: int, alpha: float, answer: str | None) -> bool:
    """SPEX T3: >= ``min_answers`` answers exist and ``answer`` (the one the policy would
    return now) leads every other answer's cumulative reward by ``alpha`` times the
    runner-up's mean weight (an answer with no rival needs only the count). The search
    never stops on the lead of an answer the policy would not return."""
    totals: dict[str, list[float]] = {}
    for node in tree.terminals():
        if node.answer is not None and not node.speculative and node.reward is not None:
            totals.setdefault(node.answer, []).append(node.reward)
    if answer is None or answer not in totals:
        return False
    if sum(len(v) for v in totals.values()) < min_answers:
        return False
    rivals = [v for a, v in totals.items() if a != answer]
    if not rivals:
        return True
    second = max(rivals, key=lambda v: (sum(v), len(v)))
    return sum(totals[answer]) - sum(second) >= alpha * (sum(second) / len(second))
