"""The branch runner: one asyncio task per tree node runs its *segment* (generate the
thought, walk function and tool nodes to the reward, score it, walk on to the next thought
or END), aborts what must stop, and keeps tools off speculative branches.

A committed branch is always reported to the controller (scored or cancelled); a speculative
one only tells the controller that it finished, so that another prediction may fill its
slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from spec_tot._private.compiled import apply_update, maybe_await
from spec_tot.errors import ExecutionError
from spec_tot.executor.context import QueryContext
from spec_tot.nodes import END, GraphNode, NodeKind, State
from spec_tot.requests import FinishReason, GenerateRequest, Priority
from spec_tot.tree import Node, NodeStatus, aggregate_scores

__all__ = ["BranchRunner"]


class BranchRunner:
    def __init__(
        self,
        ctx: QueryContext,
        report: Callable[[Node], None],
        slot_freed: Callable[[], None],
    ) -> None:
        """``report(node)``: a committed branch is done; ``slot_freed()``: a speculative
        branch stopped using the engine (a new prediction may fill its place)."""
        self.ctx = ctx
        self._report = report
        self._slot_freed = slot_freed
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._committed_events: dict[str, asyncio.Event] = {}
        self._settled: set[str] = set()  # branches whose bookkeeping is done
        self._generating: set[str] = set()  # nodes whose request is on the backend now
        self._aborts: set[asyncio.Task[int]] = set()
        self.speculative_errors: dict[str, str] = {}  # reported only if adopted
        # Speculative branches holding a T2 slot: only while they generate, not while they
        # wait for a (lazily deferred) reward or at a tool for commit.
        self._slot_holders: set[str] = set()

    def running(self, node_id: str) -> bool:
        task = self.tasks.get(node_id)
        return task is not None and not task.done()

    def speculative_running(self) -> int:
        tree = self.ctx.tree
        return sum(1 for c in self.tasks if tree[c].speculative)

    # -- starting, committing and cancelling --------------------------------------------------
    def start(self, child: Node, parent: Node) -> None:
        ctx = self.ctx
        assert parent.resume_at is not None  # checked by the policy contract and the caller
        if child.speculative:
            ctx.recorder.speculative_nodes += 1
            if ctx.budget is not None:
                ctx.budget.started(ctx.query_id)
                self._slot_holders.add(child.id)
        else:
            child.status = NodeStatus.RUNNING
        ctx.emit("expanded", child, parent=parent.id, depth=child.depth)
        ctx.rewards.segment_started(ctx.query_id, speculative=child.speculative)
        task = asyncio.create_task(
            self._segment(child, parent.resume_at, parent.state), name=child.id
        )
        self.tasks[child.id] = task
        task.add_done_callback(self._forget_task)

    def committed(self, child: Node) -> None:
        """``child`` was adopted: a branch parked before a tool may go on."""
        event = self._committed_events.pop(child.id, None)
        if event is not None:
            event.set()

    def cancel(self, node: Node) -> None:
        """Cancel a speculative subtree. A request still generating is aborted on the
        backend, so it returns what it produced (counted as wasted tokens) and frees its KV
        at once; a branch waiting elsewhere (reward queue, tool) is cancelled outright."""
        aborting = False
        for sub in node.subtree():
            if sub.status is not NodeStatus.CANCELLED and sub.speculative:
                sub.status = NodeStatus.CANCELLED
                self.ctx.emit("cancelled", sub)
            task = self.tasks.get(sub.id)
            if sub.id in self._generating:
                aborting = True
            elif task is not None:
                task.cancel()
        if aborting:
            abort = asyncio.get_running_loop().create_task(self.ctx.backend.abort(node.id))
            self._aborts.add(abort)
            abort.add_done_callback(self._aborts.discard)

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        node_id = task.get_name()
        self.tasks.pop(node_id, None)
        if node_id not in self._settled:  # cancelled before its first step
            child = self.ctx.tree[node_id]
            if not child.status.final:
                child.status = NodeStatus.CANCELLED
            self._settle(child, reached_reward=False)

    # -- one branch ---------------------------------------------------------------------------
    async def _segment(self, child: Node, thought: str, state: State) -> None:
        """Generate ``child`` at ``thought``, walk to its reward, score it, walk on to the next
        thought or END. A committed child is always reported, scored or cancelled."""
        ctx, graph = self.ctx, self.ctx.graph
        reached_reward = False
        try:
            position, first, steps = thought, True, 0
            while graph.kind(position) is not NodeKind.REWARD:
                steps = graph.check_steps(position, steps)
                node = graph.nodes[position]
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
                position = graph.next(position, state)
                if position == END:
                    raise ExecutionError(f"branch reached END from {thought!r} without a reward")
            reached_reward = True  # from here the reward router accounts for this branch
            self._release_slot(child)
            step_scores = await ctx.rewards.score(
                ctx.query_id,
                child.id,
                graph.nodes[position],
                state,
                speculative=child.speculative,
            )
            child.step_scores = step_scores
            child.reward = aggregate_scores(step_scores, ctx.policy.aggregation)
            state = {**state, "reward": child.reward, "step_scores": step_scores}
            resume, state = await graph.walk_to_thought(
                graph.next(position, state),
                state,
                lambda tool: self._before_tool(child, tool),
            )
            child.state, child.resume_at, child.terminal = state, resume, resume is None
            if child.terminal:
                child.answer = ctx.answer_fn(state)
            ctx.emit(
                "scored",
                child,
                text=child.text,
                reward=child.reward,
                terminal=child.terminal,
                answer=child.answer,
            )
            if not child.speculative:
                child.status = NodeStatus.SCORED
        except asyncio.CancelledError:
            child.status = NodeStatus.CANCELLED
            raise
        except Exception as exc:  # one branch's failure must not end the query
            child.status = NodeStatus.CANCELLED
            message = f"{child.id}: {type(exc).__name__}: {exc}"
            if child.speculative:
                self.speculative_errors[child.id] = message
            else:
                ctx.errors.append(message)
        finally:
            self._settle(child, reached_reward=reached_reward)

    def _settle(self, child: Node, *, reached_reward: bool) -> None:
        """A branch's bookkeeping, exactly once: from its own ``finally``, or from its
        done-callback when it was cancelled before it ever ran."""
        if child.id in self._settled:
            return
        self._settled.add(child.id)
        ctx = self.ctx
        if not reached_reward:
            ctx.rewards.segment_ended_unscored(ctx.query_id, speculative=child.speculative)
        self._release_slot(child, notify=False)
        if not child.speculative:
            self._report(child)
        elif child.status is not NodeStatus.CANCELLED:
            self._slot_freed()  # a finished speculative node: keep the engine busy

    def _release_slot(self, child: Node, *, notify: bool = True) -> None:
        """A speculative branch stops using the engine: its T2 slot goes back, and (unless
        the caller does it) a new prediction may fill it."""
        budget = self.ctx.budget
        if child.id not in self._slot_holders or budget is None:
            return
        self._slot_holders.discard(child.id)
        budget.finished(self.ctx.query_id)
        if notify:
            self._slot_freed()

    async def _generate(
        self, child: Node, node: GraphNode, state: State, *, first: bool
    ) -> str | None:
        ctx = self.ctx
        assert node.prompt is not None and node.sampling is not None
        request_id = child.id if first else f"{child.id}/@{node.name}"
        speculative = child.speculative
        request = GenerateRequest(
            request_id=request_id,
            prompt=node.prompt(state),
            sampling=replace(node.sampling, seed=ctx.request_seed(request_id)),
            priority=Priority.SPECULATIVE if speculative else Priority.COMMITTED,
            speculative=speculative,
            dedup=ctx.spec.dedup,
        )
        ctx.recorder.request_started(speculative=speculative)
        if ctx.budget is not None and not speculative:
            ctx.budget.committed += 1
        self._generating.add(child.id)
        try:
            result = await ctx.backend.generate(request)
        finally:
            self._generating.discard(child.id)
            ctx.recorder.request_finished(speculative=speculative)
            if ctx.budget is not None and not speculative:
                ctx.budget.committed -= 1
        completion = result.completions[0]
        child.num_tokens += completion.num_tokens
        if completion.finish_reason is FinishReason.ABORT or child.status is NodeStatus.CANCELLED:
            child.status = NodeStatus.CANCELLED  # aborted, or cancelled while it finished
            return None
        if first:
            child.text, child.token_ids = completion.text, completion.token_ids
        return completion.text

    async def _before_tool(self, child: Node, tool: GraphNode) -> None:
        """A non-speculable tool runs only on a committed branch of a live query: wait for
        adoption."""
        if self.ctx.closed:
            raise asyncio.CancelledError  # the query is over: this branch must not act
        if child.speculative and not (tool.speculable and tool.pure):
            self._release_slot(child)  # parked until commit: it uses no engine capacity
            event = self._committed_events.setdefault(child.id, asyncio.Event())
            await event.wait()

    # -- the end ------------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Stop every branch first (no tool may run once the query is over), then abort on
        the backend: requests still registered there end at once and free their KV,
        whatever each backend does on task cancellation."""
        ctx = self.ctx
        ctx.closed = True
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await ctx.backend.abort(ctx.query_id)
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
