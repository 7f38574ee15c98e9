"""Shared helpers: largest-remainder allocation, softmax, votes, outstanding bookkeeping."""

from __future__ import annotations

import math

import pytest

from spec_tot.policies.base import Expansion
from spec_tot.policies.outstanding import Outstanding
from spec_tot.policies.ranking import allocate, softmax, vote_answer
from spec_tot.tree import NodeStatus, SearchTree


def test_allocate_largest_remainder_by_hand() -> None:
    # 4 * [.5, .3, .2] = [2.0, 1.2, 0.8] -> floors [2, 1, 0], one unit left -> largest
    # remainder .8 (index 2).
    assert allocate([0.5, 0.3, 0.2], 4) == [2, 1, 1]
    # 3 * [4/7, 2/7, 1/7] = [1.714, 0.857, 0.429] -> floors [1, 0, 0], two left -> .857, .714
    assert allocate([4 / 7, 2 / 7, 1 / 7], 3) == [2, 1, 0]
    # Equal remainders go to the earlier index.
    assert allocate([0.25] * 4, 2) == [1, 1, 0, 0]
    assert allocate([0.5, 0.5], 0) == [0, 0]
    assert allocate([], 3) == []


def test_softmax() -> None:
    e = math.e
    assert softmax([1.0, 0.0], 1.0) == pytest.approx([e / (1 + e), 1 / (1 + e)])
    assert softmax([0.6, 0.4], 0.2 / math.log(2)) == pytest.approx([2 / 3, 1 / 3])
    assert softmax([-math.inf, 1.0], 1.0) == [0.0, 1.0]
    assert softmax([], 1.0) == []


def _terminals(answers: list[tuple[str | None, float]]) -> SearchTree:
    tree = SearchTree("q", "?")
    for ans, reward in answers:
        node = tree.add_child(tree.root)
        node.status, node.terminal, node.answer, node.reward = (
            NodeStatus.SCORED,
            True,
            ans,
            reward,
        )
    return tree


def test_votes_by_hand() -> None:
    tree = _terminals([("4", 0.95), ("5", 0.4), ("5", 0.5), (None, 0.99)])

    def score(n: object) -> float:
        return n.reward  # type: ignore[attr-defined,no-any-return]

    maj = vote_answer(tree.terminals(), "majority", score)
    assert maj is not None and maj.text == "5" and maj.votes == {"4": 1.0, "5": 2.0}
    assert maj.node_id == "q/2"  # the best node holding the winning answer
    wei = vote_answer(tree.terminals(), "weighted", score)
    assert wei is not None and wei.text == "4" and wei.votes["5"] == pytest.approx(0.9)
    best = vote_answer(tree.terminals(), "best", score)
    assert best is not None and best.node_id == "q/3" and best.text is None
    assert vote_answer([], "best", score) is None


def test_vote_tie_goes_to_better_ranked_answer() -> None:
    tree = _terminals([("a", 0.5), ("b", 0.7)])
    got = vote_answer(tree.terminals(), "majority", lambda n: n.reward or 0.0)
    assert got is not None and got.text == "b"


def test_outstanding_counts_each_child_once() -> None:
    tree = SearchTree("q", "?")
    out = Outstanding()
    out.add([Expansion("q", 2)])
    a, b, c = (tree.add_child(tree.root) for _ in range(3))
    assert out.receive([a, a]) == [a]
    assert not out.complete("q")
    assert out.receive([b, c]) == [b]  # c is beyond the width
    assert out.pop_complete() == ["q"] and out.empty
