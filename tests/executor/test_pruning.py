"""What the controller prunes (``executor/pruning.py``): SpecScale early pruning (EP) keeps
the baseline's selection, SPEX T3 early termination is opt-in and stops on the answer the
policy returns, the full-score shortcut never hangs."""

from __future__ import annotations

from typing import Any

import pytest
from spec_helpers import (
    LatencyBackend,
    committed,
    fingerprint,
    inputs,
    make_app,
    run_two,
    tick_fn,
)

from spec_tot.adapters.scripted import ScriptedConfig
from spec_tot.executor.pruning import early_prune_threshold
from spec_tot.tree import Node, NodeStatus

BEAM6 = {"n": 6, "width": 2, "max_depth": 6}  # k = 3
TOT_BFS = {"breadth": 3, "width": 3, "max_depth": 4}  # k = 3
T3 = {"early_termination": True, "et_min_answers": 2, "et_alpha": 0.5}


def _node(seq: int, reward: float | None, *, terminal: bool = False, status: Any = None) -> Node:
    node = Node(id=f"q/{seq}", parent=None, depth=1, key=(seq,), reward=reward, terminal=terminal)
    node.status = status or NodeStatus.SCORED
    return node


def test_ep_threshold_is_the_kth_best_non_terminal_score() -> None:
    nodes = [_node(0, 0.9), _node(1, 0.5), _node(2, 0.7), _node(3, 0.1)]
    assert early_prune_threshold(nodes, 1) == 0.9
    assert early_prune_threshold(nodes, 2) == 0.7
    assert early_prune_threshold(nodes, 4) == 0.1
    assert early_prune_threshold(nodes, 5) is None  # fewer than k scored: no threshold yet
    assert early_prune_threshold(nodes, 0) is None
    # terminals, unscored and cancelled candidates do not count towards k
    others = [
        _node(4, 0.99, terminal=True),
        _node(5, None, status=NodeStatus.RUNNING),
        _node(6, 0.95, status=NodeStatus.CANCELLED),
    ]
    assert early_prune_threshold(nodes + others, 2) == 0.7
    # ties: the k-th best is the tie value, so tied candidates are not "strictly below"
    tied = [_node(0, 0.5), _node(1, 0.5), _node(2, 0.5), _node(3, 0.2)]
    assert early_prune_threshold(tied, 2) == 0.5


@pytest.mark.parametrize(("policy", "params"), [("beam", BEAM6), ("tot_bfs", TOT_BFS)])
async def test_ep_prunes_and_cancels_speculative_children_keeping_the_selection(
    policy: str, params: dict[str, Any] | None
) -> None:
    """Eager scoring (no LV) so that rounds resolve one reward at a time: a node that was in
    the top k when it was speculated on can fall below the k-th best later."""
    pruned_with_children = 0
    total_pruned = 0
    for seed in range(4):
        base, _ = await run_two(policy, "baseline", seed, params=params)
        got, _ = await run_two(
            policy, "specscale", seed, params=params, speculation_overrides={"lv": None}
        )
        assert [fingerprint(r) for r in got.results] == [fingerprint(r) for r in base.results]
        for result in got.results:
            tree = result.tree
            pruned = tree.by_status(NodeStatus.PRUNED)
            total_pruned += len(pruned)
            for node in pruned:
                assert not node.terminal and not node.speculative
                # strictly below the k-th best non-terminal score of its round
                assert node.parent is not None
                keep = 3
                # (in BFS policies a round is one depth level of the committed tree)
                scores = sorted(
                    (n.reward for n in committed(tree) if n.depth == node.depth and not n.terminal),
                    reverse=True,
                )
                assert node.reward is not None and node.reward < scores[keep - 1]
                # never selected, and its speculative subtree is cancelled
                for sub in list(node.subtree())[1:]:
                    assert sub.speculative and sub.status is NodeStatus.CANCELLED
                pruned_with_children += bool(node.children)
    assert total_pruned > 0
    assert pruned_with_children > 0


async def test_ep_never_prunes_terminal_candidates() -> None:
    """With the mixed graph terminal and non-terminal candidates compete in one round; some
    terminals score below the k-th best non-terminal, and they must survive (they count as
    finished beams, apart from the top k)."""
    low_terminals = 0
    for seed in range(6):
        base, _ = await run_two("beam", "baseline", seed, params=BEAM6, mixed=True)
        for mode in ("specscale", "full"):
            got, _ = await run_two(
                "beam",
                mode,
                seed,
                params=BEAM6,
                mixed=True,
                speculation_overrides={"lv": None},
            )
            assert [fingerprint(r) for r in got.results] == [fingerprint(r) for r in base.results]
            for result in got.results:
                tree = result.tree
                assert not [n for n in tree.by_status(NodeStatus.PRUNED) if n.terminal]
                for depth in {n.depth for n in committed(tree)}:
                    level = [n for n in committed(tree) if n.depth == depth]
                    scores = sorted((n.reward for n in level if not n.terminal), reverse=True)
                    if len(scores) >= 3:
                        low_terminals += sum(
                            1 for n in level if n.terminal and n.reward < scores[2]
                        )
    assert low_terminals > 0  # the rule was exercised


@pytest.mark.parametrize(
    ("policy", "params"),
    [
        ("rest_mcts", {"width": 2, "iterations": 20, "end_gate": 2.0}),
        ("rebase", {"width": 8}),
        ("best_of_n", {"n": 8}),
    ],
)
async def test_t3_stops_earlier_with_an_answer_from_terminal_nodes(
    policy: str, params: dict[str, Any]
) -> None:
    fewer = 0
    for seed in range(3):
        plain, _ = await run_two(policy, "spex", seed, params=params)
        early, _ = await run_two(policy, "spex", seed, params=params, speculation_overrides=T3)
        for a, b in zip(plain.results, early.results, strict=True):
            assert b.status == "ok" and b.answer is not None
            n_plain, n_early = len(committed(a.tree)), len(committed(b.tree))
            assert n_early <= n_plain
            fewer += n_early < n_plain
            finals = [
                n
                for n in b.tree.terminals()
                if not n.speculative and n.status is NodeStatus.SCORED and n.reward is not None
            ]
            assert len(finals) >= T3["et_min_answers"]
            assert b.answer in {n.answer for n in finals}
    assert fewer > 0


async def test_t3_stop_leaves_no_node_running() -> None:
    """Repro (deterministic, virtual clock): rebase width 8, mode spex + T3 (min 2 answers,
    alpha 0.5), scripted seed 0 depth 4 straggler_rate 0.3, generation latency
    tick_fn(0, 20), reward latency tick_fn(1, 3); queries q0, q1. A commit adopts an already
    finished speculative child (queued at once) and starts new committed children; the next
    loop turn takes the adopted child without yielding, T3 fires, and the new children are
    cancelled before their first step."""
    backend = LatencyBackend(
        ScriptedConfig(seed=0, depth=4, straggler_rate=0.3), tick_fn(0, 20), tick_fn(1, 3)
    )
    app = make_app(backend, "rebase", "spex", params={"width": 8}, speculation_overrides=T3)
    batch = await app.arun_batch(inputs("q0", "q1"))
    assert all(r.status == "ok" for r in batch.results)
    assert backend.num_inflight == 0
    stuck = [(n.id, n.status) for r in batch.results for n in r.tree.nodes() if not n.status.final]
    assert stuck == []


def _terminal(tree: Any, answer: str, reward: float) -> None:
    node = tree.add_child(tree.root)
    node.status, node.terminal, node.answer, node.reward = NodeStatus.SCORED, True, answer, reward


@pytest.mark.parametrize(("vote", "stops"), [("best", False), ("majority", True)])
def test_t3_stops_only_on_the_lead_of_the_answer_the_policy_returns(vote: str, stops: bool) -> None:
    """Terminals A, A, A at 0.6 and B at 0.9: A leads by cumulative reward. Beam voting
    "best" answers B, so T3 must not stop on A's lead; voting "majority" answers A, so it
    may."""
    from spec_tot.executor.pruning import should_terminate
    from spec_tot.policies import create_policy
    from spec_tot.tree import SearchTree

    tree = SearchTree("q", "question")
    for answer, reward in (("A", 0.6), ("A", 0.6), ("A", 0.6), ("B", 0.9)):
        _terminal(tree, answer, reward)
    policy = create_policy("beam", n=4, width=2, vote=vote)
    answer = policy.answer(tree)
    assert answer is not None and answer.text == ("B" if vote == "best" else "A")
    assert should_terminate(tree, 4, 0.5, answer.text) is stops
    assert not should_terminate(tree, 4, 0.5, None)
    assert not should_terminate(tree, 5, 0.5, "A")  # too few answers yet


def test_t3_is_opt_in() -> None:
    from spec_tot.config import MODES

    assert not any(spec.early_termination for spec in MODES.values())
    assert not any(spec.ep_full_score for spec in MODES.values())


async def test_full_score_shortcut_never_hangs_on_unstarted_branches() -> None:
    backend = LatencyBackend(
        ScriptedConfig(), gen_latency=tick_fn(14, 30), reward_latency=tick_fn(1014, 20)
    )
    overrides = {
        "ep": True,
        "ep_full_score": True,
        "full_score": 0.0,  # every score is "full": the shortcut fires on every round
        "max_speculative_per_query": 2,
    }
    app = make_app(backend, "beam", "naive", query_timeout_s=5.0, speculation_overrides=overrides)
    result = (await app.arun_batch(inputs("a"))).results[0]
    assert result.status == "ok"
    assert backend.num_inflight == 0
