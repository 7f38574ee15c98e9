"""The baseline runtime: one ``QueryRunner`` per query, all sharing one backend.

Rounds run as search-and-learn runs them: every committed expansion of a round is generated,
the round's candidates are scored together in one reward batch once every live branch has
reached its reward node, then the policy selects. A query's failure, timeout or cancellation
touches no other query, and always ends with ``abort(query_id)`` so that it leaves no
in-flight request behind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from spec_tot._private.compiled import CompiledGraph, apply_update, maybe_await, stable_seed
from spec_tot._private.scoring import RewardRouter
from spec_tot.backends import GenerationBackend
from spec_tot.config import ExecutorConfig
from spec_tot.errors import ExecutionError
from spec_tot.graph import END, GraphNode, NodeKind, State
from spec_tot.metrics import MetricsRecorder, QueryRecord
from spec_tot.policies.base import Answer, Expansion, SearchPolicy
from spec_tot.requests import FinishReason, GenerateRequest, Priority
from spec_tot.tree import Node, NodeStatus, SearchTree, aggregate_scores

__all__ = ["QueryOutcome", "QueryRunner"]


@dataclass(frozen=True, slots=True)
class QueryOutcome:
    tree: SearchTree
    answer: Answer | None
    errors: tuple[str, ...]
    truncated: bool


class QueryRunner:
    """Runs one query's search to completion under the baseline schedule."""

    def __init__(
        self,
        *,
        graph: CompiledGraph,
        tree: SearchTree,
        policy: SearchPolicy,
        backend: GenerationBackend,
        rewards: RewardRouter,
        recorder: MetricsRecorder,
        config: ExecutorConfig,
        answer_fn: Any,
    ) -> None:
        self.graph = graph
        self.tree = tree
        self.policy = policy
        self.backend = backend
        self.rewards = rewards
        self.recorder = recorder
        self.config = config
        self.answer_fn = answer_fn
        self._reported: asyncio.Queue[Node] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._outstanding = 0
        self._errors: list[str] = []
        self._truncated = False

    async def run(self) -> QueryOutcome:
        try:
            await self._search()
        finally:
            await self._shutdown()
        answer = self.policy.answer(self.tree)
        return QueryOutcome(self.tree, answer, tuple(self._errors), self._truncated)

    async def _search(self) -> None:
        root = self.tree.root
        entry = self.graph.entry(root.state)
        resume, root.state = await self.graph.walk_to_thought(entry, root.state, _no_wait)
        root.resume_at = resume
        if resume is None:
            self._errors.append("the graph reached END before any thought node")
            return
        self._launch(self.policy.initial(self.tree))
        while self._outstanding:
            batch = [await self._reported.get()]
            while not self._reported.empty():
                batch.append(self._reported.get_nowait())
            self._outstanding -= len(batch)
            batch.sort(key=lambda n: n.seq)
            expansions = self.policy.on_reward(self.tree, batch)
            if self.policy.done(self.tree):
                return
            self._launch(expansions)

    def _launch(self, expansions: Sequence[Expansion]) -> None:
        for expansion in expansions:
            parent = self.tree.get(expansion.parent_id)
            if parent is None or parent.status is not NodeStatus.SCORED or parent.terminal:
                raise ExecutionError(
                    f"policy {self.policy.name!r} asked to expand {expansion.parent_id!r}, "
                    "which is not a scored non-terminal node"
                )
            if parent.resume_at is None:
                raise ExecutionError(f"node {parent.id!r} has no thought node to resume at")
            for _ in range(expansion.width):
                if len(self.tree) >= self.config.max_nodes:
                    self._truncated = True
                    return
                child = self.tree.add_child(parent)
                child.status = NodeStatus.RUNNING
                self._start_segment(child, parent.resume_at, parent.state)

    def _start_segment(self, child: Node, thought: str, state: State) -> None:
        self._outstanding += 1
        self.rewards.segment_started(self.tree.query_id)
        task = asyncio.create_task(self._segment(child, thought, state), name=child.id)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _segment(self, child: Node, thought: str, state: State) -> None:
        """Generate ``child`` at ``thought``, walk to its reward, score it, walk on to the next
        thought or END. Always reports the child, scored or cancelled."""
        reached_reward = False
        try:
            position: str = thought
            first = True
            while self.graph.kind(position) is not NodeKind.REWARD:
                node = self.graph.nodes[position]
                if node.kind is NodeKind.THOUGHT:
                    text = await self._generate(child, node, state, first=first)
                    if text is None:
                        return
                    first = False
                    assert node.parse is not None  # thought nodes always have a parser
                    state = apply_update(state, node.parse(state, text), position)
                else:
                    if node.kind is NodeKind.TOOL:
                        await self._before_tool(child, node)
                    assert node.fn is not None
                    state = apply_update(state, await maybe_await(node.fn(state)), position)
                position = self.graph.next(position, state)
                if position == END:
                    raise ExecutionError(f"branch reached END from {thought!r} without a reward")
            reward_node = self.graph.nodes[position]
            reached_reward = True  # from here the router accounts for this branch
            step_scores = await self.rewards.score(self.tree.query_id, child.id, reward_node, state)
            child.step_scores = step_scores
            child.reward = aggregate_scores(step_scores, self.policy.aggregation)
            state = {**state, "reward": child.reward, "step_scores": step_scores}
            after = self.graph.next(position, state)
            resume, state = await self.graph.walk_to_thought(
                after, state, lambda tool: self._before_tool(child, tool)
            )
            child.state = state
            child.resume_at = resume
            child.terminal = resume is None
            if child.terminal:
                child.answer = self.answer_fn(state)
            child.status = NodeStatus.SCORED
        except asyncio.CancelledError:
            child.status = NodeStatus.CANCELLED
            raise
        except Exception as exc:
            child.status = NodeStatus.CANCELLED
            self._errors.append(f"{child.id}: {type(exc).__name__}: {exc}")
        finally:
            if not reached_reward:
                self.rewards.segment_ended_unscored(self.tree.query_id)
            self._reported.put_nowait(child)

    async def _generate(
        self, child: Node, node: GraphNode, state: State, *, first: bool
    ) -> str | None:
        assert node.prompt is not None and node.sampling is not None
        request_id = child.id if first else f"{child.id}/@{node.name}"
        request = GenerateRequest(
            request_id=request_id,
            prompt=node.prompt(state),
            sampling=replace(node.sampling, seed=stable_seed(self.config.seed, request_id)),
            priority=Priority.COMMITTED,
            speculative=False,
        )
        self.recorder.request_started()
        try:
            result = await self.backend.generate(request)
        finally:
            self.recorder.request_finished()
        completion = result.completions[0]
        child.num_tokens += completion.num_tokens
        if completion.finish_reason is FinishReason.ABORT:
            child.status = NodeStatus.CANCELLED
            return None
        child.text = completion.text if first else child.text
        child.token_ids = completion.token_ids if first else child.token_ids
        return completion.text

    async def _before_tool(self, child: Node, tool: GraphNode) -> None:
        """Baseline branches are all committed: tools run at once. The speculative executor
        overrides this to hold non-speculable tools until the branch is committed."""

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.rewards.forget(self.tree.query_id)
        await self.backend.abort(self.tree.query_id)


async def _no_wait(_tool: GraphNode) -> None:
    return None


def record_for(outcome_tree: SearchTree, status: str, solved: bool, started: float) -> QueryRecord:
    nodes = list(outcome_tree.nodes())
    return QueryRecord(
        query_id=outcome_tree.query_id,
        status=status,
        solved=solved,
        latency_s=time.perf_counter() - started,
        output_tokens=sum(n.num_tokens for n in nodes),
        wasted_tokens=sum(
            n.num_tokens for n in nodes if n.status is NodeStatus.CANCELLED or n.speculative
        ),
        nodes=len(nodes) - 1,
    )
