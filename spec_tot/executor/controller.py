"""The controller: one per query. The consumer loop takes committed nodes as they are scored,
tells the policy, commits what it selects, prunes what can no longer be selected and
speculates on what it predicts.

Speculative children get the ids the committed search would give them (``parent/i``) and
seeds derived from those ids, so an adopted speculative node is exactly the node the
baseline would have generated. A query's failure, timeout or cancellation touches no other
query and always ends with ``abort(query_id)``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from spec_tot.errors import ExecutionError
from spec_tot.executor.branch_runner import BranchRunner
from spec_tot.executor.context import QueryContext
from spec_tot.executor.dispatcher import ClientRules, Offer
from spec_tot.executor.pruning import discard_unselected, early_prune, should_terminate
from spec_tot.graph_nodes import GraphNode
from spec_tot.metrics import QueryRecord
from spec_tot.policies.base import Answer, Candidate, Expansion, SearchPolicy, startable_width
from spec_tot.tree import Node, NodeStatus, SearchTree

__all__ = ["QueryController", "QueryOutcome", "record_for"]


@dataclass(frozen=True, slots=True)
class QueryOutcome:
    tree: SearchTree
    answer: Answer | None
    errors: tuple[str, ...]
    truncated: bool


class QueryController:
    """Runs one query's search to completion under the configured mode."""

    def __init__(self, ctx: QueryContext) -> None:
        self.ctx = ctx
        self.tree = ctx.tree
        self.policy = ctx.policy
        self.spec = ctx.spec
        self._reported: asyncio.Queue[Node] = asyncio.Queue()
        ctx.steering = self.steering
        self.branches = BranchRunner(ctx, self._reported.put_nowait, self._speculate_later)
        self._outstanding = 0
        self._round: list[Node] = []  # committed children of the latest commit
        self._truncated = False
        self._speculate_soon = False
        # speculative child -> the offer it launched as, when (loop time), its saving_s then
        self._offers: dict[str, tuple[Offer, float, float]] = {}
        self._mean_tokens = 0.0  # moving average of a finished node's tokens
        # The dispatcher admits every launch of this query. Without T2 a prediction still
        # asks for no more than one saturated batch: MCTS prediction simulates a selection
        # per slot, and its CPU cost grows with the ask.
        spec = self.spec
        rules = ClientRules(
            priced=spec.budget,
            max_sequences=0 if spec.speculate == "off" else spec.max_speculative_per_query,
            max_level=spec.max_spec_depth,
            max_ask=ctx.backend.capabilities.saturation_batch,
        )
        ctx.dispatcher.join(ctx.query_id, rules)

    # -- the consumer loop --------------------------------------------------------------------
    async def run(self) -> QueryOutcome:
        try:
            await self._search()
        finally:
            await self._shutdown()
        answer = self.policy.answer(self.tree)
        if answer is not None:
            self.ctx.emit(
                "answer", self.tree.get(answer.node_id or ""), text=answer.text, score=answer.score
            )
        return QueryOutcome(self.tree, answer, tuple(self.ctx.errors), self._truncated)

    async def _search(self) -> None:
        ctx, root = self.ctx, self.tree.root
        try:
            entry = ctx.graph.entry(root.state)
            resume, state = await ctx.graph.walk_to_thought(entry, root.state, _no_wait)
        except Exception as exc:
            ctx.errors.append(f"{root.id}: {type(exc).__name__}: {exc}")
            return
        self.tree.set_entry(resume, state)
        if resume is None:
            ctx.errors.append("the graph reached END before any thought node")
            return
        self._commit(self.policy.initial(self.tree))
        self._speculate()
        while self._outstanding:
            batch = [await self._reported.get()]
            while not self._reported.empty():
                batch.append(self._reported.get_nowait())
            self._outstanding -= len(batch)
            for node in batch:
                seen = max(node.num_tokens, 1)
                mean = self._mean_tokens
                self._mean_tokens = seen if not mean else 0.9 * mean + 0.1 * seen
            batch.sort(key=lambda n: n.key)
            if self.spec.ep:
                early_prune(self.ctx, self.branches, self._round)
            expansions = self.policy.on_reward(self.tree, batch)
            if self.policy.done(self.tree) or self._terminate_early():
                return
            if expansions and self.policy.discards_unselected:
                discard_unselected(self.branches, self._round, expansions)
            self._commit(expansions)
            self._speculate()

    def _terminate_early(self) -> bool:
        spec = self.spec
        if not spec.early_termination:
            return False
        answer = self.policy.answer(self.tree)
        text = answer.text if answer is not None else None
        return should_terminate(self.tree, spec.et_min_answers, spec.et_alpha, text)

    # -- committing ---------------------------------------------------------------------------
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
                self.branches.cancel(child)
            for _ in range(expansion.width - min(len(spare), expansion.width)):
                if len(self.tree) >= self.ctx.config.max_nodes:
                    self._truncated = True
                    return
                child = self.tree.add_child(parent)
                self._round.append(child)
                self._outstanding += 1
                self.branches.start(child, parent)

    def _expandable(self, node_id: str) -> Node:
        parent = self.tree.get(node_id)
        if parent is None or parent.status is not NodeStatus.SCORED or parent.terminal:
            raise ExecutionError(
                f"policy {self.policy.name!r} asked to expand {node_id!r}, "
                "which is not a scored non-terminal node"
            )
        return parent

    def _adopt(self, child: Node) -> None:
        ctx, branches = self.ctx, self.branches
        ctx.emit("speculative_hit", child)
        failure = branches.failure(child)
        running = branches.running(child)
        if running or (failure is None and not (child.final and child.reward is not None)):
            status = NodeStatus.RUNNING  # it reports when its run ends, or derives again
        else:
            status = NodeStatus.SCORED if failure is None else NodeStatus.CANCELLED
        self.tree.adopt(child, status)
        ctx.recorder.speculative_hits += 1
        launched = self._offers.pop(child.id, None)
        if launched is not None:
            offer, at, saving_s = launched
            ended = self.branches.ended_at(child)
            now = asyncio.get_running_loop().time()
            head_start = (now if ended is None else min(ended, now)) - at
            ctx.dispatcher.hit(offer, head_start / saving_s if saving_s > 0 else None)
        self._round.append(child)
        self._outstanding += 1
        branches.adopted(child)
        if running:
            return
        if failure is not None:  # the baseline would have failed this very node too
            ctx.errors.append(failure)
            self._reported.put_nowait(child)
        elif status is NodeStatus.SCORED:
            self._reported.put_nowait(child)
        else:  # derived from a walk its parent no longer has: derive again, committed
            branches.restart(child)

    # -- speculating --------------------------------------------------------------------------
    def _speculate_later(self) -> None:
        """One prediction per loop tick, however many branches finished in it."""
        if not self._speculate_soon and not self.ctx.closed:
            self._speculate_soon = True
            asyncio.get_running_loop().call_soon(self._speculate_tick)

    def _speculate_tick(self) -> None:
        self._speculate_soon = False
        self._speculate()

    def _speculate(self) -> None:
        """Predict as many children as the backend's dispatcher asks for, and offer them
        to it: it launches each now or when room frees while it is worth its cost (T2), or,
        without T2, all at once up to this query's cap."""
        ctx = self.ctx
        if ctx.closed:
            return
        tokens, reward_s = self._mean_tokens or 1.0, ctx.rewards.item_s
        ask = ctx.dispatcher.asks(ctx.query_id, self.policy.name, tokens, reward_s)
        if ask <= 0:
            return
        predicted = self.policy.predictions(self.tree, ask)
        if self.spec.speculate == "all":
            predicted = iter(_every_known_candidate(self.policy, self._round, list(predicted)))
        ctx.dispatcher.offer(ctx.query_id, self._offers_for(predicted))

    def _offers_for(self, predicted: Iterator[Candidate]) -> list[Offer]:
        """The offers of the predicted children, pulled best first; the pulling stops at
        the first candidate the dispatcher would not launch now (later ones are less likely
        still, and an MCTS prediction costs a simulated selection each)."""
        dispatcher, client = self.ctx.dispatcher, self.ctx.query_id
        offers: list[Offer] = []
        for c in predicted:
            parent = self.tree.get(c.parent_id)
            if parent is None or parent.resume_at is None or self.branches.killed(parent):
                continue
            # ``c.width`` is what the node lacks; it must still lack it now
            width = min(c.width, startable_width(parent, len(parent.children) + c.width))
            level = _level(parent) + 1
            if width <= 0 or not dispatcher.reaches(client, level):
                continue
            offer = self._offer(parent, level, len(parent.children) + width, c.utility)
            if not dispatcher.worth(client, offer):
                break
            offers.extend([offer] * width)
        return offers

    def _offer(self, parent: Node, level: int, target: int, utility: float) -> Offer:
        # A child's length is unknown until generated: its parent's is the best guess.
        tokens = parent.num_tokens or self._mean_tokens or 1.0
        launch = functools.partial(self._launch, parent, target)
        reward_s = self.ctx.rewards.item_s
        return Offer(self.policy.name, level, tokens, launch, reward_s=reward_s, confidence=utility)

    def _launch(self, parent: Node, target: int, offer: Offer) -> bool:
        """Start one speculative child of ``parent`` (admitted by the dispatcher) if it is
        still wanted: the query runs, the parent is live and still lacks it (up to
        ``target`` children), and the tree has room for it."""
        ctx = self.ctx
        if (
            ctx.closed
            or self.tree.get(parent.id) is not parent
            or parent.resume_at is None
            or self.branches.killed(parent)
            or len(parent.children) >= target
            or startable_width(parent, len(parent.children) + 1) < 1
            or len(self.tree) >= ctx.config.max_nodes
        ):
            return False
        child = self.tree.add_child(parent, speculative=True)
        now = asyncio.get_running_loop().time()
        self._offers[child.id] = (offer, now, ctx.dispatcher.saving_s(offer))
        self.branches.start(child, parent)
        return True

    def steering(self) -> bool:
        """Whether an early score would steer this query's speculation now: it speculates,
        and has speculative work running or room to start some."""
        ctx = self.ctx
        if ctx.closed:
            return False
        if self.branches.speculative_generating():
            return True
        return ctx.dispatcher.steers(ctx.query_id)

    # -- the end ------------------------------------------------------------------------------
    async def _shutdown(self) -> None:
        ctx = self.ctx
        await self.branches.shutdown()
        for node in self.tree.nodes():
            # Never adopted (wasted work), or stopped before it finished (early exit).
            unfinished = node.status in (NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.DONE)
            if unfinished or node.speculative:
                self.tree.cancel(node)
        ctx.rewards.forget(ctx.query_id)
        ctx.dispatcher.forget(ctx.query_id)


async def _no_wait(_tool: GraphNode) -> None:
    return None


def _every_known_candidate(
    policy: SearchPolicy, round_nodes: list[Node], predicted: list[Candidate]
) -> list[Candidate]:
    """Naive continuation (the papers' strawman, and SpecScale's speculation): every known,
    unfinished candidate of the round is continued at once (its reward may still be
    pending), at the widest width the policy would give any node; MCTS-like policies keep
    their own predictions."""
    if not policy.discards_unselected:
        return predicted
    width = max((c.width for c in predicted), default=1)
    chosen = {c.parent_id for c in predicted}
    rest = [
        Candidate(n.id, width, 0.0)
        for n in round_nodes
        if n.id not in chosen and n.depth < policy.max_depth and startable_width(n, width) == width
    ]
    return [*predicted, *rest]


def _level(node: Node) -> int:
    """How far below the committed frontier ``node`` is: 0 for a committed scored node, one
    more for each node above it up to one (a speculative node, or a committed one whose
    reward is pending)."""
    level = 0
    current: Node | None = node
    while current is not None and (current.speculative or current.status is not NodeStatus.SCORED):
        level += 1
        current = current.parent
    return level


def record_for(tree: SearchTree, status: str, solved: bool, latency_s: float) -> QueryRecord:
    """One query's line in the run metrics."""
    nodes = list(tree.nodes())
    return QueryRecord(
        query_id=tree.query_id,
        status=status,
        solved=solved,
        latency_s=latency_s,
        output_tokens=sum(n.num_tokens for n in nodes) + sum(n.num_tokens for n in tree.discarded),
        wasted_tokens=sum(
            n.num_tokens for n in nodes if n.status is NodeStatus.CANCELLED or n.speculative
        )
        + sum(n.num_tokens for n in tree.discarded)
        + sum(n.discarded_tokens for n in nodes),
        nodes=len(nodes) - 1,
    )
