"""The search tree owns its nodes' lifecycle: each transition moves a node only from the
states that allow it, and refuses the rest naming the node and the move."""

from __future__ import annotations

import pytest

from spec_tot.errors import ExecutionError, IllegalTransition
from spec_tot.tree import Node, NodeStatus, SearchTree


def _tree() -> tuple[SearchTree, Node, Node]:
    tree = SearchTree("q", "question")
    committed = tree.add_child(tree.root)
    speculative = tree.add_child(tree.root, speculative=True)
    return tree, committed, speculative


def test_a_committed_node_starts_scores_and_is_pruned() -> None:
    tree, node, _ = _tree()
    assert node.status is NodeStatus.PENDING
    tree.start(node)
    tree.score(node)
    tree.prune(node)
    assert node.status is NodeStatus.PRUNED and not node.speculative
    with pytest.raises(IllegalTransition, match=r"'q/0': cannot cancel a pruned node"):
        tree.cancel(node)  # a result that stands is past cancelling


def test_a_speculative_node_is_adopted_once_and_is_committed_after() -> None:
    tree, _, spec = _tree()
    assert spec.status is NodeStatus.SPECULATIVE and spec.speculative
    with pytest.raises(IllegalTransition, match="cannot score a speculative speculative node"):
        tree.score(spec)  # only a committed run's end scores a node
    with pytest.raises(IllegalTransition, match="cannot start"):
        tree.start(spec)
    tree.adopt(spec, NodeStatus.SCORED)
    assert spec.status is NodeStatus.SCORED and not spec.speculative
    with pytest.raises(IllegalTransition, match="cannot adopt"):
        tree.adopt(spec, NodeStatus.RUNNING)  # adopted twice
    with pytest.raises(IllegalTransition, match="adopt as pruned"):
        tree.adopt(tree.add_child(tree.root, speculative=True), NodeStatus.PRUNED)


def test_a_failed_speculative_node_is_adopted_as_the_failure() -> None:
    tree, _, spec = _tree()
    tree.cancel(spec)
    tree.cancel(spec)  # idempotent
    assert spec.speculative and spec.status is NodeStatus.CANCELLED
    tree.adopt(spec, NodeStatus.CANCELLED)
    assert not spec.speculative and spec.status is NodeStatus.CANCELLED


def test_revive_runs_a_cancelled_node_again_as_what_it_is() -> None:
    tree, node, spec = _tree()
    tree.start(node)
    tree.cancel(node)
    tree.revive(node)
    assert node.status is NodeStatus.RUNNING
    tree.cancel(spec)
    tree.revive(spec)
    assert spec.status is NodeStatus.SPECULATIVE
    tree.revive(spec)  # running already: it goes on
    tree.score(node)
    with pytest.raises(IllegalTransition, match="cannot revive a scored node"):
        tree.revive(node)


def test_illegal_moves_are_execution_errors() -> None:
    tree, node, _ = _tree()
    with pytest.raises(ExecutionError):
        tree.prune(node)  # pending: nothing to prune yet
    assert node.status is NodeStatus.PENDING  # a refused move changes nothing
