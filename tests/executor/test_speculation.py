"""The speculative executor's guarantees, case by case: SpecScale early pruning (EP), SPEX
adoption and metrics, T3 early termination, the T2 budget and the LV flush rules.

Property tests over random schedules are in ``test_speculation_props.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from spec_helpers import (
    SPEC_MODES,
    LatencyBackend,
    OneRuleRouter,
    committed,
    fingerprint,
    inputs,
    make_app,
    tick_fn,
    toy_graph,
)

from spec_tot.adapters.scripted import ScriptedConfig
from spec_tot.adapters.sim import run_virtual
from spec_tot.config import LazyVerification
from spec_tot.errors import ConfigError
from spec_tot.executor.pruning import early_prune_threshold
from spec_tot.executor.reward_router import RewardRouter, calibrated_lv
from spec_tot.graph import GraphNode, NodeKind
from spec_tot.metrics import MetricsRecorder
from spec_tot.nodes import default_reward_item
from spec_tot.requests import Capabilities, RewardItem
from spec_tot.seeds import stable_seed
from spec_tot.tree import Node, NodeStatus

BEAM6 = {"n": 6, "width": 2, "max_depth": 6}  # k = 3
TOT_BFS = {"breadth": 3, "width": 3, "max_depth": 4}  # k = 3


def straggly(seed: int, **extra: Any) -> LatencyBackend:
    """Shuffled arrivals on a virtual clock (loop ticks): deterministic, and no real sleeps.
    Generation latency is long-tailed: a fifth of the requests are 10x slower."""

    def gen(rid: str) -> int:
        ticks = tick_fn(seed, 6)(rid)
        return ticks * 10 if stable_seed(seed + 7, rid) % 5 == 0 else ticks

    return LatencyBackend(
        ScriptedConfig(seed=seed, depth=4, straggler_rate=0.3, **extra),
        gen_latency=gen,
        reward_latency=tick_fn(seed + 1, 3),
    )


async def run(
    policy: str, mode: str, seed: int, *, params: dict[str, Any] | None = None, **kw: Any
) -> tuple[Any, LatencyBackend]:
    mixed = kw.pop("mixed", False)
    backend = straggly(seed)
    app = make_app(backend, policy, mode, graph=toy_graph(mixed=mixed), params=params, **kw)
    batch = await app.arun_batch(inputs("q0", "q1"))
    assert backend.num_inflight == 0
    return batch, backend


# -- EP --------------------------------------------------------------------------------------
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
        base, _ = await run(policy, "baseline", seed, params=params)
        got, _ = await run(
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
        base, _ = await run("beam", "baseline", seed, params=BEAM6, mixed=True)
        for mode in ("specscale", "full"):
            got, _ = await run(
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


# -- adoption and metrics --------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["naive", "spex"])
async def test_adopted_speculative_nodes_are_the_baseline_nodes(mode: str) -> None:
    adopted_total = 0
    for seed in range(3):
        base, base_backend = await run("beam", "baseline", seed, params=BEAM6)
        got, backend = await run("beam", mode, seed, params=BEAM6)
        base_nodes = {n.id: n for r in base.results for n in r.tree.nodes()}
        base_requests = {r.request_id: r for r in base_backend.requests}
        final = {n.id: n for r in got.results for n in r.tree.nodes()}
        adopted = [
            r for r in backend.requests if r.speculative and not final[r.request_id].speculative
        ]
        adopted_total += len(adopted)
        for request in adopted:
            node, twin = final[request.request_id], base_nodes[request.request_id]
            assert (node.text, node.reward, node.terminal) == (
                twin.text,
                twin.reward,
                twin.terminal,
            )
            # the very same request the baseline sent, apart from its priority class
            same = base_requests[request.request_id]
            assert (request.prompt, request.sampling) == (same.prompt, same.sampling)
        assert got.metrics.speculative_hits >= len({r.request_id for r in adopted})
    assert adopted_total > 0


@pytest.mark.parametrize("mode", SPEC_MODES)
async def test_hit_rate_and_wasted_tokens(mode: str) -> None:
    base, _ = await run("rebase", "baseline", 0)
    got, _ = await run("rebase", mode, 0)
    assert base.metrics.wasted_tokens == 0
    assert base.metrics.speculative_nodes == 0 and base.metrics.spec_hit_rate == 0.0
    m = got.metrics
    assert 0.0 <= m.spec_hit_rate <= 1.0
    assert m.speculative_hits <= m.speculative_nodes
    if mode in ("naive", "spex"):
        assert m.spec_hit_rate > 0
    if mode == "naive":
        assert m.wasted_tokens > 0
    assert m.wasted_tokens <= m.output_tokens


# -- T3 --------------------------------------------------------------------------------------
T3 = {"early_termination": True, "et_min_answers": 2, "et_alpha": 0.5}


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
        plain, _ = await run(policy, "spex", seed, params=params)
        early, _ = await run(policy, "spex", seed, params=params, speculation_overrides=T3)
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


# -- T2 (the dispatcher's own rules: tests/executor/test_dispatcher.py) ---------------------
class SmallEngine(LatencyBackend):
    """Saturates at 3 sequences: the T2 budget must keep speculation within that."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="small", saturation_batch=3)

    async def generate(self, request: Any) -> Any:
        spec = sum(1 for r in self.requests if r.speculative and r.request_id in self._inflight)
        self.peak_speculative = max(
            getattr(self, "peak_speculative", 0), spec + request.speculative
        )
        return await super().generate(request)


@pytest.mark.parametrize("mode", ["spex", "full"])
async def test_runtime_speculation_stays_within_the_global_budget(mode: str) -> None:
    for seed in range(3):
        backend = SmallEngine(
            ScriptedConfig(seed=seed, depth=4, straggler_rate=0.3),
            gen_latency=tick_fn(seed, 20),
        )
        app = make_app(backend, "rebase", mode, params={"width": 8})
        batch = await app.arun_batch(inputs("q0", "q1", "q2"))
        assert all(r.status == "ok" for r in batch.results)
        assert getattr(backend, "peak_speculative", 0) <= 3
        assert backend.num_inflight == 0


# -- LV --------------------------------------------------------------------------------------
class CountingScorer:
    """A plain async scorer that records each batch (and can be made slow)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list[str]] = []
        self.delay = delay

    async def __call__(self, items: Sequence[RewardItem]) -> list[float]:
        self.batches.append([i.request_id for i in items])
        if self.delay:
            await asyncio.sleep(self.delay)
        return [0.5 for _ in items]


def reward_node(scorer: CountingScorer) -> GraphNode:
    return GraphNode(
        "r",
        NodeKind.REWARD,
        scorer=scorer,
        reward_input=lambda s: (s["question"], tuple(s["steps"])),
    )


OFF = {"token_threshold": 10**9, "max_deferrals": 10**6, "max_wait_s": 60.0, "spec_flush": 10**6}


def lv(**rules: Any) -> LazyVerification:
    return LazyVerification(**{**OFF, **rules})


async def settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def submit(
    router: RewardRouter, node: GraphNode, node_id: str, *, words: int = 1, spec: bool = True
) -> asyncio.Task[tuple[float, ...]]:
    state = {"question": "", "steps": ["wxyz" * words]}  # tokens: len(text) // 4 = words
    query = node_id.split("/")[0]
    item, scorer = router.prepare(query, node_id, node, state)
    return asyncio.create_task(
        router.score(query, item, scorer, speculative=spec, node_name=node.name)
    )


async def busy(router: RewardRouter) -> tuple[CountingScorer, asyncio.Task[tuple[float, ...]]]:
    """A committed item whose (slow) batch keeps the reward model busy for 50 ms."""
    slow = CountingScorer(delay=0.05)
    task = submit(router, reward_node(slow), "z/0", spec=False)
    await settle()
    assert slow.batches == [["z/0"]]
    return slow, task


async def test_lv_scores_a_committed_item_at_once_while_the_reward_model_is_idle() -> None:
    scorer = CountingScorer()
    router, node = OneRuleRouter(lv()), reward_node(scorer)
    for i in range(3):
        router.expect("q", f"q/{i}")  # its siblings are still generating
    task = submit(router, node, "q/0", spec=False)
    await settle()
    assert scorer.batches == [["q/0"]]  # never held back while nothing is being scored
    assert await task == (0.5,)


async def test_lv_gathers_items_while_a_batch_runs_and_sends_them_when_it_ends() -> None:
    scorer = CountingScorer()
    router, node = OneRuleRouter(lv()), reward_node(scorer)
    _, blocker = await busy(router)
    for i in range(4):
        router.expect("q", f"q/{i}")
    tasks = [submit(router, node, f"q/{i}", spec=False) for i in range(2)]
    tasks.append(submit(router, node, "q/9/0"))  # a speculative item rides along
    await settle()
    assert scorer.batches == []
    await blocker
    await settle()
    assert scorer.batches == [["q/0", "q/1", "q/9/0"]]  # committed work first
    await asyncio.gather(*tasks)


async def test_lv_token_threshold_counts_speculative_items() -> None:
    scorer = CountingScorer()
    router, node = OneRuleRouter(lv(token_threshold=10)), reward_node(scorer)
    _, blocker = await busy(router)
    tasks = [submit(router, node, f"q/{i}", words=3) for i in range(3)]  # 9 tokens
    await settle()
    assert scorer.batches == []
    tasks.append(submit(router, node, "q/3", words=3))  # 12 >= 10: due even while busy
    await settle()
    assert scorer.batches == [["q/0", "q/1", "q/2", "q/3"]]
    assert await asyncio.gather(*tasks) == [(0.5,)] * 4
    await blocker


async def test_lv_complete_sibling_group_triggers_a_flush() -> None:
    scorer = CountingScorer()
    router, node = OneRuleRouter(lv()), reward_node(scorer)
    _, blocker = await busy(router)
    for i in range(3):
        router.expect("q", f"q/{i}")
    spec = submit(router, node, "q/9", spec=True)
    tasks = [submit(router, node, f"q/{i}", spec=False) for i in range(2)]
    await settle()
    assert scorer.batches == []  # 2 of 3 committed siblings wait, the reward model is busy
    tasks.append(submit(router, node, "q/2", spec=False))
    await settle()
    # one batch, committed work first, the waiting speculative item rides along
    assert scorer.batches == [["q/0", "q/1", "q/2", "q/9"]]
    await asyncio.gather(spec, blocker, *tasks)


async def test_lv_group_counts_branches_that_ended_unscored() -> None:
    scorer = CountingScorer()
    router, node = OneRuleRouter(lv()), reward_node(scorer)
    _, blocker = await busy(router)
    router.expect("q", "q/0")
    router.expect("q", "q/1")
    task = submit(router, node, "q/0", spec=False)
    await settle()
    assert scorer.batches == []
    router.release("q", "q/1")  # its sibling failed
    await settle()
    assert scorer.batches == [["q/0"]]
    await asyncio.gather(task, blocker)


async def test_lv_deferral_limit_triggers_a_flush() -> None:
    scorer = CountingScorer()
    router, node = OneRuleRouter(lv(max_deferrals=2)), reward_node(scorer)
    tasks = [submit(router, node, "q/0")]
    await settle()
    tasks.append(submit(router, node, "q/1"))
    await settle()
    assert scorer.batches == []  # q/0 deferred twice now
    tasks.append(submit(router, node, "q/2"))
    await settle()
    assert scorer.batches == [["q/0", "q/1", "q/2"]]
    await asyncio.gather(*tasks)


def test_lv_counts_one_deferral_per_clock_instant() -> None:
    """Ticks set off at one instant (one engine step's results and what they trigger) are
    one scheduling opportunity, not many."""

    async def main() -> list[list[str]]:
        scorer = CountingScorer()
        router = OneRuleRouter(lv(max_deferrals=2))
        node = reward_node(scorer)
        tasks = [submit(router, node, f"q/{i}") for i in range(1)]
        for i in range(1, 4):  # three more ticks, virtual clock standing still
            await settle()
            tasks.append(submit(router, node, f"q/{i}"))
        await settle()
        assert scorer.batches == []
        await asyncio.sleep(0.001)  # the next instant: the second deferral, then a flush
        tasks.append(submit(router, node, "q/4"))
        await settle()
        await asyncio.sleep(0.001)
        tasks.append(submit(router, node, "q/5"))
        await settle()
        await asyncio.gather(*tasks)
        return scorer.batches

    batches = run_virtual(main())
    assert batches == [["q/0", "q/1", "q/2", "q/3", "q/4", "q/5"]]


async def test_lv_wall_clock_bound_triggers_a_flush() -> None:
    scorer = CountingScorer()
    router, node = OneRuleRouter(lv(max_wait_s=0.02)), reward_node(scorer)
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await asyncio.wait_for(submit(router, node, "q/0"), timeout=1.0)
    assert result == (0.5,)
    assert scorer.batches == [["q/0"]]
    assert loop.time() - started >= 0.015


async def test_lv_speculative_backlog_triggers_a_flush() -> None:
    scorer = CountingScorer()
    router, node = OneRuleRouter(lv(spec_flush=3)), reward_node(scorer)
    tasks = [submit(router, node, f"q/{i}") for i in range(2)]
    await settle()
    assert scorer.batches == []  # speculative items alone are not urgent
    tasks.append(submit(router, node, "q/2"))
    await settle()
    assert scorer.batches == [["q/0", "q/1", "q/2"]]
    await asyncio.gather(*tasks)


async def test_lv_batches_across_queries_and_records_calls() -> None:
    scorer = CountingScorer()
    recorder = MetricsRecorder()
    router, node = OneRuleRouter(lv(token_threshold=4), recorder), reward_node(scorer)
    tasks = [submit(router, node, f"q{i}/0", words=1, spec=False) for i in range(4)]
    await settle()
    assert scorer.batches == [["q0/0", "q1/0", "q2/0", "q3/0"]]  # one loop tick, one batch
    assert recorder.reward_calls == 1 and recorder.reward_items == 4
    await asyncio.gather(*tasks)


async def test_lv_defer_speculative_holds_speculative_items_until_confirmed() -> None:
    """Opt-in ``defer_speculative``: speculative items never make a batch due, never ride
    along, and are scored once adopted; a pruned one is never scored at all."""
    scorer = CountingScorer()
    router = OneRuleRouter(lv(token_threshold=4, defer_speculative=True))
    node = reward_node(scorer)
    kept = submit(router, node, "q/0/0", words=5)  # 5 tokens >= 4: would be due if counted
    pruned = submit(router, node, "q/1/0", words=5)
    await settle()
    assert scorer.batches == []
    parent = submit(router, node, "q/0", spec=False)  # committed, reward model idle: at once
    await settle()
    assert scorer.batches == [["q/0"]]
    await parent
    pruned.cancel()  # early pruning cancels the branch before its turn
    router.expect("q", "q/0/0")  # the round selected q/0: its child is committed now
    await settle()
    assert scorer.batches == [["q/0"], ["q/0/0"]]
    assert await kept == (0.5,)
    await asyncio.gather(pruned, return_exceptions=True)


async def test_round_rule_waits_for_the_whole_round_and_eager_does_not() -> None:
    scorer = CountingScorer()
    router, node = OneRuleRouter("round"), reward_node(scorer)
    for i in range(2):
        router.expect("q", f"q/{i}")
    first = submit(router, node, "q/0", spec=False)
    await settle()
    assert scorer.batches == []
    second = submit(router, node, "q/1", spec=False)
    await settle()
    assert scorer.batches == [["q/0", "q/1"]]
    await asyncio.gather(first, second)

    eager_scorer = CountingScorer()
    eager, enode = OneRuleRouter("eager"), reward_node(eager_scorer)
    for i in range(2):
        eager.expect("q", f"q/{i}")
    task = submit(eager, enode, "q/0", spec=False)
    await settle()
    assert eager_scorer.batches == [["q/0"]]
    await task


async def test_lv_forget_cancels_a_query_pending_items_only() -> None:
    scorer = CountingScorer()
    router, node = OneRuleRouter(lv(spec_flush=3)), reward_node(scorer)
    a = submit(router, node, "qa/0")
    b = submit(router, node, "qb/0")
    await settle()
    router.forget("qa")
    await settle()
    assert a.cancelled()
    c, d = submit(router, node, "qb/1"), submit(router, node, "qb/2")
    await settle()
    assert scorer.batches == [["qb/0", "qb/1", "qb/2"]]
    await asyncio.gather(b, c, d)


# -- bugs ------------------------------------------------------------------------------------
async def test_lv_adoption_after_the_reward_flush_keeps_the_group_rule_working() -> None:
    """What the controller does for a running speculative branch, replayed on the router:
    the branch's reward batch is already being scored when the branch is adopted."""
    scorer = CountingScorer(delay=0.01)
    router = OneRuleRouter(lv())
    node = reward_node(scorer)
    router.expect("q", "q/0")
    spec = submit(router, node, "q/0/0", spec=True)  # speculative child of q/0
    parent = submit(router, node, "q/0", spec=False)
    await settle()
    assert scorer.batches == [["q/0", "q/0/0"]]  # at once; scoring now
    # the policy selects q/0: its speculative child is adopted while its batch is in flight
    router.expect("q", "q/0/0")
    await parent
    await spec
    # next round: one committed child, waiting at its reward: the group is complete
    router.expect("q", "q/0/0/0")
    nxt = submit(router, node, "q/0/0/0", spec=False)
    await settle()
    try:
        assert len(scorer.batches) == 2, "the complete sibling group was not flushed"
    finally:
        router.forget("q")
        await asyncio.gather(nxt, return_exceptions=True)


@pytest.mark.parametrize("mode", ["specscale", "full"])
async def test_lv_group_rule_alone_drives_mcts_with_a_tool_after_the_reward(mode: str) -> None:
    """Repro (deterministic, virtual clock): MCTS (width 2, 6 iterations), scripted seed 0
    depth 4, generation latency tick_fn(0, 5) ticks, graph thought -> reward -> tool
    (non-speculable) -> route, LV with only the sibling-group rule in reach (token_threshold
    1e9, max_deferrals 1e6, spec_flush 1e6, max_wait_s 60). The query times out (0.5 s)
    instead of finishing in milliseconds; with the default LV it waits max_wait_s per round."""
    backend = LatencyBackend(ScriptedConfig(seed=0, depth=4), tick_fn(0, 5), tick_fn(1, 0))
    app = make_app(
        backend,
        "mcts",
        mode,
        graph=toy_graph(tool_after=lambda state: None),
        speculation_overrides={"lv": OFF},
        query_timeout_s=0.5,
    )
    result = (await app.arun_batch(inputs("q0"))).results[0]
    assert backend.num_inflight == 0
    assert result.status == "ok", result.errors


@pytest.mark.parametrize("mode", ["naive", "spex"])
async def test_deterministic_failures_do_not_change_the_search(mode: str) -> None:
    """Repro (deterministic, virtual clock): scripted seed 2, beam n=4 width=2 max_depth 5,
    fail_prefixes = the first child of every root child, generation latency tick_fn(1, 5).
    Baseline commits q0/x/0 (failed) + q0/x/1 for each selected x; naive/spex commit
    q0/x/1 + q0/x/2 (q0/x/2 does not exist in the baseline) and the later rounds differ."""
    fail = ("q0/0/0", "q0/1/0", "q0/2/0", "q0/3/0")

    async def one(mode: str) -> Any:
        backend = LatencyBackend(
            ScriptedConfig(seed=2, fail_prefixes=fail), tick_fn(1, 5), tick_fn(2, 0)
        )
        app = make_app(backend, "beam", mode, params={"n": 4, "width": 2, "max_depth": 5})
        return (await app.arun_batch(inputs("q0"))).results[0]

    base, got = await one("baseline"), await one(mode)
    assert set(fingerprint(got).nodes) == set(fingerprint(base).nodes)
    assert fingerprint(got) == fingerprint(base)


def test_lv_is_calibrated_per_backend_unless_the_user_set_the_value() -> None:
    caps = Capabilities(reward_batch_tokens=512, reward_batch_s=0.2)
    default = LazyVerification()
    assert calibrated_lv(default, None, caps) == replace(
        default, token_threshold=512, max_wait_s=0.2
    )
    named = LazyVerification(max_wait_s=1.5)  # from the dict {"max_wait_s": 1.5}
    assert calibrated_lv(named, {"max_wait_s": 1.5}, caps) == replace(named, token_threshold=512)
    assert calibrated_lv(named, named, caps) == named  # an object sets every value
    assert calibrated_lv(default, None, Capabilities()) == default  # nothing measured


async def test_lv_time_rules_rest_while_the_engine_is_loaded() -> None:
    """Under committed load an early score only steers speculation: the deferral and
    wall-clock rules rest; sibling groups and the token threshold still work."""
    scorer = CountingScorer()
    full = [True]
    router = OneRuleRouter(lv(max_wait_s=0.01, max_deferrals=1), saturated=lambda: full[0])
    node = reward_node(scorer)
    first = submit(router, node, "q/0/0")  # speculative, waiting
    await asyncio.sleep(0.05)
    assert scorer.batches == []
    # load falls when a committed request finishes; its branch then reaches the router
    full[0] = False
    second = submit(router, node, "q/1/0")
    await asyncio.wait_for(asyncio.gather(first, second), timeout=1.0)
    assert scorer.batches == [["q/0/0", "q/1/0"]]  # q/0/0 waited past the bound: both go
    router.forget("q")


class _SlotCountingBackend(LatencyBackend):
    """Saturation batch 3; records the most speculative generations in flight at once."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.speculative_now = self.peak_speculative = self.speculative_total = 0

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="slots", saturation_batch=3, max_running_requests=64)

    async def generate(self, request: Any) -> Any:
        if not request.speculative:
            return await super().generate(request)
        self.speculative_now += 1
        self.speculative_total += 1
        self.peak_speculative = max(self.peak_speculative, self.speculative_now)
        try:
            return await super().generate(request)
        finally:
            self.speculative_now -= 1


@pytest.mark.parametrize("policy", ["beam", "mcts"])
async def test_t2_bounds_speculative_generation_not_branches_waiting_for_rewards(
    policy: str,
) -> None:
    """T2's room is engine capacity: a speculative branch holds a slot while it generates,
    and gives it back while it waits for its (slow) reward."""
    backend = _SlotCountingBackend(ScriptedConfig(seed=0, depth=4), tick_fn(0, 4), tick_fn(1, 30))
    app = make_app(backend, policy, "full")
    batch = await app.arun_batch(inputs("q0", "q1"))
    assert all(r.status == "ok" for r in batch.results)
    assert backend.num_inflight == 0
    assert backend.speculative_total > 0
    # committed work may already fill the 3 slots; speculation never adds past the room
    assert backend.peak_speculative <= 3


def test_bad_lazy_verification_and_capability_values_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"lv\.defer_speculative"):
        LazyVerification(defer_speculative="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="reward_batch_s"):
        Capabilities(reward_batch_s=0.0)
    with pytest.raises(ConfigError, match="reward_batch_s"):
        Capabilities(reward_batch_s=float("nan"))


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


async def test_lazy_verification_does_not_flush_on_a_group_already_being_scored() -> None:
    calls: list[list[str]] = []
    release = asyncio.Event()  # A's batch stays in flight until the check is done

    async def scorer(items: list) -> list[float]:
        calls.append([i.request_id for i in items])
        await release.wait()
        return [0.5] * len(items)

    node = GraphNode("r", NodeKind.REWARD, scorer=scorer, reward_input=default_reward_item)
    lv = LazyVerification(token_threshold=10_000, max_deferrals=1000, max_wait_s=5.0)
    router = OneRuleRouter(lv)
    state = {"question": "q", "steps": ["s"]}
    for i in range(2):
        router.expect("A", f"A/{i}")
    for i in range(3):
        router.expect("B", f"B/{i}")

    def score(query: str, node_id: str) -> asyncio.Task[tuple[float, ...]]:
        item, scorer = router.prepare(query, node_id, node, state)
        return asyncio.create_task(
            router.score(query, item, scorer, speculative=False, node_name="r")
        )

    a = [score("A", f"A/{i}") for i in range(2)]
    for _ in range(200):  # A's complete group is sent at once
        if calls:
            break
        await asyncio.sleep(0.005)
    b = score("B", "B/0")
    await asyncio.sleep(0.03)  # room for a wrong flush of B/0 to happen
    assert calls == [["A/0", "A/1"]]  # B/0 waits for its own group (or the timer)
    router.forget("B")
    release.set()
    await asyncio.gather(*a, b, return_exceptions=True)


async def test_naive_continues_every_finished_candidate_not_just_the_predicted_ones() -> None:
    counts = {}
    for speculate in ("all", "ranked"):
        backend = LatencyBackend(
            ScriptedConfig(), gen_latency=tick_fn(3, 30), reward_latency=tick_fn(4, 5)
        )
        app = make_app(backend, "beam", "naive", speculation_overrides={"speculate": speculate})
        batch = await app.arun_batch(inputs("a", "b", "c"))
        counts[speculate] = batch.metrics.speculative_nodes
    assert counts["all"] > counts["ranked"]
