"""One node's *segment*, derived from its parent's walk: generate the thought(s), walk
function and tool nodes to the reward, score it, walk past the reward to the next thought or
END.

A derivation is a pure replay from the parent's current walk with the node's memo: a thought
whose prompt is unchanged reuses its text, a reward item that is unchanged reuses its score,
so deriving again after the parent's walk changed (its real reward replaced a provisional
one) costs no engine work unless a prompt or a reward item really changed; then it is
generated or scored again under the same id and seed, exactly as the baseline would. Before
its score lands, a node may *walk ahead* through function nodes with a predicted reward, so
that its children can start while the reward is pending.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from spec_tot._private.compiled import apply_update, maybe_await
from spec_tot.errors import ExecutionError
from spec_tot.executor.context import QueryContext
from spec_tot.graph_nodes import END, GraphNode, NodeKind, State
from spec_tot.requests import FinishReason, GenerateRequest, Priority, RewardItem
from spec_tot.tree import Node, predicted_reward

__all__ = ["Cancelled", "Memo", "Replay", "Segment", "SegmentHost"]


class Replay(Exception):
    """The parent's walk changed under an await: derive again from the new one."""


class Cancelled(Exception):
    """The node's request was aborted (it was cancelled): the run ends quietly."""


@dataclass(slots=True, eq=False)
class Memo:
    """What a node already paid for: thought texts by graph node (with the prompt they
    answer and their token count), and the last scored reward item."""

    texts: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    scored: tuple[RewardItem, tuple[float, ...]] | None = None
    ahead: tuple[int, RewardItem] | None = None  # (base version, item) of the walk ahead


class SegmentHost(Protocol):
    """What a segment uses of the branch runner that owns its node's task, slot and events
    (``BranchRunner``)."""

    ctx: QueryContext

    def generating(self, node: Node, on: bool) -> None: ...
    def killed(self, node: Node) -> bool: ...
    def hold_slot(self, node: Node) -> None: ...
    def release_slot(self, node: Node, *, notify: bool = True) -> None: ...
    def final_event(self, node: Node) -> asyncio.Event: ...
    def committed_event(self, node: Node) -> asyncio.Event: ...
    def set_walk(
        self, node: Node, resume: str | None, state: State, *, provisional: float | None = None
    ) -> None: ...


class Segment:
    """Derives one node's segment (see the module docstring); ``BranchRunner`` owns the
    tasks, slots and bookkeeping it uses."""

    def __init__(self, runner: SegmentHost, node: Node, memo: Memo) -> None:
        self.runner = runner
        self.ctx = runner.ctx
        self.node = node
        self.memo = memo

    def _check(self, version: int) -> None:
        parent = self.node.parent
        assert parent is not None  # segments belong to non-root nodes
        if parent.walk_version != version:
            raise Replay

    async def derive(self) -> None:
        ctx, graph, node = self.ctx, self.ctx.graph, self.node
        parent = node.parent
        assert parent is not None
        version = parent.walk_version
        ctx.tree.derive_from(node, version)
        if parent.resume_at is None:
            raise Cancelled  # the parent's walk ends here (its children are detached)
        position, state, first, steps = parent.resume_at, parent.state, True, 0
        while graph.kind(position) is not NodeKind.REWARD:
            steps = graph.check_steps(position, steps)
            gnode = graph.nodes[position]
            if gnode.kind is NodeKind.THOUGHT:
                text = await self._thought(gnode, state, first=first)
                self._check(version)
                first = False
                assert gnode.parse is not None  # thought nodes always have a parser
                state = apply_update(state, gnode.parse(state, text), position)
            else:
                if gnode.kind is NodeKind.TOOL:
                    await self.tool_barrier(gnode, version)
                assert gnode.fn is not None
                state = apply_update(state, await maybe_await(gnode.fn(state)), position)
                self._check(version)
            position = graph.next(position, state)
            if position == END:
                raise ExecutionError(
                    f"branch reached END from {parent.resume_at!r} without a reward"
                )
        reward_node = graph.nodes[position]
        item, scorer = ctx.rewards.prepare(ctx.query_id, node.id, reward_node, state)
        if self.memo.scored is None or self.memo.scored[0] != item:
            ctx.tree.set_reward(node, None, ctx.policy.aggregation)
            await self._walk_ahead(position, state, item, version)
            self.runner.release_slot(node)  # waiting for a score uses no engine capacity
            scores = await ctx.rewards.score(
                ctx.query_id,
                item,
                scorer,
                speculative=node.speculative,
                node_name=reward_node.name,
            )
            self.memo.scored = (item, scores)
            self._check(version)
        scores = self.memo.scored[1]
        ctx.tree.set_reward(node, scores, ctx.policy.aggregation)
        assert node.reward is not None  # set from the scores just now
        state = {**state, "reward": node.reward, "step_scores": scores}
        resume, state = await graph.walk_to_thought(
            graph.next(position, state), state, lambda tool: self.tool_barrier(tool, version)
        )
        self._check(version)
        self.runner.set_walk(node, resume, state)

    async def _thought(self, gnode: GraphNode, state: State, *, first: bool) -> str:
        assert gnode.prompt is not None
        prompt = gnode.prompt(state)
        known = self.memo.texts.get(gnode.name)
        if known is not None and known[0] == prompt:
            return known[1]
        if known is not None:  # its prompt changed: the old text is wasted
            self.ctx.tree.discard_tokens(self.node, known[2])
        text, tokens = await self._generate(gnode, prompt, first=first)
        self.memo.texts[gnode.name] = (prompt, text, tokens)
        return text

    async def _generate(self, gnode: GraphNode, prompt: str, *, first: bool) -> tuple[str, int]:
        ctx, node, runner = self.ctx, self.node, self.runner
        assert gnode.sampling is not None
        request_id = node.id if first else f"{node.id}/@{gnode.name}"
        speculative = node.speculative
        request = GenerateRequest(
            request_id=request_id,
            prompt=prompt,
            sampling=replace(gnode.sampling, seed=ctx.request_seed(request_id)),
            priority=Priority.SPECULATIVE if speculative else Priority.COMMITTED,
            speculative=speculative,
            dedup=ctx.spec.dedup,
        )
        if speculative:
            runner.hold_slot(node)
        ctx.recorder.request_started(speculative=speculative)
        rows = 0 if speculative else ctx.dispatcher.committed_started()
        runner.generating(node, True)
        started, tokens = time.perf_counter(), 0
        try:
            result = await ctx.backend.generate(request)
            tokens = result.completions[0].num_tokens
        finally:
            runner.generating(node, False)
            ctx.recorder.request_finished(speculative=speculative)
            if not speculative:  # a sample of the backend's step curve
                ctx.dispatcher.committed_finished(rows, time.perf_counter() - started, tokens)
            runner.release_slot(node)
        completion = result.completions[0]
        if completion.finish_reason is FinishReason.ABORT or runner.killed(node):
            ctx.tree.generated(node, completion.num_tokens, None)
            raise Cancelled
        own = (completion.text, completion.token_ids) if first else None
        ctx.tree.generated(node, completion.num_tokens, own)
        return completion.text, completion.num_tokens

    async def tool_barrier(self, tool: GraphNode, version: int) -> None:
        """A tool runs only on a final walk (its state never changes again), and a
        non-speculable one only on a committed branch of a live query."""
        runner, node = self.runner, self.node
        parent = node.parent
        assert parent is not None
        if self.ctx.closed:
            raise asyncio.CancelledError  # the query is over: this branch must not act
        while not parent.final:
            runner.release_slot(node)
            await runner.final_event(parent).wait()
            self._check(version)
        self._check(version)
        if node.speculative and not (tool.speculable and tool.pure):
            runner.release_slot(node)  # parked until commit: it uses no engine capacity
            await runner.committed_event(node).wait()
        if self.ctx.closed:
            raise asyncio.CancelledError

    async def _walk_ahead(
        self, position: str, state: State, item: RewardItem, version: int
    ) -> None:
        """Continuation before the score: walk past the reward with a predicted reward
        (function nodes only), so that the node's children can start now. The real score
        replaces it; children whose prompts then differ are generated again."""
        node, graph = self.node, self.ctx.graph
        if self.memo.ahead == (version, item) or not self.ctx.steering():
            return  # done already, or no room to start children: it would only cost
        self.memo.ahead = (version, item)
        guess = predicted_reward(node)
        state = {**state, "reward": guess, "step_scores": (guess,) * max(1, len(item.steps))}
        try:
            walk = await graph.walk_functions(graph.next(position, state), state)
        except Exception:  # a router that needs the real score: no walk ahead
            return
        if walk is None or node.parent is None or node.parent.walk_version != version:
            return
        self.runner.set_walk(node, walk[0], walk[1], provisional=guess)
