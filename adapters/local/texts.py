"""The embedded engine's tokenizers in the caller's process, and chat rendering.

The engine tokenises in its own core; the caller needs a tokenizer only to count tokens
(lazy verification's thresholds) and to render chat messages with the model's template.
Each is loaded once, on first use, from the folder the core reported.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from .core.messages import PolicyInfo, RewardInfo

__all__ = ["LocalTexts", "render_chat"]

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


class LocalTexts:
    """Tokenizers of the policy and the PRM, loaded once from what their cores reported.

    ``policy``/``reward`` return the cores' reports; ``in_thread_*`` the tokenizer objects
    of an in-thread core, reused rather than loaded twice."""

    def __init__(
        self,
        policy: Callable[[], PolicyInfo | None],
        reward: Callable[[], RewardInfo | None],
        in_thread: Callable[[str], Any],
    ) -> None:
        self._policy, self._reward, self._in_thread = policy, reward, in_thread
        self._loaded: dict[str, Any] = {}

    def tokenizer(self) -> Any:
        info = self._policy()
        if info is None:
            return None
        own = self._in_thread("policy")
        return own if own is not None else self._load("policy", info.model, info.vocab_size)

    def reward_tokenizer(self) -> Any:
        info = self._reward()
        if info is None:
            return None
        own = self._in_thread("reward")
        return own if own is not None else self._load("prm", info.folder, 0)

    def count_tokens(self, text: str) -> int:
        tokenizer = self.tokenizer()
        if tokenizer is None:
            return max(1, len(text) // 4)
        return max(1, len(tokenizer.encode(text)))

    def _load(self, role: str, folder: str | None, vocab_size: int) -> Any:
        tok = self._loaded.get(role)
        if tok is None:
            if folder is None:
                from .engine.synthetic import PseudoTokenizer

                tok = PseudoTokenizer(vocab_size)
            else:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            self._loaded[role] = tok
        return tok


def render_chat(tokenizer: Any, messages: Seq[Any]) -> str:
    """One prompt from chat messages (``{"role", "content"}`` dicts or LangChain messages)
    with ``tokenizer``'s chat template, its generation prompt appended; ``role: content``
    lines when it has no template."""
    plain = [_role_content(m) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True))
    return "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"


def _role_content(message: Any) -> dict[str, str]:
    if isinstance(message, dict):
        return {"role": str(message["role"]), "content": str(message.get("content") or "")}
    role = _ROLES.get(getattr(message, "type", ""), "user")
    return {"role": role, "content": str(getattr(message, "content", ""))}
