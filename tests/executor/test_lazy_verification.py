"""The reward flush rules (``executor/reward_rules.py``, run by ``executor/reward_router.py``):
SpecScale lazy verification (LV), the round rule and the eager rule."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from spec_helpers import (
    LatencyBackend,
    OneRuleRouter,
    inputs,
    make_app,
    tick_fn,
    toy_graph,
)

from spec_tot.adapters.scripted import ScriptedConfig
from spec_tot.adapters.sim import run_virtual
from spec_tot.config import LazyVerification
from spec_tot.errors import ConfigError
from spec_tot.executor.reward_router import RewardRouter, calibrated_lv
from spec_tot.graph import GraphNode, NodeKind
from spec_tot.graph_nodes import default_reward_item
from spec_tot.metrics import MetricsRecorder
from spec_tot.requests import Capabilities, RewardItem

# Every LV rule off unless a test turns it on.
OFF = {"token_threshold": 10**9, "max_deferrals": 10**6, "max_wait_s": 60.0, "spec_flush": 10**6}


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


def test_bad_lazy_verification_and_capability_values_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"lv\.defer_speculative"):
        LazyVerification(defer_speculative="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="reward_batch_s"):
        Capabilities(reward_batch_s=0.0)
    with pytest.raises(ConfigError, match="reward_batch_s"):
        Capabilities(reward_batch_s=float("nan"))
