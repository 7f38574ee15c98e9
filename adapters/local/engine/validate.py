"""Request validation where a request enters the engine: everything a step could trip on is
refused here, with a ``ConfigError`` naming the field, so one bad request never reaches a
forward pass that other requests share.

Long text is refused before it is tokenised: a text of more than ``max_len x (the longest
token's characters)`` characters cannot fit, whatever the tokenizer makes of it.
"""

from __future__ import annotations

from typing import Any

from spec_tot.errors import ConfigError
from spec_tot.requests import GenerateRequest

__all__ = ["RequestValidator", "max_token_chars"]

_FALLBACK_TOKEN_CHARS = 64


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (its vocabulary's longest entry; byte-
    level and SentencePiece entries are never shorter than the text they decode to)."""
    fixed = getattr(tokenizer, "chars_per_token", None)
    if isinstance(fixed, int):
        return fixed
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return _FALLBACK_TOKEN_CHARS
    vocab = get_vocab()
    return max((len(tok) for tok in vocab), default=_FALLBACK_TOKEN_CHARS) or 1


class RequestValidator:
    """Checks a request against one engine: its vocabulary, length limit and batch size.

    ``LocalBackend`` runs ``check_request`` in the caller's process before a request is
    sent (no tokenizer there: ``tokenizer`` None and ``max_chars`` as the engine reported
    it); the engine runs ``prompt_ids`` where it tokenises."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_len: int,
        max_n: int,
        max_chars: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.max_n = max_n
        if max_chars is None:
            max_chars = max_len * max_token_chars(tokenizer)
        self.max_chars = max_chars
        self._ahead: dict[str, list[int]] = {}  # prompt -> ids, from ``encode_ahead``

    def encode_ahead(self, texts: list[str]) -> None:
        """Tokenize the prompts of requests about to be added in one tokenizer call (a fast
        tokenizer's per-call overhead was most of a short prompt's cost); ``prompt_ids``
        takes each from here (what an earlier batch left, its request refused before it
        was tokenized, is forgotten now). A prompt a check refuses, or a batch the
        tokenizer cannot take, is left to ``prompt_ids``, whose error names it."""
        self._ahead.clear()
        todo = [t for t in dict.fromkeys(texts) if t and len(t) <= self.max_chars]
        if len(todo) < 2:
            return
        try:
            batch = self.tokenizer(todo, add_special_tokens=True)["input_ids"]
        except Exception:  # e.g. a lone surrogate: each prompt alone, in prompt_ids
            return
        self._ahead.update(zip(todo, batch, strict=True))

    def check_text(self, text: str, field: str = "prompt") -> None:
        if len(text) > self.max_chars:
            raise ConfigError(
                field,
                f"{len(text)} characters cannot fit in {self.max_len} tokens "
                f"(at most {self.max_chars} characters)",
            )

    def check_ids(self, ids: tuple[int, ...] | list[int], field: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            vocab = self.vocab_size
            raise ConfigError(field, f"token id {bad} is outside the vocabulary [0, {vocab})")

    def check_request(self, request: GenerateRequest) -> None:
        """The checks that need no tokenizing (cheap: run them before queueing)."""
        if request.n > self.max_n:
            raise ConfigError("n", f"must be <= {self.max_n} (max_num_seqs), got {request.n}")
        if request.prompt is not None:
            self.check_text(request.prompt)
        else:
            assert request.prompt_ids is not None  # GenerateRequest checked exactly one is set
            self.check_ids(request.prompt_ids, "prompt_ids")
            self._check_length(len(request.prompt_ids), "prompt_ids")
        params = request.sampling
        self.check_ids(params.stop_token_ids, "sampling.stop_token_ids")
        self.check_ids(params.logprob_token_ids, "sampling.logprob_token_ids")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ConfigError("sampling.logprobs", f"must be <= the vocabulary ({self.vocab_size})")

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The validated prompt as token ids (text is tokenised here)."""
        self.check_request(request)
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        text = request.prompt or ""
        ahead = self._ahead.pop(text, None)
        ids = [int(t) for t in (self.tokenizer.encode(text) if ahead is None else ahead)]
        if not ids:
            raise ConfigError("prompt", "encodes to no token")
        self.check_ids(ids, "prompt")
        self._check_length(len(ids), "prompt")
        return ids

    def _check_length(self, num_tokens: int, field: str) -> None:
        if num_tokens >= self.max_len:
            raise ConfigError(
                field, f"{num_tokens} tokens; the engine holds {self.max_len} a sequence"
            )
