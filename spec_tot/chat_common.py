"""What spec-tot's chat models share: their base class (LangChain's overrides, the timeout
check), reading messages, cutting at stop words, usage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGenerationChunk
from pydantic import ConfigDict

from spec_tot.errors import ConfigError

__all__ = [
    "SpecTotChat",
    "check_timeout",
    "cut_at_stop",
    "last_chunk",
    "last_human_text",
    "ls_params",
    "messages_to_text",
    "usage",
]


def check_timeout(timeout: float | None) -> None:
    """A chat model's ``timeout`` (seconds a call may take): None, or above zero."""
    if timeout is not None and not timeout > 0:
        raise ConfigError("timeout", f"must be > 0, got {timeout}")


def _text(message: BaseMessage, index: int) -> str:
    content = message.content
    if isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") not in (None, "text") for b in content
    ):
        kinds = sorted({str(b.get("type")) for b in content if isinstance(b, dict)})
        raise ConfigError(f"messages[{index}]", f"only text content is supported, got {kinds}")
    return message.text


def messages_to_text(messages: Sequence[BaseMessage]) -> str:
    """The default prompt of a text-completion backend: the messages' texts, one a line."""
    if not messages:
        raise ConfigError("messages", "need at least one message")
    return "\n".join(t for i, m in enumerate(messages) if (t := _text(m, i)))


def last_human_text(messages: Sequence[BaseMessage]) -> str:
    """The question a ToT search answers: the last human message's text."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, HumanMessage):
            text = _text(message, index).strip()
            if not text:
                raise ConfigError(f"messages[{index}]", "the human message is empty")
            return text
    raise ConfigError("messages", "need at least one human message (the question)")


def cut_at_stop(text: str, stop: Sequence[str] | None) -> str:
    """``text`` up to the first stop word it contains."""
    cut = len(text)
    for word in stop or ():
        if word and (at := text.find(word)) >= 0:
            cut = min(cut, at)
    return text[:cut]


def usage(input_tokens: int, output_tokens: int) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        total_tokens=input_tokens + output_tokens,
    )


def last_chunk(message: BaseMessage) -> ChatGenerationChunk:
    """A whole reply as a stream's last chunk: its content, usage and metadata."""
    chunk = AIMessageChunk(
        content=message.content,
        usage_metadata=getattr(message, "usage_metadata", None),
        response_metadata=message.response_metadata,
        chunk_position="last",
    )
    return ChatGenerationChunk(message=chunk)


def ls_params(model: Any, stop: Sequence[str] | None, kwargs: Mapping[str, Any]) -> LangSmithParams:
    """LangSmith's standard parameters of a spec-tot chat model's call (``kwargs`` override
    the model's fields, as at call time)."""
    params = LangSmithParams(
        ls_provider="spec_tot",
        ls_model_name=str(kwargs.get("model", model.model_name)),
        ls_model_type="chat",
    )
    temperature = kwargs.get("temperature", model.temperature)
    if temperature is not None:
        params["ls_temperature"] = temperature
    max_tokens = kwargs.get("max_tokens", model.max_tokens)
    if max_tokens is not None:
        params["ls_max_tokens"] = max_tokens
    if stop or model.stop:
        params["ls_stop"] = list(stop or model.stop or [])
    return params


class SpecTotChat(BaseChatModel):
    """The base of spec-tot's chat models (``ToTChatModel``, ``ChatSpecTot``): LangChain's
    type name (``llm_type``) and LangSmith parameters, and a ``timeout`` checked at
    construction. Subclasses declare ``model_name``, ``temperature``, ``max_tokens``,
    ``timeout`` and ``stop`` fields and call ``super().model_post_init``."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)
    llm_type: ClassVar[str] = "spec-tot"

    def model_post_init(self, context: Any) -> None:
        check_timeout(getattr(self, "timeout", None))

    @property
    def _llm_type(self) -> str:
        return self.llm_type

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return ls_params(self, stop, kwargs)
