"""The one place that touches LangGraph's Pregel internals.

A graph runs on LangGraph's own loop, unchanged. Speculation stands beside it and needs four
things the public API does not give: the loop running a task (to read the superstep's
tasks, channels and checkpoint while the step is in flight), a copy of that state (a
*world*) on which a prediction can apply a partial step and prepare the next one with
LangGraph's own ``prepare_next_tasks``/``apply_writes``, LangGraph's retry runner for the
tasks a prediction starts, and the node objects of a compiled graph (to wrap what may run
ahead). Every private name is imported here, so a LangGraph release that moves one fails at
import with a message naming the versions this module was written for.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import langgraph.version
from langchain_core.runnables import RunnableConfig
from langgraph.channels.base import BaseChannel
from langgraph.channels.binop import BinaryOperatorAggregate
from langgraph.checkpoint.base import Checkpoint
from langgraph.checkpoint.base.id import uuid6
from langgraph.constants import START
from langgraph.pregel import Pregel
from langgraph.runtime import Runtime
from langgraph.types import Command, Send

SUPPORTED_VERSIONS = "1.0 to 1.2"

try:
    from langgraph._internal._constants import (
        CONF,
        CONFIG_KEY_CALL,
        CONFIG_KEY_CHECKPOINTER,
        CONFIG_KEY_NODE_FINISHED,
        CONFIG_KEY_RUNTIME,
        CONFIG_KEY_STREAM,
        CONFIG_KEY_TASK_ID,
        TASKS,
    )
    from langgraph._internal._runnable import RunnableSeq
    from langgraph.channels.delta import DeltaChannel
    from langgraph.pregel._algo import PregelTaskWrites, apply_writes, prepare_next_tasks
    from langgraph.pregel._loop import AsyncPregelLoop, PregelLoop, SyncPregelLoop
    from langgraph.pregel._read import DEFAULT_BOUND, PregelNode
    from langgraph.pregel._retry import arun_with_retry
    from langgraph.pregel._utils import _runnable_has_native_async
    from langgraph.types import PregelExecutableTask
except ImportError as exc:  # pragma: no cover - depends on the installed LangGraph
    raise ImportError(
        f"spec_tot.langgraph supports LangGraph {SUPPORTED_VERSIONS}; langgraph "
        f"{langgraph.version.__version__} moved a Pregel internal it needs: {exc}"
    ) from exc

__all__ = [
    "CONF",
    "START",
    "SUPPORTED_VERSIONS",
    "Command",
    "Pregel",
    "PregelExecutableTask",
    "PregelLoop",
    "PregelNode",
    "Runtime",
    "SeamedNode",
    "Send",
    "World",
    "arun_task",
    "has_native_async",
    "is_async",
    "loop_of",
    "on_exit",
    "path_key",
    "pending_sends",
    "private_copy",
    "rewire_nodes",
    "runtime_of",
    "sends_in",
    "speculative_base",
    "task_id_of",
    "with_stream_writer",
]


def loop_of(config: RunnableConfig | None) -> PregelLoop | None:
    """The Pregel loop running the task whose config this is (None outside one). LangGraph's
    runner gives every task a ``call`` hook bound to the loop's ``accept_push``."""
    call = ((config or {}).get(CONF) or {}).get(CONFIG_KEY_CALL)
    schedule = getattr(call, "keywords", {}).get("schedule_task")
    loop = getattr(schedule, "__self__", None)
    return loop if isinstance(loop, PregelLoop) else None


def on_exit(loop: PregelLoop, close: Callable[[], Any]) -> bool:
    """Run ``close`` (a coroutine function for an async loop) when the loop exits, before
    LangGraph's own executor winds down; returns whether the loop is async."""
    if isinstance(loop, AsyncPregelLoop):
        loop.stack.push_async_callback(close)
        return True
    if isinstance(loop, SyncPregelLoop):
        loop.stack.callback(close)
        return False
    raise TypeError(f"not a LangGraph loop: {type(loop).__name__}")  # pragma: no cover


def is_async(loop: PregelLoop) -> bool:
    return isinstance(loop, AsyncPregelLoop)


def task_id_of(config: RunnableConfig) -> str | None:
    value = (config.get(CONF) or {}).get(CONFIG_KEY_TASK_ID)
    return value if isinstance(value, str) else None


def runtime_of(config: RunnableConfig) -> Runtime[Any] | None:
    runtime = (config.get(CONF) or {}).get(CONFIG_KEY_RUNTIME)
    return runtime if isinstance(runtime, Runtime) else None


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


class SeamedNode(PregelNode):
    """A graph node exactly as LangGraph built it (``bound``, ``writers``, ``subgraphs`` and
    the rest untouched, so drawing, validation and subgraph detection see the user's
    node), except for what a task runs: ``seam(bound)`` in place of ``bound``, and
    ``observer`` after the writers (once the task's writes, conditional edges included, are
    all made)."""

    def __init__(
        self,
        *,
        seam: Callable[[Any], Any] | None = None,
        observer: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.seam = seam
        self.observer = observer

    @cached_property
    def node(self) -> Any:
        # PregelNode.node's composition, with the two seams
        steps = [*self.flat_writers, *([self.observer] if self.observer is not None else [])]
        if self.bound is not DEFAULT_BOUND:
            steps.insert(0, self.bound if self.seam is None else self.seam(self.bound))
        if len(steps) <= 1:
            return steps[0] if steps else None
        return RunnableSeq(*steps, trace_policy=self.trace_policy)

    def copy(self, update: dict[str, Any]) -> SeamedNode:
        attrs = {**self.__dict__, **update}
        for cached in ("flat_writers", "node", "input_cache_key"):
            attrs.pop(cached, None)
        return SeamedNode(**attrs)


def rewire_nodes(
    nodes: Mapping[str, PregelNode],
    seam: Callable[[str], Callable[[Any], Any] | None],
    observer: Callable[[str], Any] | None = None,
) -> dict[str, PregelNode]:
    """Copies of a compiled graph's nodes whose tasks run ``seam(name)(bound)`` instead of
    the node's runnable (None: the runnable itself) and then ``observer(name)`` after its
    writers."""
    out: dict[str, PregelNode] = {}
    for name, node in nodes.items():
        attrs = {k: v for k, v in node.__dict__.items() if k not in ("seam", "observer")}
        for cached in ("flat_writers", "node", "input_cache_key"):
            attrs.pop(cached, None)
        out[name] = SeamedNode(
            seam=seam(name), observer=observer(name) if observer else None, **attrs
        )
    return out


async def arun_task(task: PregelExecutableTask) -> None:
    """Run one task with LangGraph's own retry policy and timeouts."""
    await arun_with_retry(task, task.retry_policy)


@dataclass
class World:
    """A copy of one superstep's state: the checkpoint bookkeeping (versions seen, which
    decides what triggers next) and the channels (values and reducers). A prediction
    applies the writes of finished tasks to a fork of it and prepares what would follow,
    exactly as LangGraph's loop would; nothing here reaches the loop."""

    checkpoint: Checkpoint
    channels: dict[str, BaseChannel[Any, Any, Any]]
    managed: Any
    nodes: Mapping[str, PregelNode]
    trigger_to_nodes: Mapping[str, Sequence[str]]
    retry_policy: Sequence[Any]
    next_version: Any
    store: Any
    step: int
    stop: int
    updated: set[str] | None = None

    @classmethod
    def of_loop(cls, loop: PregelLoop, nodes: Mapping[str, PregelNode]) -> World:
        """The state the loop's running superstep started from (its writes are applied only
        when every task is done, so reading it from inside a running task is consistent);
        ``nodes``: the graph's nodes as a prediction runs them."""
        world = cls(
            checkpoint=loop.checkpoint,
            channels=dict(loop.channels),
            managed=loop.managed,
            nodes=nodes,
            trigger_to_nodes=loop.trigger_to_nodes,
            retry_policy=tuple(loop.retry_policy or ()),
            next_version=loop.checkpointer_get_next_version,
            store=loop.store,
            step=loop.step,
            stop=loop.stop,
            updated=set(loop.updated_channels) if loop.updated_channels is not None else None,
        )
        return world.fork()

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
            channels={k: _own_copy(ch) for k, ch in self.channels.items()},
            managed=self.managed,
            nodes=self.nodes,
            trigger_to_nodes=self.trigger_to_nodes,
            retry_policy=self.retry_policy,
            next_version=self.next_version,
            store=self.store,
            step=self.step,
            stop=self.stop,
            updated=set(self.updated) if self.updated is not None else None,
        )

    def prepare(self, config: RunnableConfig) -> list[PregelExecutableTask]:
        """This world's superstep as LangGraph would prepare it, in path order (empty: the
        graph ends). No checkpointer, no callbacks: nothing a task does here is recorded."""
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
            store=self.store,
            checkpointer=None,
            manager=None,
            trigger_to_nodes=self.trigger_to_nodes,
            updated_channels=self.updated,
            retry_policy=self.retry_policy,
        )
        return sorted(tasks.values(), key=path_key)

    def apply(self, tasks: Iterable[Any]) -> None:
        """End the superstep: reducers fold the tasks' writes (in path order)."""
        self.updated = apply_writes(
            self.checkpoint, self.channels, list(tasks), self.next_version, self.trigger_to_nodes
        )
        self.step += 1
        # A fixed node: a fork draws nothing from the process's random streams.
        self.checkpoint = {**self.checkpoint, "id": str(uuid6(node=0, clock_seq=self.step))}

    def apply_writes_of(self, finished: Iterable[tuple[PregelExecutableTask, list[Any]]]) -> None:
        """End the superstep with the given writes of some of its tasks."""
        self.apply(PregelTaskWrites(t.path, t.name, writes, t.triggers) for t, writes in finished)

    def pending_sends(self) -> list[Any]:
        chan = self.channels.get(TASKS)
        return list(chan.get()) if chan is not None and chan.is_available() else []


def _own_copy(channel: BaseChannel[Any, Any, Any]) -> BaseChannel[Any, Any, Any]:
    """A copy of a channel for a fork. A reducer channel's copy shares its accumulated value
    with the original, and a reducer may extend that value in place (``a.extend(b); return
    a``): the fork gets its own container (a shallow copy; a reducer that mutates the
    objects inside it in place is not isolated, as LangGraph's own fresh reads are not)."""
    own = channel.copy()
    if isinstance(own, BinaryOperatorAggregate | DeltaChannel) and isinstance(
        own.value, list | dict | set
    ):
        own.value = copy.copy(own.value)
    return own


def pending_sends(loop: PregelLoop) -> list[Any]:
    """The Sends the loop's running superstep was prepared from."""
    chan = loop.channels.get(TASKS)
    return list(chan.get()) if chan is not None and chan.is_available() else []


def sends_in(writes: Iterable[tuple[str, Any]]) -> list[Any]:
    return [value for chan, value in writes if chan == TASKS]


def has_native_async(runnable: Any) -> bool:
    """Whether ``runnable`` awaits natively (LangGraph's own test, as for node timeouts)."""
    return bool(_runnable_has_native_async(runnable))


def with_stream_writer(config: RunnableConfig, writer: Callable[[Any], None]) -> RunnableConfig:
    """``config`` whose runtime writes custom stream chunks to ``writer``."""
    runtime = runtime_of(config)
    if runtime is None:
        return config
    configurable = {
        **(config.get(CONF) or {}),
        CONFIG_KEY_RUNTIME: runtime.override(stream_writer=writer),
    }
    return {**config, CONF: configurable}


def speculative_base(config: RunnableConfig) -> RunnableConfig:
    """A loop's config as speculative tasks get it: no callbacks (their events are logged
    by their entry), no parent stream, no checkpointer (nothing they run is recorded)."""
    configurable = {
        k: v
        for k, v in (config.get(CONF) or {}).items()
        if k not in (CONFIG_KEY_STREAM, CONFIG_KEY_CHECKPOINTER, CONFIG_KEY_NODE_FINISHED)
    }
    return {**config, "callbacks": None, CONF: configurable}


def private_copy(value: Any) -> Any:
    """A copy of a node's return value that nothing downstream can mutate (reducers such as
    ``add_messages`` set fields in place); the value itself when it cannot be copied."""
    try:
        return copy.deepcopy(value)
    except Exception:
        return value
