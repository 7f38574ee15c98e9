"""The runtime: one ``QueryRunner`` per query, all sharing one backend, one reward router and
(for SPEX T2) one speculative budget.

The consumer loop takes committed nodes as they are scored, tells the policy, commits what it
selects and speculates on what it predicts. Speculative children get the ids the committed
search would give them (``parent/i``) and seeds derived from those ids, so an adopted
speculative node is exactly the node the baseline would have generated. A query's failure,
timeout or cancellation touches no other query and always ends with ``abort(query_id)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from spec_tot._private.compiled import CompiledGraph, apply_update, maybe_await, stable_seed
from spec_tot._private.scoring import RewardRouter
from spec_tot._private.speculation import (
    SpeculationBudget,
    early_prune_threshold,
    should_terminate,
)
from spec_tot.backends import GenerationBackend
from spec_tot.config import ExecutorConfig
from spec_tot.errors import ExecutionError
from spec_tot.events import EventKind, EventSink, ToTEvent
from spec_tot.graph import END, GraphNode, NodeKind, State
from spec_tot.metrics import MetricsRecorder, QueryRecord
from spec_tot.policies.base import Answer, Candidate, Expansion, SearchPolicy
from spec_tot.requests import FinishReason, GenerateRequest, Priority
from spec_tot.tree import Node, NodeStatus, SearchTree, aggregate_scores

__all__ = ["QueryOutcome", "QueryRunner", "record_for"]


@dataclass(frozen=True, slots=True)
class QueryOutcome:
    tree: SearchTree
    answer: Answer | None
    errors: tuple[str, ...]
    truncated: bool


class QueryRunner:
    """Runs one query's search to completion under the configured mode."""

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
        answer_fn: Callable[[State], str | None],
        budget: SpeculationBudget | None = None,
        on_event: EventSink | None = None,
    ) -> None:
        self.graph = graph
        self.tree = tree
        self.policy = policy
        self.backend = backend
        self.rewards = rewards
        self.recorder = recorder
        self.config = config
        self.spec = config.speculation
        self.answer_fn = answer_fn
        self.budget = budget
        self.on_event = on_event
        self._reported: asyncio.Queue[Node] = asyncio.Queue()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._committed_events: dict[str, asyncio.Event] = {}
        self._outstanding = 0
        self._round: list[Node] = []  # committed children of the latest commit
        self._errors: list[str] = []
        self._speculative_errors: dict[str, str] = {}  # reported only if adopted
        self._truncated = False
        self._closed = False
        self._settled: set[str] = set()  # branches whose bookkeeping is done
        self._speculate_soon = False
        self._generating: set[str] = set()  # nodes whose request is on the backend now
        self._aborts: set[asyncio.Task[int]] = set()
        # Speculative branches holding a T2 slot: only while they generate, not while they
        # wait for a (lazily deferred) reward or at a tool for commit.
        self._slot_holders: set[str] = set()
        # Without T2 a prediction still asks for no more than one saturated batch: MCTS
        # prediction simulates a selection per slot, and its CPU cost grows with the ask.
        self._predict_cap = backend.capabilities.saturation_batch

    # -- the consumer loop --------------------------------------------------------------------
    async def run(self) -> QueryOutcome:
        try:
            await self._search()
        finally:
            await self._shutdown()
        answer = self.policy.answer(self.tree)
        if answer is not None:
            self._emit(
                "answer", self.tree.get(answer.node_id or ""), text=answer.text, score=answer.score
            )
        return QueryOutcome(self.tree, answer, tuple(self._errors), self._truncated)

    async def _search(self) -> None:
        root = self.tree.root
        try:
            entry = self.graph.entry(root.state)
            resume, root.state = await self.graph.walk_to_thought(entry, root.state, _no_wait)
        except Exception as exc:
            self._errors.append(f"{root.id}: {type(exc).__name__}: {exc}")
            return
        root.resume_at = resume
        if resume is None:
            self._errors.append("the graph reached END before any thought node")
            return
        self._commit(self.policy.initial(self.tree))
        self._speculate()
        while self._outstanding:
            batch = [await self._reported.get()]
            while not self._reported.empty():
                batch.append(self._reported.get_nowait())
            self._outstanding -= len(batch)
            batch.sort(key=lambda n: n.seq)
            if self.spec.ep:
                self._early_prune()
            expansions = self.policy.on_reward(self.tree, batch)
            if self.policy.done(self.tree) or (
                self.spec.early_termination
                and should_terminate(self.tree, self.spec.et_min_answers, self.spec.et_alpha)
            ):
                return
            if expansions and self.policy.discards_unselected:
                self._discard_unselected(expansions)
            self._commit(expansions)
            self._speculate()

    # -- committing and speculating -----------------------------------------------------------
    def _commit(self, expansions: Sequence[Expansion]) -> None:
        if expansions:
            self._round = []
        for expansion in expansions:
            parent = self._expandable(expansion.parent_id)
            # Failed speculative children are adopted too (as failures): the baseline would
            # have generated, and failed, the very same node ids.
            spare = [c for c in parent.children if c.speculative]
            for child in spare[: expansion.width]:
                self._adopt(child)
            for child in spare[expansion.width :]:
                self._cancel(child)
            for _ in range(expansion.width - min(len(spare), expansion.width)):
                if len(self.tree) >= self.config.max_nodes:
                    self._truncated = True
                    return
                self._start(self.tree.add_child(parent), parent)

    def _expandable(self, node_id: str) -> Node:
        parent = self.tree.get(node_id)
        if parent is None or parent.status is not NodeStatus.SCORED or parent.terminal:
            raise ExecutionError(
                f"policy {self.policy.name!r} asked to expand {node_id!r}, "
                "which is not a scored non-terminal node"
            )
        return parent

    def _emit(self, kind: EventKind, node: Node | None, **data: Any) -> None:
        if self.on_event is not None:
            self.on_event(
                ToTEvent(
                    kind,
                    self.tree.query_id,
                    node.id if node is not None else None,
                    node.speculative if node is not None else False,
                    data,
                )
            )

    def _adopt(self, child: Node) -> None:
        self._emit("speculative_hit", child)
        child.speculative = False
        self.recorder.speculative_hits += 1
        if self.budget is not None:
            self.budget.hit(self.tree.query_id)
        self._round.append(child)
        self._outstanding += 1
        event = self._committed_events.pop(child.id, None)
        if event is not None:
            event.set()
        failure = self._speculative_errors.pop(child.id, None)
        if failure is not None:
            self._errors.append(failure)
        task = self._tasks.get(child.id)
        if task is not None and not task.done():  # still running: it reports when scored
            child.status = NodeStatus.RUNNING
            if child.reward is None:  # not scored yet: it now counts for its round
                self.rewards.adopt(self.tree.query_id, child.id)
        else:
            finished = child.status is NodeStatus.SPECULATIVE and child.reward is not None
            child.status = NodeStatus.SCORED if finished else NodeStatus.CANCELLED
            self._reported.put_nowait(child)

    def _speculate_tick(self) -> None:
        self._speculate_soon = False
        self._speculate()

    def _speculate(self) -> None:
        if self.spec.speculate == "off" or self._closed:
            return
        running = sum(1 for c in self._tasks if self.tree[c].speculative)
        room = self.spec.max_speculative_per_query - running
        if self.budget is not None:
            # Predict no more than the global budget could grant: MCTS prediction simulates
            # selections on a snapshot, and its cost grows with what it is asked for.
            room = min(room, self.budget.room())
        if room <= 0:
            return
        candidates = self.policy.predict(self.tree, min(room, self._predict_cap))
        if self.spec.speculate == "all":
            candidates = self._every_finished_candidate(candidates)
        if not candidates:
            return
        if self.budget is not None:
            wanted = sum(c.width for c in candidates)
            best = max(c.utility for c in candidates)
            room = self.budget.grant(self.tree.query_id, wanted, best)
        for candidate in candidates:
            parent = self.tree.get(candidate.parent_id)
            if room <= 0 or len(self.tree) >= self.config.max_nodes:
                return
            if parent is None or parent.status is not NodeStatus.SCORED or parent.terminal:
                continue
            if parent.children or parent.resume_at is None:
                continue
            for _ in range(min(candidate.width, room)):
                if len(self.tree) >= self.config.max_nodes:
                    return
                self._start(self.tree.add_child(parent, speculative=True), parent)
                room -= 1

    def _every_finished_candidate(self, predicted: list[Candidate]) -> list[Candidate]:
        """Naive continuation (the papers' strawman, and SpecScale's speculation): every
        scored, unfinished candidate of the round is continued at once, at the widest width
        the policy would give any node; MCTS-like policies keep their own predictions."""
        if not self.policy.discards_unselected:
            return predicted
        width = max((c.width for c in predicted), default=1)
        chosen = {c.parent_id for c in predicted}
        depth_limit = getattr(self.policy, "max_depth", None)
        rest = [
            Candidate(n.id, width, 0.0)
            for n in self._round
            if n.id not in chosen
            and n.status is NodeStatus.SCORED
            and not n.terminal
            and not n.children
            and n.resume_at is not None
            and (depth_limit is None or n.depth < depth_limit)
        ]
        return [*predicted, *rest]

    def _start(self, child: Node, parent: Node) -> None:
        assert parent.resume_at is not None  # checked by the policy contract and _speculate
        if child.speculative:
            self.recorder.speculative_nodes += 1
            if self.budget is not None:
                self.budget.started(self.tree.query_id)
                self._slot_holders.add(child.id)
        else:
            child.status = NodeStatus.RUNNING
            self._round.append(child)
            self._outstanding += 1
        self._emit("expanded", child, parent=parent.id, depth=child.depth)
        self.rewards.segment_started(self.tree.query_id, speculative=child.speculative)
        task = asyncio.create_task(
            self._segment(child, parent.resume_at, parent.state), name=child.id
        )
        self._tasks[child.id] = task
        task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        node_id = task.get_name()
        self._tasks.pop(node_id, None)
        if node_id not in self._settled:  # cancelled before its first step
            child = self.tree[node_id]
            if not child.status.final:
                child.status = NodeStatus.CANCELLED
            self._settle(child, reached_reward=False)

    # -- pruning ------------------------------------------------------------------------------
    def _early_prune(self) -> None:
        keep = self.policy.keep_count(self.tree)
        if keep is None:
            return
        if self.spec.ep_full_score:
            self._full_score_shortcut(keep)
        threshold = early_prune_threshold(self._round, keep)
        if threshold is None:
            return
        for node in self._round:
            below = node.reward is not None and node.reward < threshold
            if node.status is NodeStatus.SCORED and not node.terminal and below:
                node.status = NodeStatus.PRUNED
                self._emit("pruned", node, reward=node.reward, threshold=threshold)
                for child in node.children:
                    self._cancel(child)

    def _full_score_shortcut(self, keep: int) -> None:
        """Opt-in: once ``keep`` non-terminal candidates have the maximum score, the round is
        decided; unfinished candidates are cancelled. A later candidate that would also have
        scored the maximum could have won a tie in the baseline, so this can change which
        tied node is kept."""
        full = [
            n
            for n in self._round
            if n.status is NodeStatus.SCORED
            and not n.terminal
            and n.reward is not None
            and n.reward >= self.spec.full_score
        ]
        if len(full) < keep:
            return
        for node in self._round:
            task = self._tasks.get(node.id)
            if node.status is NodeStatus.RUNNING and task is not None and not task.done():
                self._emit("cancelled", node, reason="full-score shortcut")
                task.cancel()

    def _discard_unselected(self, expansions: Sequence[Expansion]) -> None:
        selected = {e.parent_id for e in expansions}
        for node in self._round:
            if node.id not in selected:
                for child in node.children:
                    if child.speculative:
                        self._cancel(child)

    def _cancel(self, node: Node) -> None:
        """Cancel a speculative subtree. A request still generating is aborted on the
        backend, so it returns what it produced (counted as wasted tokens) and frees its KV
        at once; a branch waiting elsewhere (reward queue, tool) is cancelled outright."""
        aborting = False
        for sub in node.subtree():
            if sub.status is not NodeStatus.CANCELLED and sub.speculative:
                sub.status = NodeStatus.CANCELLED
                self._emit("cancelled", sub)
            task = self._tasks.get(sub.id)
            if sub.id in self._generating:
                aborting = True
            elif task is not None:
                task.cancel()
        if aborting:
            abort = asyncio.get_running_loop().create_task(self.backend.abort(node.id))
            self._aborts.add(abort)
            abort.add_done_callback(self._aborts.discard)

    # -- one branch ---------------------------------------------------------------------------
    async def _segment(self, child: Node, thought: str, state: State) -> None:
        """Generate ``child`` at ``thought``, walk to its reward, score it, walk on to the next
        thought or END. A committed child is always reported, scored or cancelled."""
        reached_reward = False
        try:
            position, first, steps = thought, True, 0
            while self.graph.kind(position) is not NodeKind.REWARD:
                steps = self.graph.check_steps(position, steps)
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
            reached_reward = True  # from here the reward router accounts for this branch
            self._release_slot(child)
            step_scores = await self.rewards.score(
                self.tree.query_id,
                child.id,
                self.graph.nodes[position],
                state,
                speculative=child.speculative,
            )
            child.step_scores = step_scores
            child.reward = aggregate_scores(step_scores, self.policy.aggregation)
            state = {**state, "reward": child.reward, "step_scores": step_scores}
            resume, state = await self.graph.walk_to_thought(
                self.graph.next(position, state),
                state,
                lambda tool: self._before_tool(child, tool),
            )
            child.state, child.resume_at, child.terminal = state, resume, resume is None
            if child.terminal:
                child.answer = self.answer_fn(state)
            self._emit(
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
                self._speculative_errors[child.id] = message
            else:
                self._errors.append(message)
        finally:
            self._settle(child, reached_reward=reached_reward)

    def _settle(self, child: Node, *, reached_reward: bool) -> None:
        """A branch's bookkeeping, exactly once: from its own ``finally``, or from its
        done-callback when it was cancelled before it ever ran."""
        if child.id in self._settled:
            return
        self._settled.add(child.id)
        if not reached_reward:
            self.rewards.segment_ended_unscored(self.tree.query_id, speculative=child.speculative)
        self._release_slot(child, speculate=False)
        if not child.speculative:
            self._reported.put_nowait(child)
        elif child.status is not NodeStatus.CANCELLED and not self._speculate_soon:
            # A finished speculative node frees a slot: keep the engine busy. One
            # prediction per loop tick, however many branches finished in it.
            self._speculate_soon = True
            asyncio.get_running_loop().call_soon(self._speculate_tick)

    def _release_slot(self, child: Node, *, speculate: bool = True) -> None:
        """A speculative branch stops using the engine: its T2 slot goes back, and (unless
        the caller does it) a new prediction may fill it."""
        if child.id not in self._slot_holders or self.budget is None:
            return
        self._slot_holders.discard(child.id)
        self.budget.finished(self.tree.query_id)
        if speculate and not self._speculate_soon and not self._closed:
            self._speculate_soon = True
            asyncio.get_running_loop().call_soon(self._speculate_tick)

    async def _generate(
        self, child: Node, node: GraphNode, state: State, *, first: bool
    ) -> str | None:
        assert node.prompt is not None and node.sampling is not None
        request_id = child.id if first else f"{child.id}/@{node.name}"
        speculative = child.speculative
        request = GenerateRequest(
            request_id=request_id,
            prompt=node.prompt(state),
            sampling=replace(node.sampling, seed=stable_seed(self.config.seed, request_id)),
            priority=Priority.SPECULATIVE if speculative else Priority.COMMITTED,
            speculative=speculative,
            dedup=self.spec.dedup,
        )
        self.recorder.request_started(speculative=speculative)
        if self.budget is not None and not speculative:
            self.budget.committed += 1
        self._generating.add(child.id)
        try:
            result = await self.backend.generate(request)
        finally:
            self._generating.discard(child.id)
            self.recorder.request_finished(speculative=speculative)
            if self.budget is not None and not speculative:
                self.budget.committed -= 1
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
        if self._closed:
            raise asyncio.CancelledError  # the query is over: this branch must not act
        if child.speculative and not (tool.speculable and tool.pure):
            self._release_slot(child)  # parked until commit: it uses no engine capacity
            event = self._committed_events.setdefault(child.id, asyncio.Event())
            await event.wait()

    async def _shutdown(self) -> None:
        self._closed = True
        # Stop every branch first (no tool may run once the query is over), then abort on
        # the backend: requests still registered there end at once and free their KV,
        # whatever each backend does on task cancellation.
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await self.backend.abort(self.tree.query_id)
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for node in self.tree.nodes():
            # Never adopted (wasted work), or stopped before it finished (early exit).
            unfinished = node.status in (NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.DONE)
            if unfinished or (node.speculative and node.status is not NodeStatus.CANCELLED):
                node.status = NodeStatus.CANCELLED
        self.rewards.forget(self.tree.query_id)
        if self.budget is not None:
            self.budget.forget(self.tree.query_id)


async def _no_wait(_tool: GraphNode) -> None:
    return None


def record_for(tree: SearchTree, status: str, solved: bool, latency_s: float) -> QueryRecord:
    nodes = list(tree.nodes())
    return QueryRecord(
        query_id=tree.query_id,
        status=status,
        solved=solved,
        latency_s=latency_s,
        output_tokens=sum(n.num_tokens for n in nodes),
        wasted_tokens=sum(
            n.num_tokens for n in nodes if n.status is NodeStatus.CANCELLED or n.speculative
        ),
        nodes=len(nodes) - 1,
    )
