"""What a speculative task shows the outside, held back until a real task adopts it.

A speculative run's callback events (chain, model and tool runs, tokens, custom events) and
its custom stream chunks go to an ``EventLog`` instead of the run's handlers and stream.
When LangGraph's loop calls the node with the same input and adopts the result, the log is
replayed, in order, into the real task's callback handlers (under the real task's run, with
its tags and metadata: ``messages`` streams, ``astream_events`` and tracers see the calls as
the real task's) and its stream writer. A log that is never adopted is dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.callbacks.base import BaseCallbackManager
from langchain_core.callbacks.manager import ahandle_event, handle_event
from langchain_core.runnables import RunnableConfig

from spec_tot.langgraph._pregel import runtime_of

__all__ = ["EventLog"]

# Each callback event and the handler attribute that makes a handler skip it (as
# ``langchain_core.callbacks.manager`` dispatches them).
_EVENTS: dict[str, str | None] = {
    "on_llm_start": "ignore_llm",
    "on_chat_model_start": "ignore_chat_model",
    "on_llm_new_token": "ignore_llm",
    "on_llm_end": "ignore_llm",
    "on_llm_error": "ignore_llm",
    "on_stream_event": "ignore_llm",
    "on_chain_start": "ignore_chain",
    "on_chain_end": "ignore_chain",
    "on_chain_error": "ignore_chain",
    "on_tool_start": "ignore_agent",
    "on_tool_end": "ignore_agent",
    "on_tool_error": "ignore_agent",
    "on_agent_action": "ignore_agent",
    "on_agent_finish": "ignore_agent",
    "on_retriever_start": "ignore_retriever",
    "on_retriever_end": "ignore_retriever",
    "on_retriever_error": "ignore_retriever",
    "on_retry": "ignore_retry",
    "on_text": None,
    "on_custom_event": "ignore_custom_event",
}
_CUSTOM = "__stream_writer__"

Event = tuple[str, tuple[Any, ...], dict[str, Any]]


class EventLog(BaseCallbackHandler):
    """The callback handler and stream writer of one speculative task."""

    run_inline = True  # record in the order the events happen, on the calling thread

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self.base_tags: list[str] = []
        self.base_metadata: dict[str, Any] = {}

    def _add(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with self._lock:
            self.events.append((name, args, kwargs))

    def stream_writer(self, chunk: Any) -> None:
        self._add(_CUSTOM, (chunk,), {})

    def configure(self, config: RunnableConfig) -> RunnableConfig:
        """``config`` with this log as its only callback handler and stream writer."""
        self.base_tags = list(config.get("tags") or ())
        self.base_metadata = dict(config.get("metadata") or {})
        return {**config, "callbacks": [self]}

    # -- replay ---------------------------------------------------------------------------
    def _calls(self, config: RunnableConfig) -> tuple[list[Any], list[tuple[str, Any, Any]]]:
        manager = config.get("callbacks")
        parent: UUID | None = None
        tags = list(config.get("tags") or ())
        metadata = dict(config.get("metadata") or {})
        if isinstance(manager, BaseCallbackManager):
            handlers = list(manager.handlers)
            parent = manager.parent_run_id
            tags = [
                *manager.inheritable_tags,
                *(t for t in tags if t not in manager.inheritable_tags),
            ]
            metadata = {**manager.inheritable_metadata, **metadata}
        else:
            handlers = list(manager or ())
        calls = []
        with self._lock:
            events = list(self.events)
        for name, args, kwargs in events:
            if name == _CUSTOM:
                calls.append((name, args, kwargs))
                continue
            kw = dict(kwargs)
            if kw.get("parent_run_id") is None and "run_id" in kw:
                kw["parent_run_id"] = parent
            if "tags" in kw:
                own = [t for t in kw["tags"] or () if t not in self.base_tags]
                kw["tags"] = [*tags, *(t for t in own if t not in tags)]
            if "metadata" in kw:
                own_meta = {
                    k: v for k, v in (kw["metadata"] or {}).items() if k not in self.base_metadata
                }
                kw["metadata"] = {**metadata, **own_meta}
            calls.append((name, args, kw))
        return handlers, calls

    def replay(self, config: RunnableConfig) -> None:
        """Show the log to the real task whose config this is (a sync caller)."""
        handlers, calls = self._calls(config)
        writer = _writer(config)
        for name, args, kwargs in calls:
            if name == _CUSTOM:
                writer(*args)
            elif handlers:
                handle_event(handlers, name, _EVENTS[name], *args, **kwargs)

    async def areplay(self, config: RunnableConfig) -> None:
        handlers, calls = self._calls(config)
        writer = _writer(config)
        for name, args, kwargs in calls:
            if name == _CUSTOM:
                writer(*args)
            elif handlers:
                await ahandle_event(handlers, name, _EVENTS[name], *args, **kwargs)


def _writer(config: RunnableConfig) -> Callable[..., None]:
    runtime = runtime_of(config)
    return runtime.stream_writer if runtime is not None else _drop


def _drop(*_: Any) -> None:
    return None


def _recorder(name: str) -> Callable[..., None]:
    def record(self: EventLog, *args: Any, **kwargs: Any) -> None:
        self._add(name, args, kwargs)

    record.__name__ = name
    return record


for _name in _EVENTS:
    setattr(EventLog, _name, _recorder(_name))
