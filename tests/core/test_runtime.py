"""The baseline runtime on the ScriptedBackend: round batching, determinism, isolation,
timeouts, cancellation, tools and multi-node segments."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
from conftest import RecordingBackend, RecordingScorer, query_of, tree_texts

from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.app import ToTApp
from spec_tot.config import ExecutorConfig
from spec_tot.errors import ExecutionError
from spec_tot.graph import END, START, ThoughtGraph
from spec_tot.graphs.toy import ANSWER_PREFIX, _answer, _prompt, _route, compile_toy, toy_questions
from spec_tot.policies import create_policy
from spec_tot.policies.base import SearchPolicy
from spec_tot.requests import GenerateRequest, GenerateResult
from spec_tot.seeds import request_seed, seed_key
from spec_tot.tree import NodeStatus

BEAM = {"search": "beam", "search_params": {"n": 4, "width": 2}}


def prompt(state: dict[str, Any]) -> str:
    return "\n".join([state["question"], *state["steps"]])


def is_answer(state: dict[str, Any]) -> bool:
    return bool(state["steps"]) and state["steps"][-1].startswith(ANSWER_PREFIX)


def route(state: dict[str, Any]) -> str:
    return "done" if is_answer(state) else "more"


def answer_of(state: dict[str, Any]) -> str | None:
    return state["steps"][-1][len(ANSWER_PREFIX) :] if is_answer(state) else None


def check(state: dict[str, Any], answer: str | None) -> bool:
    return answer == "24"


def inputs(*ids: str) -> list[dict[str, Any]]:
    return [{"question": f"puzzle {qid}", "query_id": qid} for qid in ids]


def by_id(results: list[Any]) -> dict[str, Any]:
    return {r.query_id: r for r in results}


def scored(result: Any) -> list[Any]:
    return [n for n in result.tree.nodes() if n.parent is not None]


# -- rounds ----------------------------------------------------------------------------------
async def test_reward_calls_batch_whole_rounds_per_query() -> None:
    backend = ScriptedBackend()
    scorer = RecordingScorer(backend)
    policies: list[SearchPolicy] = []

    def factory() -> SearchPolicy:
        policies.append(create_policy("beam", n=4, width=2))
        return policies[-1]

    app = compile_toy(backend=backend, reward=scorer, search=factory)
    batch = await app.arun_batch(inputs("q0", "q1", "q2"))
    assert backend.num_score_calls == 0  # the compile-time reward wins over the backend
    assert len(policies) == 3  # one fresh policy per query
    assert [p.rounds for p in policies] == [3, 3, 3]  # depth 3: three rounds
    for batch_ids in scorer.batches:
        assert len({query_of(i) for i in batch_ids}) == 1  # never mixes queries
    for result in batch.results:
        assert result.status == "ok"
        mine = [b for b in scorer.batches if query_of(b[0]) == result.query_id]
        assert len(mine) == 3  # one reward call per round
        depths: dict[int, set[str]] = {}
        for node in scored(result):
            assert node.status is NodeStatus.SCORED
            depths.setdefault(node.depth, set()).add(node.id)
        # every batch is exactly one round: all of that round's candidates
        assert [set(b) for b in mine] == [depths[d] for d in sorted(depths)]
        assert [len(b) for b in mine] == [4, 4, 4]
    assert batch.metrics.reward_calls == len(scorer.batches) == 9
    assert batch.metrics.reward_items == 36


async def test_backend_scores_by_round_when_it_is_the_reward() -> None:
    backend = RecordingBackend()
    app = compile_toy(backend=backend, **BEAM)
    batch = await app.arun_batch(inputs("q0", "q1"))
    assert backend.num_score_calls == len(backend.score_batches) == 6
    for result in batch.results:
        mine = [b for b in backend.score_batches if query_of(b[0]) == result.query_id]
        assert len(mine) == 3
        assert sorted(i for b in mine for i in b) == sorted(n.id for n in scored(result))


async def test_round_waits_for_its_straggler() -> None:
    # One sibling is 8x slower: the round's batch must still hold all four candidates.
    config = ScriptedConfig(token_latency_s=0.0005, straggler_rate=0.3)
    backend = ScriptedBackend(config)
    scorer = RecordingScorer(backend)
    app = compile_toy(backend=backend, reward=scorer, **BEAM)
    result = (await app.arun_batch(inputs("q0"))).results[0]
    assert result.status == "ok"
    assert [len(b) for b in scorer.batches] == [4, 4, 4]


async def test_best_of_n_runs_until_every_trace_ends() -> None:
    backend = ScriptedBackend(ScriptedConfig(depth=2))
    app = compile_toy(backend=backend, search="best_of_n", search_params={"n": 5})
    result = (await app.arun_batch(inputs("q0"))).results[0]
    assert result.status == "ok"
    assert len(result.tree.terminals()) == 5
    assert all(n.depth == 2 for n in result.tree.terminals())


# -- determinism -----------------------------------------------------------------------------
async def _run_toy(seed: int, queries: list[dict[str, Any]], **cfg: Any) -> list[Any]:
    backend = ScriptedBackend(ScriptedConfig(**cfg))
    app = compile_toy(backend=backend, config=ExecutorConfig(seed=seed), **BEAM)
    return (await app.arun_batch(queries)).results


async def test_same_seed_same_results_other_seed_differs() -> None:
    queries = inputs("q0", "q1", "q2")
    first = await _run_toy(0, queries)
    second = await _run_toy(0, queries)
    other = await _run_toy(1, queries)
    for a, b in zip(first, second, strict=True):
        assert tree_texts(a) == tree_texts(b)
        assert (a.answer, a.score, a.votes) == (b.answer, b.score, b.votes)
    assert [tree_texts(a) for a in first] != [tree_texts(c) for c in other]
    texts = {t for r in first for t, _ in tree_texts(r).values()}
    assert len(texts) > 4  # not a degenerate constant backend


async def test_the_same_question_asked_twice_gets_the_same_answer() -> None:
    """Seeds derive from the input when no query id is given (not from the auto ids q0,
    q1, ...), and from the user's query id when one is given."""
    backend = ScriptedBackend(ScriptedConfig())
    app = compile_toy(backend=backend, config=ExecutorConfig(seed=5), **BEAM)
    question = {"question": "toy puzzle 7"}
    first, second = (await app.arun_batch([question, question])).results
    assert first.query_id != second.query_id
    third = await app.ainvoke(question)
    texts = [sorted(t for t, _ in tree_texts(r).values()) for r in (first, second, third)]
    assert texts[0] == texts[1] == texts[2]
    assert first.answer == second.answer == third.answer
    # an explicit id is the seed key: the same id gives the same texts, another id others
    named = [await app.ainvoke({**question, "query_id": qid}) for qid in ("a", "a", "b")]
    assert sorted(tree_texts(named[0]).values()) == sorted(tree_texts(named[1]).values())
    assert sorted(tree_texts(named[0]).values()) != sorted(tree_texts(named[2]).values())


class _SeedRecorder(ScriptedBackend):
    def __init__(self) -> None:
        super().__init__(ScriptedConfig())
        self.seeds: dict[str, int | None] = {}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.seeds[request.request_id] = request.sampling.seed
        return await super().generate(request)


async def test_request_seed_agrees_with_the_executor() -> None:
    """``request_seed`` (the public twin a LangGraph run uses) gives every request the seed
    the executor sent, with an explicit query id and with an input-derived seed key."""
    backend = _SeedRecorder()
    app = compile_toy(backend=backend, config=ExecutorConfig(seed=5), **BEAM)
    question = {"question": "toy puzzle 7"}
    for explicit in (None, "a"):
        state = question if explicit is None else {**question, "query_id": explicit}
        backend.seeds.clear()
        result = await app.ainvoke(state)
        # the key of the state the query started from (the input, with the graph's defaults)
        key = seed_key(result.tree.root.state, explicit)
        assert backend.seeds
        for rid, seed in backend.seeds.items():
            assert seed == request_seed(5, result.query_id, rid, key), rid
        if explicit is not None:  # the default key is the explicit id's
            assert all(
                seed == request_seed(5, explicit, rid) for rid, seed in backend.seeds.items()
            )


async def test_results_do_not_depend_on_scheduling() -> None:
    # Alone, fast vs. among others with latency and stragglers: same tree, same answer.
    alone = (await _run_toy(3, inputs("qA")))[0]
    crowded = await _run_toy(
        3, inputs("qB", "qA", "qC"), token_latency_s=0.0003, straggler_rate=0.5
    )
    assert tree_texts(by_id(crowded)["qA"]) == tree_texts(alone)
    assert by_id(crowded)["qA"].answer == alone.answer


def test_stable_seed_is_independent_of_pythonhashseed() -> None:
    code = (
        "import asyncio\n"
        "from spec_tot.seeds import stable_seed\n"
        "from spec_tot.adapters.scripted import ScriptedBackend\n"
        "from spec_tot.requests import GenerateRequest, SamplingParams\n"
        "seeds = [stable_seed(b, k) for b in (0, 7) for k in ('q1/0', 'q1/0/@t', 'x')]\n"
        "r = GenerateRequest('q1/0', SamplingParams(seed=seeds[0]), prompt='a\\nb', n=3)\n"
        "res = asyncio.run(ScriptedBackend().generate(r))\n"
        "print(seeds, [c.text for c in res.completions], hash('q1/0'))\n"
    )
    outputs = []
    for hash_seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.strip())
    stable = [o.rsplit(" ", 1)[0] for o in outputs]
    salted = [o.rsplit(" ", 1)[1] for o in outputs]
    assert salted[0] != salted[1]  # the hash salt really differed
    assert stable[0] == stable[1]


def test_stable_seed_properties() -> None:
    from spec_tot.seeds import stable_seed

    assert stable_seed(0, "q0/1") == stable_seed(0, "q0/1")
    assert stable_seed(0, "q0/1") != stable_seed(1, "q0/1")
    assert stable_seed(0, "q0/1") != stable_seed(0, "q0/2")
    assert all(0 <= stable_seed(s, "k") < 2**31 for s in range(50))


# -- concurrency and isolation ---------------------------------------------------------------
async def test_many_queries_share_one_backend() -> None:
    backend = ScriptedBackend(ScriptedConfig(token_latency_s=0.0002))
    app = compile_toy(backend=backend, **BEAM)
    batch = await app.arun_batch(toy_questions(12))
    assert all(r.status == "ok" for r in batch.results)
    assert len({r.query_id for r in batch.results}) == 12
    # 4 requests per query and round at most: more than 4 at once means queries overlapped
    assert backend.peak_inflight > 4
    assert batch.metrics.peak_inflight > 4
    total_nodes = sum(len(scored(r)) for r in batch.results)
    assert backend.num_generate_calls == total_nodes == 12 * 12
    assert backend.num_inflight == 0


async def test_max_concurrency_limits_queries_in_flight() -> None:
    backend = ScriptedBackend(ScriptedConfig(token_latency_s=0.0002))
    app = compile_toy(backend=backend, **BEAM)
    batch = await app.arun_batch(toy_questions(6), max_concurrency=1)
    assert all(r.status == "ok" for r in batch.results)
    assert backend.peak_inflight <= 4  # one query at a time: one round's width


async def test_failing_requests_fail_only_their_query() -> None:
    backend = ScriptedBackend(ScriptedConfig(fail_prefixes=("q1",)))
    app = compile_toy(backend=backend, **BEAM)
    batch = await app.arun_batch(inputs("q0", "q1", "q10", "q2"))
    results = by_id(batch.results)
    bad = results["q1"]
    assert bad.status == "failed"
    assert bad.answer is None and not bad.solved
    assert len(bad.errors) == 4  # the four children of the root round
    for i, error in enumerate(sorted(bad.errors)):
        assert error.startswith(f"q1/{i}: BackendError")
        assert f"'q1/{i}'" in error and "injected failure" in error
    assert all(n.status is NodeStatus.CANCELLED for n in scored(bad))
    for qid in ("q0", "q10", "q2"):  # "q10" shares a string prefix, not a path prefix
        assert results[qid].status == "ok", results[qid].errors
        assert results[qid].errors == ()
        assert results[qid].answer is not None
    assert batch.metrics.failed == 1
    assert backend.num_inflight == 0


async def test_failing_rewards_fail_only_their_query() -> None:
    backend = RecordingBackend(ScriptedConfig(fail_reward_questions=("puzzle q1",)))
    app = compile_toy(backend=backend, **BEAM)
    batch = await app.arun_batch(inputs("q0", "q1", "q2"))
    results = by_id(batch.results)
    assert results["q1"].status == "failed"
    assert results["q1"].errors
    assert all("BackendError" in e and "puzzle q1" in e for e in results["q1"].errors)
    assert {e.split(":")[0] for e in results["q1"].errors} == {f"q1/{i}" for i in range(4)}
    for qid in ("q0", "q2"):
        assert results[qid].status == "ok"
        assert results[qid].answer is not None
    for batch_ids in backend.score_batches:  # the failing batch held only q1's items
        assert len({query_of(i) for i in batch_ids}) == 1


async def test_hanging_query_times_out_alone() -> None:
    backend = RecordingBackend(ScriptedConfig(hang_prefixes=("q1",)))
    config = ExecutorConfig(query_timeout_s=0.3)
    app = compile_toy(backend=backend, config=config, **BEAM)
    batch = await app.arun_batch(inputs("q0", "q1", "q2"))
    results = by_id(batch.results)
    assert results["q1"].status == "timeout"
    assert results["q1"].answer is None
    assert any("q1" in e and "0.3" in e for e in results["q1"].errors)
    assert results["q1"].latency_s >= 0.29
    for qid in ("q0", "q2"):
        assert results[qid].status == "ok"
        assert results[qid].latency_s < 0.3
    assert backend.num_inflight == 0
    assert "q1" in backend.abort_prefixes
    assert batch.metrics.cancelled == 1 and batch.metrics.failed == 0


async def test_cancelled_query_leaves_nothing_behind() -> None:
    backend = RecordingBackend(ScriptedConfig(token_latency_s=0.002))
    app = compile_toy(backend=backend, **BEAM)
    tasks = {q["query_id"]: asyncio.create_task(app.ainvoke(q)) for q in inputs("q0", "q1", "q2")}
    for _ in range(2000):
        if any(r.startswith("q1/") for r in backend.inflight_ids()):
            break
        await asyncio.sleep(0.001)
    else:
        pytest.fail("q1 never started")
    tasks["q1"].cancel()
    with pytest.raises(asyncio.CancelledError):
        await tasks["q1"]
    assert [r for r in backend.inflight_ids() if query_of(r) == "q1"] == []
    assert "q1" in backend.abort_prefixes  # the prefix abort was sent for the query
    issued = sum(query_of(r) == "q1" for r in backend.request_ids)
    done = await asyncio.wait_for(asyncio.gather(tasks["q0"], tasks["q2"]), 10)
    assert [r.status for r in done] == ["ok", "ok"]
    assert all(r.answer is not None for r in done)
    assert sum(query_of(r) == "q1" for r in backend.request_ids) == issued  # nothing new
    assert backend.num_inflight == 0


async def test_cancellation_aborts_running_requests_on_the_backend() -> None:
    backend = ScriptedBackend(ScriptedConfig(hang_prefixes=("q1",)))
    app = compile_toy(backend=backend, **BEAM)
    task = asyncio.create_task(app.ainvoke({"question": "x", "query_id": "q1"}))
    for _ in range(500):
        if backend.num_inflight == 4:
            break
        await asyncio.sleep(0)
    assert backend.num_inflight == 4
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.num_inflight == 0
    assert backend.num_aborted > 0


# -- graph shapes ----------------------------------------------------------------------------
def _tool_graph(counter: Counter[str], *, before_reward: bool) -> ThoughtGraph:
    def tool(state: dict[str, Any]) -> dict[str, Any]:
        counter["calls"] += 1
        return {"tool_runs": state.get("tool_runs", 0) + 1}

    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r")
    g.add_tool("side", tool)
    g.add_edge(START, "t")
    if before_reward:
        g.add_edge("t", "side")
        g.add_edge("side", "r")
        g.add_conditional_edges("r", route, {"more": "t", "done": END})
    else:
        g.add_edge("t", "r")
        g.add_edge("r", "side")
        g.add_conditional_edges("side", route, {"more": "t", "done": END})
    return g


@pytest.mark.parametrize("before_reward", [False, True])
async def test_tool_runs_once_per_committed_node(before_reward: bool) -> None:
    counter: Counter[str] = Counter()
    app = _tool_graph(counter, before_reward=before_reward).compile(
        backend=ScriptedBackend(), answer=answer_of, **BEAM
    )
    batch = await app.arun_batch(inputs("q0", "q1"))
    nodes = [n for r in batch.results for n in scored(r)]
    assert all(r.status == "ok" for r in batch.results)
    assert all(n.status is NodeStatus.SCORED for n in nodes)
    assert counter["calls"] == len(nodes) == 24
    for node in nodes:  # once per node along its path, never twice for one node
        assert node.state["tool_runs"] == node.depth


async def test_async_tool_is_awaited() -> None:
    seen: list[int] = []

    async def tool(state: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)
        seen.append(len(state["steps"]))
        return {"checked": True}

    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_tool("check", tool)
    g.add_reward("r")
    g.add_edge(START, "t")
    g.add_edge("t", "check")
    g.add_edge("check", "r")
    g.add_conditional_edges("r", route, {"more": "t", "done": END})
    app = g.compile(backend=ScriptedBackend(), answer=answer_of, **BEAM)
    result = (await app.arun_batch(inputs("q0"))).results[0]
    assert result.status == "ok"
    assert len(seen) == len(scored(result))
    assert all(n.state["checked"] is True for n in scored(result))


async def test_root_prewalk_and_two_thoughts_per_segment() -> None:
    backend = RecordingBackend()
    prepped: list[str] = []

    def prep(state: dict[str, Any]) -> dict[str, Any]:
        prepped.append(state["question"])
        return {"prepped": True}

    def act_prompt(state: dict[str, Any]) -> str:
        assert state["prepped"] is True
        return prompt(state)

    g = ThoughtGraph()
    g.add_function("prep", prep)
    g.add_thought("plan", prompt)
    g.add_function("mid", lambda s: {"mids": s.get("mids", 0) + 1})
    g.add_thought("act", act_prompt)
    g.add_reward("r")
    g.add_edge(START, "prep")
    g.add_edge("prep", "plan")
    g.add_edge("plan", "mid")
    g.add_edge("mid", "act")
    g.add_edge("act", "r")
    g.add_conditional_edges("r", route, {"more": "plan", "done": END})
    app = g.compile(backend=backend, answer=answer_of, check=check, **BEAM)
    batch = await app.arun_batch(inputs("q0", "q1"))
    assert [r.status for r in batch.results] == ["ok", "ok"]
    assert sorted(prepped) == ["puzzle q0", "puzzle q1"]  # once per query, at the root
    for result in batch.results:
        assert result.answer in {"24", "23", "25", "12"}
        nodes = scored(result)
        assert {n.depth for n in nodes} == {1, 2}  # two thoughts per step: depth 3 at step 2
        for node in nodes:
            assert node.state["prepped"] is True
            assert node.state["mids"] == node.depth
            assert len(node.state["steps"]) == 2 * node.depth
            assert node.text == node.state["steps"][-2]  # the node's text is its first thought
            assert f"{node.id}/@act" in backend.request_ids
            assert node.id in backend.request_ids
    assert len(backend.request_ids) == 2 * sum(len(scored(r)) for r in batch.results)


async def test_router_key_outside_path_map_fails_the_node() -> None:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r")
    g.add_edge(START, "t")
    g.add_edge("t", "r")
    g.add_conditional_edges("r", lambda s: "sideways", {"more": "t", "done": END})
    app = g.compile(backend=ScriptedBackend(), **BEAM)
    result = (await app.arun_batch(inputs("q0"))).results[0]
    assert result.status == "failed"
    assert len(result.errors) == 4
    for error in result.errors:
        assert "ExecutionError" in error
        assert "router of node 'r' returned 'sideways'" in error
    assert all(n.status is NodeStatus.CANCELLED for n in scored(result))


async def test_router_returning_unknown_node_fails_the_node() -> None:
    # Building without compile() skips validation, so the runtime check is what fires.
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r")
    g.add_edge(START, "t")
    g.add_edge("t", "r")
    g.add_conditional_edges("r", lambda s: "nowhere")
    app = ToTApp.build(
        g,
        search="beam",
        search_params={"n": 2, "width": 1},
        backend=ScriptedBackend(),
        backend_options={},
        reward=None,
        config=None,
        answer=None,
        check=None,
        input_to_state=None,
    )
    result = (await app.arun_batch(inputs("q0"))).results[0]
    assert result.status == "failed"
    assert result.errors
    assert all("unknown node 'nowhere'" in e and "'r'" in e for e in result.errors)


def test_router_without_path_map_compiles() -> None:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r")
    g.add_edge(START, "t")
    g.add_edge("t", "r")
    g.add_conditional_edges("r", lambda s: END if is_answer(s) else "t")
    g.compile(backend=ScriptedBackend())


async def test_function_returning_non_dict_fails_naming_the_node() -> None:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_function("bad", lambda s: ["not", "a", "dict"])
    g.add_reward("r")
    g.add_edge(START, "t")
    g.add_edge("t", "bad")
    g.add_edge("bad", "r")
    g.add_conditional_edges("r", route, {"more": "t", "done": END})
    app = g.compile(backend=ScriptedBackend(), **BEAM)
    result = (await app.arun_batch(inputs("q0"))).results[0]
    assert result.status == "failed"
    assert all("'bad'" in e and "list" in e for e in result.errors)


async def test_scorer_with_wrong_arity_fails_the_query() -> None:
    app = compile_toy(backend=ScriptedBackend(), reward=lambda items: [0.5], **BEAM)
    result = (await app.arun_batch(inputs("q0"))).results[0]
    assert result.status == "failed"
    assert all("returned 1 scores for 4 items" in e for e in result.errors)


async def test_async_scorer_and_plain_float_scores() -> None:
    async def scorer(items: list[Any]) -> list[float]:
        await asyncio.sleep(0)
        return [1.0 if i.steps[-1] == ANSWER_PREFIX + "24" else 0.5 for i in items]

    app = compile_toy(backend=ScriptedBackend(), reward=scorer, **BEAM)
    result = (await app.arun_batch(inputs("q0"))).results[0]
    assert result.status == "ok"
    for node in scored(result):
        assert node.step_scores in ((1.0,), (0.5,))
        assert node.reward == node.step_scores[-1]


async def test_graph_reaching_end_before_a_thought_fails() -> None:
    g = ThoughtGraph()
    g.add_function("gate", lambda s: None)
    g.add_thought("t", prompt)
    g.add_reward("r")
    g.add_edge(START, "gate")
    g.add_conditional_edges(
        "gate", lambda s: "skip" if "skip" in s["question"] else "go", {"go": "t", "skip": END}
    )
    g.add_edge("t", "r")
    g.add_conditional_edges("r", route, {"more": "t", "done": END})
    app = g.compile(backend=ScriptedBackend(), **BEAM)
    batch = await app.arun_batch([{"question": "skip me", "query_id": "qs"}, "go on"])
    skipped, ran = batch.results
    assert skipped.status == "failed"
    assert skipped.errors == ("the graph reached END before any thought node",)
    assert len(skipped.tree) == 1
    assert ran.status == "ok"


async def test_max_nodes_truncates() -> None:
    app = compile_toy(backend=ScriptedBackend(), config=ExecutorConfig(max_nodes=7), **BEAM)
    result = (await app.arun_batch(inputs("q0"))).results[0]
    assert result.truncated
    assert len(result.tree) == 7


async def test_reward_input_error_fails_the_node_without_hanging() -> None:
    calls = Counter[str]()

    def reward_input(state: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("cannot build the reward input")
        return state["question"], tuple(state["steps"])

    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r", reward_input=reward_input)
    g.add_edge(START, "t")
    g.add_edge("t", "r")
    g.add_conditional_edges("r", route, {"more": "t", "done": END})
    app = g.compile(backend=ScriptedBackend(), config=ExecutorConfig(query_timeout_s=0.5), **BEAM)
    result = (await app.arun_batch(inputs("q0"))).results[0]
    assert result.status != "timeout"
    assert any("cannot build the reward input" in e for e in result.errors)


async def test_root_function_error_fails_only_its_query() -> None:
    def prep(state: dict[str, Any]) -> dict[str, Any]:
        if state["question"] == "bad":
            raise ValueError("prep failed")
        return {}

    g = ThoughtGraph()
    g.add_function("prep", prep)
    g.add_thought("t", prompt)
    g.add_reward("r")
    g.add_edge(START, "prep")
    g.add_edge("prep", "t")
    g.add_edge("t", "r")
    g.add_conditional_edges("r", route, {"more": "t", "done": END})
    app = g.compile(backend=ScriptedBackend(), answer=answer_of, **BEAM)
    try:
        batch = await app.arun_batch(["good", "bad", "fine"])
    finally:
        await asyncio.sleep(0.05)  # let orphaned queries (if any) wind down
    statuses = [r.status for r in batch.results]
    assert statuses == ["ok", "failed", "ok"]


async def test_auto_query_ids_never_collide_with_explicit_ones() -> None:
    app = compile_toy(backend=ScriptedBackend(ScriptedConfig(token_latency_s=0.0005)), **BEAM)
    batch = await app.arun_batch([{"question": "a", "query_id": "q1"}, "b", "c"])
    ids = [r.query_id for r in batch.results]
    assert len(set(ids)) == 3, ids
    assert all(r.status == "ok" for r in batch.results)


def test_execution_error_is_runtime_error() -> None:
    assert issubclass(ExecutionError, RuntimeError)


def test_router_loop_without_a_path_map_fails_the_query_instead_of_spinning() -> None:
    graph = ThoughtGraph()
    graph.add_thought("t", _prompt)
    graph.add_function("f", lambda s: {"n": s.get("n", 0) + 1})
    graph.add_reward("r")
    graph.add_edge(START, "t")
    graph.add_edge("t", "f")
    graph.add_conditional_edges("f", lambda s: "f" if s["n"] > 0 else "r")  # loops on f
    graph.add_conditional_edges("r", _route, {"more": "t", "done": END})
    app = graph.compile(
        backend=ScriptedBackend(),
        search="beam",
        search_params={"n": 2, "width": 1},
        answer=_answer,
        config=ExecutorConfig(query_timeout_s=5.0),
    )
    result = app.run_batch(["q"]).results[0]
    assert result.status == "failed"
    assert any("'f' is on a loop" in e for e in result.errors)
