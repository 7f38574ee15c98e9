"""The served model's chat template, so a ToT program's chat prompts (the math program's) are
laid out as the model was trained, with no code of the user's:

1. ``tokenizer=DIR``: the tokenizer in a local folder (the model folder the server was
   started with) renders any message list with its template;
2. else the server's own template, learnt once at ``start()`` from vLLM's ``POST /tokenize``
   (``messages`` + ``add_generation_prompt``) and ``POST /detokenize``: one user message
   with a marker is rendered by the server, and the text around the marker is the frame
   every single-user-message chat is put in;
3. else (a server without those routes) ``role: content`` lines and ``assistant:``, the
   layout the embedded engine uses for a model without a template.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from spec_tot.adapters.http import EndpointPool
from spec_tot.errors import BackendError, ConfigError

__all__ = ["ServedChat"]

_log = logging.getLogger("spec_tot.backends")
_MARK = "\u2063SPECTOTMESSAGE\u2063"  # invisible separator: never in a real template


class ServedChat:
    def __init__(self, pool: EndpointPool, model: str, tokenizer_folder: str | None) -> None:
        self.pool, self.model, self.folder = pool, model, tokenizer_folder
        self._tokenizer: Any = None
        self.frame: tuple[str, str] | None = None  # (before, after) one user message

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of the ``tokenizer`` folder (loaded on first use), None without."""
        if self.folder is None:
            return None
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
            except (OSError, ValueError) as exc:
                raise ConfigError("tokenizer", f"no tokenizer in {self.folder!r}: {exc}") from exc
        return self._tokenizer

    async def learn(self) -> None:
        """Learn the server's frame (step 2 of the module docstring) when no folder is
        given; a server without the routes leaves it unknown."""
        if self.folder is not None or self.frame is not None:
            return
        messages = [{"role": "user", "content": _MARK}]
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        try:
            _, tokens = await self.pool.json("POST", "/tokenize", body)
            ids = tokens.get("tokens") if isinstance(tokens, dict) else None
            _, text = await self.pool.json(
                "POST", "/detokenize", {"model": self.model, "tokens": ids}
            )
        except BackendError as exc:
            text, why = None, str(exc)
        else:
            why = "its /tokenize reply had no single message in it"
        prompt = text.get("prompt") if isinstance(text, dict) else None
        if isinstance(prompt, str) and prompt.count(_MARK) == 1:
            before, after = prompt.split(_MARK)
            self.frame = (before, after)
            return
        # not silent: chat prompts then go out in a layout the model was not trained on
        _log.warning(
            "openai: the server's chat template is unknown (%s); chat prompts use a plain "
            "'role: content' layout: give tokenizer=DIR (the model's folder) for its own",
            why,
        )

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        plain = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        tokenizer = self.tokenizer
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
            return str(text)
        if self.frame is not None and tokenizer is None:
            if len(plain) != 1 or plain[0]["role"] != "user":
                raise ConfigError(
                    "messages",
                    "the server's chat template was learnt for one user message; give the "
                    "backend the model's tokenizer folder (tokenizer=DIR) for other chats",
                )
            return self.frame[0] + plain[0]["content"] + self.frame[1]
        return "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"
