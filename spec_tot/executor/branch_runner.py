"""The branch runner of one query: one asyncio task per node runs (or runs again) its
segment (``spec_tot.executor.segment``); it cancels, detaches and restarts branches as walks
change, keeps speculative branches within their T2 slots, and tells the controller what
happened.

A committed branch is always reported (SCORED or CANCELLED) exactly once. When a node's walk
changes (a provisional walk, then the real one), its children derive again: a running child
notices after its current wait, a finished one is restarted (its memo makes that cheap). A
node whose walk ends (terminal) or is lost (it failed) has its speculative children detached:
taken out of the tree so that their ids are free for the children a later expansion creates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spec_tot.backends import matches_prefix
from spec_tot.executor.context import QueryContext
from spec_tot.executor.segment import Cancelled, Memo, Replay, Segment
from spec_tot.graph_nodes import State
from spec_tot.tree import Node, NodeStatus

__all__ = ["BranchRunner", "NodeRun"]


@dataclass(eq=False)
class NodeRun:
    """What the runner keeps of one node besides its task: the one record of its run state
    (the node's search state is the tree's)."""

    memo: Memo = field(default_factory=Memo)
    killed: bool = False  # cancelled by the controller: never restarted
    failure: str | None = None  # its last failure
    final: asyncio.Event | None = None  # a tool below it waits for its final walk
    committed: asyncio.Event | None = None  # a parked non-speculable tool waits for commit
    generating: bool = False  # its request is on the backend now
    holds_slot: bool = False  # a speculative node holding a T2 slot
    ended_at: float | None = None  # when its last run ended (loop time), for its head start

    def forget_walk(self) -> None:
        """Detached: what a node of the same id must not inherit goes (its slot and request
        stay counted until its last task ends)."""
        self.memo, self.failure, self.final, self.committed = Memo(), None, None, None


class BranchRunner:
    def __init__(
        self, ctx: QueryContext, report: Callable[[Node], None], changed: Callable[[], None]
    ) -> None:
        """``report(node)``: a committed branch is done; ``changed()``: a walk changed or a
        speculative branch stopped using the engine (a new prediction may fit)."""
        self.ctx = ctx
        self._report = report
        self._changed = changed
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._retiring: dict[str, asyncio.Task[None]] = {}  # detached nodes' last tasks
        self._runs: dict[Node, NodeRun] = {}
        self._slots = 0  # speculative nodes holding a T2 slot
        self._aborts: dict[asyncio.Task[int], str] = {}  # abort calls in flight -> prefix

    def _run_of(self, node: Node) -> NodeRun:
        return self._runs.get(node) or self._runs.setdefault(node, NodeRun())

    # -- queries from the controller ------------------------------------------------------------
    def running(self, node: Node) -> bool:
        """A run of ``node`` exists whose end is not processed yet (it will report)."""
        return node.id in self.tasks

    def killed(self, node: Node) -> bool:
        return (run := self._runs.get(node)) is not None and run.killed

    def ended_at(self, node: Node) -> float | None:
        """When ``node``'s last run ended (loop time); None while one runs, or none did."""
        run = self._runs.get(node)
        return None if run is None or self.running(node) else run.ended_at

    def failure(self, node: Node) -> str | None:
        """The last failure of ``node``'s run, None if it has not failed."""
        return None if (run := self._runs.get(node)) is None else run.failure

    def speculative_generating(self) -> int:
        return self._slots

    def generating(self, node: Node, on: bool) -> None:
        """``node``'s request is on the backend (``on``) or back: a cancel aborts it there."""
        if on:
            self._run_of(node).generating = True
        elif (run := self._runs.get(node)) is not None:
            run.generating = False

    # -- starting, committing and cancelling --------------------------------------------------
    def start(self, child: Node, parent: Node) -> None:
        ctx = self.ctx
        if child.speculative:
            ctx.recorder.speculative_nodes += 1
            self.hold_slot(child)  # reserved now: grants in this tick count it
        else:
            ctx.tree.start(child)
        ctx.emit("expanded", child, parent=parent.id, depth=child.depth)
        self._launch(child)

    def restart(self, node: Node) -> None:
        """Derive ``node`` again (its parent's walk changed, or it was adopted stale)."""
        self.ctx.tree.revive(node)
        if (run := self._runs.get(node)) is not None:
            run.failure = None
        self._launch(node)

    def _launch(self, node: Node) -> None:
        if not node.speculative:
            self.ctx.rewards.expect(self.ctx.query_id, node.id)
        before = self._retiring.pop(node.id, None)
        task = asyncio.create_task(self._run(node, before), name=node.id)
        self.tasks[node.id] = task
        task.add_done_callback(lambda t: self._done(node, t))

    def adopted(self, node: Node) -> None:
        """``node`` was adopted: it counts for its round, and may pass non-pure tools."""
        if self.running(node) and node.reward is None:
            self.ctx.rewards.expect(self.ctx.query_id, node.id)
        run = self._runs.get(node)
        if run is not None and run.committed is not None:
            run.committed.set()
            run.committed = None

    def cancel(self, node: Node) -> None:
        """Cancel a speculative subtree. A request still generating is aborted on the
        backend, so it returns what it produced (counted as wasted tokens) and frees its KV
        at once; a branch waiting elsewhere (reward queue, tool) is cancelled outright."""
        aborting = False
        for sub in node.subtree():
            if sub.speculative:
                self._run_of(sub).killed = True
                if sub.status is not NodeStatus.CANCELLED:
                    self.ctx.tree.cancel(sub)
                    self.ctx.emit("cancelled", sub)
            task = self.tasks.get(sub.id)
            if (run := self._runs.get(sub)) is not None and run.generating:
                aborting = True
            elif task is not None:
                task.cancel()
        if aborting:
            abort = asyncio.get_running_loop().create_task(self.ctx.backend.abort(node.id))
            self._aborts[abort] = node.id
            abort.add_done_callback(lambda t: self._aborts.pop(t, None))

    def _detach_children(self, node: Node) -> None:
        """``node``'s walk ended or was lost: its speculative children go, ids freed."""
        if not node.children:
            return
        for child in list(node.children):
            self.cancel(child)
        for sub in self.ctx.tree.detach_children(node):
            task = self.tasks.pop(sub.id, None)
            if task is not None and not task.done():
                self._retiring[sub.id] = task  # a new node with this id waits for it
            if (run := self._runs.get(sub)) is not None:
                run.forget_walk()

    # -- events and slots ---------------------------------------------------------------------
    def final_event(self, node: Node) -> asyncio.Event:
        """The event a tool below ``node`` waits on for its final walk (made on first ask)."""
        run = self._run_of(node)
        if run.final is None:
            run.final = asyncio.Event()
        if node.final:
            run.final.set()
        return run.final

    def committed_event(self, node: Node) -> asyncio.Event:
        """The event a parked non-speculable tool of ``node`` waits on (made on first ask)."""
        run = self._run_of(node)
        if run.committed is None:
            run.committed = asyncio.Event()
        return run.committed

    def hold_slot(self, node: Node) -> None:
        run = self._run_of(node)
        if not run.holds_slot:
            run.holds_slot = True
            self._slots += 1
            self.ctx.dispatcher.started(self.ctx.query_id)

    def release_slot(self, node: Node, *, notify: bool = True) -> None:
        run = self._runs.get(node)
        if run is not None and run.holds_slot:
            run.holds_slot = False
            self._slots -= 1
            self.ctx.dispatcher.finished(self.ctx.query_id)
            if notify:
                self._changed()

    # -- walks --------------------------------------------------------------------------------
    def set_walk(
        self, node: Node, resume: str | None, state: State, *, provisional: float | None = None
    ) -> None:
        """``node`` walked past its reward edge (with its real reward, or ahead with a
        ``provisional`` one): the tree records it; its children derive again; a final walk
        opens the tool barriers of the branches below it."""
        ctx = self.ctx
        answer = ctx.answer_fn(state) if resume is None else None
        ctx.tree.walked(node, resume, state, answer, provisional=provisional)
        if provisional is None:
            ctx.emit(
                "scored",
                node,
                text=node.text,
                reward=node.reward,
                terminal=node.terminal,
                answer=node.answer,
            )
        if node.terminal:
            self._detach_children(node)
        for child in list(node.children):
            if not self.killed(child) and not self.running(child):
                self.restart(child)
        run = self._runs.get(node)
        if node.final and run is not None and run.final is not None:
            run.final.set()  # a tool waits; one asked later finds node.final set
        self._changed()

    # -- one run ------------------------------------------------------------------------------
    async def _run(self, node: Node, before: asyncio.Task[None] | None) -> None:
        ctx = self.ctx
        # A detached node of the same id may still be ending, or its abort on its way: a
        # request with this id must not start before both are done.
        waits: set[asyncio.Future[Any]] = {
            t for t, prefix in self._aborts.items() if matches_prefix(node.id, prefix)
        }
        if before is not None:
            waits.add(before)
        if waits:
            await asyncio.wait(waits)
        run = self._run_of(node)
        try:
            while True:
                try:
                    await Segment(self, node, run.memo).derive()
                    break
                except Replay:
                    continue
            if not node.speculative:
                ctx.tree.score(node)
        except Cancelled:
            ctx.tree.cancel(node)
        except asyncio.CancelledError:
            ctx.tree.cancel(node)
            raise
        except Exception as exc:  # one branch's failure must not end the query
            ctx.tree.cancel(node)
            run.failure = f"{node.id}: {type(exc).__name__}: {exc}"
            if not node.speculative:
                ctx.errors.append(run.failure)
            self._detach_children(node)

    def _done(self, node: Node, task: asyncio.Task[None]) -> None:
        """A run's bookkeeping, once, whether it ended or was cancelled before it began."""
        if self.tasks.get(node.id) is task:
            del self.tasks[node.id]
        if task.cancelled() and not node.status.final:
            self.ctx.tree.cancel(node)
        self.release_slot(node, notify=False)
        self.ctx.rewards.release(self.ctx.query_id, node.id)
        if node.parent is not None and node not in node.parent.children:
            return  # detached: nobody waits for it
        if not node.current and not self.killed(node) and not self.ctx.closed:
            self.restart(node)  # its parent's walk changed as it ended: derive again
            return
        if not node.speculative:
            if node.status is NodeStatus.RUNNING:  # adopted after its run ended well
                ok = node.final and node.reward is not None and self.failure(node) is None
                if ok:
                    self.ctx.tree.score(node)
                else:
                    self.ctx.tree.cancel(node)
            self._report(node)
        elif node.status is not NodeStatus.CANCELLED:
            self._run_of(node).ended_at = asyncio.get_running_loop().time()
            self._changed()  # a finished speculative node: keep the engine busy

    # -- the end ------------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Stop every branch first (no tool may run once the query is over), then abort on
        the backend: requests still registered there end at once and free their KV,
        whatever each backend does on task cancellation."""
        ctx = self.ctx
        ctx.closed = True
        tasks = [*self.tasks.values(), *self._retiring.values()]
        for task in tasks:
            task.cancel()
        await ctx.backend.abort(ctx.query_id)
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
