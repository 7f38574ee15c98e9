"""What the controller prunes: SpecScale's early pruning (EP, and its opt-in full-score
shortcut), the speculative work under BFS nodes a round did not select, and SPEX T3 adaptive
early termination."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from spec_tot.policies.base import Expansion
from spec_tot.tree import Node, NodeStatus, SearchTree

if TYPE_CHECKING:
    from spec_tot.executor.branch_runner import BranchRunner
    from spec_tot.executor.context import QueryContext

__all__ = ["discard_unselected", "early_prune", "early_prune_threshold", "should_terminate"]


def early_prune(ctx: QueryContext, branches: BranchRunner, round_nodes: list[Node]) -> None:
    """EP: every scored non-terminal node of the round strictly below the k-th best score
    can no longer be selected; it is pruned and its speculative subtree cancelled."""
    keep = ctx.policy.keep_count(ctx.tree)
    if keep is None:
        return
    if ctx.spec.ep_full_score:
        _full_score_shortcut(ctx, branches, round_nodes, keep)
    threshold = early_prune_threshold(round_nodes, keep)
    if threshold is None:
        return
    for node in round_nodes:
        below = node.reward is not None and node.reward < threshold
        if node.status is NodeStatus.SCORED and not node.terminal and below:
            ctx.tree.prune(node)
            ctx.emit("pruned", node, reward=node.reward, threshold=threshold)
            for child in node.children:
                branches.cancel(child)


def _full_score_shortcut(
    ctx: QueryContext, branches: BranchRunner, round_nodes: list[Node], keep: int
) -> None:
    """Opt-in: once ``keep`` non-terminal candidates have the maximum score, the round is
    decided; unfinished candidates are cancelled. A later candidate that would also have
    scored the maximum could have won a tie in the baseline, so this can change which tied
    node is kept."""
    full = [
        n
        for n in round_nodes
        if n.status is NodeStatus.SCORED
        and not n.terminal
        and n.reward is not None
        and n.reward >= ctx.spec.full_score
    ]
    if len(full) < keep:
        return
    for node in round_nodes:
        task = branches.tasks.get(node.id)
        if node.status is NodeStatus.RUNNING and task is not None and not task.done():
            ctx.emit("cancelled", node, reason="full-score shortcut")
            task.cancel()


def discard_unselected(
    branches: BranchRunner, round_nodes: list[Node], expansions: Sequence[Expansion]
) -> None:
    """A BFS round's nodes that it did not select are never expanded: their speculative
    subtrees go at once."""
    selected = {e.parent_id for e in expansions}
    for node in round_nodes:
        if node.id not in selected:
            for child in node.children:
                if child.speculative:
                    branches.cancel(child)


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
