"""The one place that touches LangGraph's Pregel internals.

spec-tot runs a ``StateGraph`` with LangGraph's own superstep primitives (task preparation,
channel reducers and ``Send``/``Command`` handling, retries) and only replaces the loop that
waits at the barrier. Those primitives live in LangGraph's private modules; their signatures
have been stable from 1.0 to 1.2, and every name used is imported here so that a LangGraph
release that moves one fails at import with a message naming the version.
"""

from __future__ import annotations

import asyncio
import binascii
import contextvars
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import langgraph.version
from langchain_core.runnables import RunnableConfig
from langgraph.channels.base import BaseChannel
from langgraph.checkpoint.base import Checkpoint, empty_checkpoint
from langgraph.checkpoint.base.id import uuid6
from langgraph.constants import START
from langgraph.errors import GraphRecursionError
from langgraph.runtime import Runtime
from langgraph.types import Command

from spec_tot.branch import BranchContext, current_branch

try:
    from langgraph._internal._constants import (
        CONF,
        CONFIG_KEY_RUNTIME,
        INPUT,
        NS_SEP,
        TASKS,
    )
    from langgraph._internal._typing import MISSING
    from langgraph.pregel._algo import (
        PregelTaskWrites,
        apply_writes,
        increment,
        prepare_next_tasks,
    )
    from langgraph.pregel._io import (
        map_input,
        map_output_updates,
        map_output_values,
        read_channels,
    )
    from langgraph.pregel._retry import arun_with_retry, run_with_retry
    from langgraph.types import PregelExecutableTask
except ImportError as exc:  # pragma: no cover - depends on the installed LangGraph
    raise ImportError(
        f"spec_tot.langgraph needs LangGraph's Pregel primitives (1.0-1.2); "
        f"langgraph {langgraph.version.__version__} does not provide them: {exc}"
    ) from exc

__all__ = [
    "CONF",
    "CONFIG_KEY_RUNTIME",
    "NS_SEP",
    "START",
    "TASKS",
    "Command",
    "GraphRecursionError",
    "PregelExecutableTask",
    "Runtime",
    "World",
    "arun_with_retry",
    "execute",
    "map_output_updates",
    "map_output_values",
    "path_key",
    "recursion_error",
]


def path_key(task: Any) -> str:
    """LangGraph's deterministic order of a step's tasks (writes are applied in it)."""
    return _path_str(task.path)


def _path_str(path: Any) -> str:
    if isinstance(path, str):
        return path
    if isinstance(path, int):
        return f"{path:010d}"
    if isinstance(path, tuple | list):
        return "~".join(_path_str(p) for p in path)
    return str(path)


async def execute(
    task: PregelExecutableTask, branch: BranchContext, pool: Executor | None = None
) -> None:
    """Run one task as LangGraph does, inside ``branch``: on the event loop (``ainvoke``),
    or with ``pool`` on a worker thread (``invoke``: sync nodes of one step run in
    parallel, as in LangGraph's sync runner)."""
    if pool is None:
        token = current_branch.set(branch)
        try:
            await arun_with_retry(task, task.retry_policy)
        finally:
            current_branch.reset(token)
        return

    def call() -> None:
        current_branch.set(branch)
        run_with_retry(task, task.retry_policy)

    context = contextvars.copy_context()
    await asyncio.get_running_loop().run_in_executor(pool, context.run, call)


def recursion_error(limit: int) -> GraphRecursionError:
    return GraphRecursionError(
        f"Recursion limit of {limit} reached without hitting a stop condition. You can "
        "increase the limit by setting the `recursion_limit` config key."
    )


@dataclass
class World:
    """The state between two supersteps: the checkpoint bookkeeping (versions seen, which
    decides what triggers next) and the channels (values and reducers). ``fork()`` copies it,
    so a prediction can apply a partial step without touching the real run."""

    checkpoint: Checkpoint
    channels: dict[str, BaseChannel[Any, Any, Any]]
    managed: dict[str, Any]
    nodes: Mapping[str, Any]
    trigger_to_nodes: Mapping[str, Sequence[str]]
    retry_policy: Sequence[Any]
    step: int
    stop: int
    updated: set[str] | None = None

    @classmethod
    def start(cls, compiled: Any, value: Any, recursion_limit: int) -> World:
        """A fresh run: empty channels, then the input written as LangGraph writes it."""
        channels: dict[str, BaseChannel[Any, Any, Any]] = {}
        managed: dict[str, Any] = {}
        for name, spec in compiled.channels.items():
            if isinstance(spec, BaseChannel):
                channels[name] = spec.from_checkpoint(MISSING)
            else:
                managed[name] = spec
        world = cls(
            checkpoint=empty_checkpoint(),
            channels=channels,
            managed=managed,
            nodes=compiled.nodes,
            trigger_to_nodes=compiled.trigger_to_nodes,
            retry_policy=tuple(getattr(compiled, "retry_policy", None) or ()),
            step=-1,
            stop=recursion_limit,
        )
        writes = list(map_input(compiled.input_channels, value))
        if not writes:
            raise ValueError(f"Received no input for {compiled.input_channels}")
        world.updated = apply_writes(
            world.checkpoint,
            world.channels,
            [PregelTaskWrites((), INPUT, writes, [])],
            increment,
            world.trigger_to_nodes,
        )
        world._advance()
        return world

    def _advance(self) -> None:
        self.step += 1
        self.checkpoint = {**self.checkpoint, "id": str(uuid6(clock_seq=self.step))}

    def fork(self) -> World:
        cp = self.checkpoint
        checkpoint: Checkpoint = {
            **cp,
            "channel_values": dict(cp["channel_values"]),
            "channel_versions": dict(cp["channel_versions"]),
            "versions_seen": {k: dict(v) for k, v in cp["versions_seen"].items()},
        }
        return World(
            checkpoint=checkpoint,
            channels={k: ch.copy() for k, ch in self.channels.items()},
            managed=self.managed,
            nodes=self.nodes,
            trigger_to_nodes=self.trigger_to_nodes,
            retry_policy=self.retry_policy,
            step=self.step,
            stop=self.stop,
            updated=set(self.updated) if self.updated is not None else None,
        )

    def prepare(self, config: RunnableConfig, manager: Any = None) -> list[PregelExecutableTask]:
        """The next superstep's tasks in LangGraph's path order (empty: the graph ends)."""
        tasks = prepare_next_tasks(
            self.checkpoint,
            [],
            self.nodes,
            self.channels,
            self.managed,
            config,
            self.step,
            self.stop,
            for_execution=True,
            store=None,
            checkpointer=None,
            manager=manager,
            trigger_to_nodes=self.trigger_to_nodes,
            updated_channels=self.updated,
            retry_policy=self.retry_policy,
        )
        return sorted(tasks.values(), key=path_key)

    def apply(self, tasks: Iterable[PregelExecutableTask]) -> None:
        """End the superstep: reducers fold the tasks' writes (in path order)."""
        self.updated = apply_writes(
            self.checkpoint, self.channels, list(tasks), increment, self.trigger_to_nodes
        )
        self._advance()

    def read(self, keys: str | Sequence[str]) -> Any:
        return read_channels(self.channels, keys)

    def pending_sends(self) -> list[Any]:
        chan = self.channels.get(TASKS)
        return list(chan.get()) if chan is not None and chan.is_available() else []

    def task_seed(self) -> bytes:
        return binascii.unhexlify(self.checkpoint["id"].replace("-", ""))
