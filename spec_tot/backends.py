"""Backend contracts and the lazy name registry.

The core never imports an adapter module at import time: ``default_registry().create("local")``
imports ``spec_tot.adapters.local`` only when asked. Each backend is one ``BackendEntry``: its
factory and its option schema (what the CLI's ``--backend-opt`` values are typed and checked
by). Third parties declare their backends as entry points (group ``spec_tot.backends``),
which ``default_registry()`` reads, or register them in a ``BackendRegistry`` of their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spec_tot.errors import ConfigError, UnknownNameError
from spec_tot.plugins import declared, load_target
from spec_tot.requests import Capabilities, GenerateRequest, GenerateResult, RewardItem

__all__ = [
    "BACKEND_ENTRY_POINTS",
    "BUILT_IN_BACKENDS",
    "BackendEntry",
    "BackendRegistry",
    "GenerationBackend",
    "RewardBackend",
    "default_registry",
    "matches_prefix",
    "start_backends",
]


def matches_prefix(request_id: str, prefix: str) -> bool:
    """The abort contract's subtree test: ``request_id`` is ``prefix`` itself or a path below
    it (``prefix + "/..."``), never a mere string prefix (``q1`` does not cover ``q10``)."""
    return request_id == prefix or request_id.startswith(prefix + "/")


class GenerationBackend(ABC):
    """Generates thoughts.

    Contract:
    - ``generate`` returns ``request.n`` completions, or raises ``BackendError``. When the
      request is aborted while running it returns what it has with ``FinishReason.ABORT`` (or
      raises ``asyncio.CancelledError`` if its own task was cancelled).
    - Cancelling the awaiting task must abort the request on the backend: a cancelled caller
      leaves no in-flight request behind.
    - ``abort(prefix)`` aborts every in-flight request whose id equals ``prefix`` or starts
      with ``prefix + "/"`` (``matches_prefix``); it returns how many it aborted.
    - A request's n samples are independent streams: a backend that splits them into n
      one-sample requests seeds sample ``i`` with ``spec_tot.seeds.sample_seed(seed, i)``.
    - ``num_inflight`` is the number of requests accepted and not yet finished.
    """

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    @abstractmethod
    async def abort(self, prefix: str) -> int: ...

    @property
    @abstractmethod
    def num_inflight(self) -> int: ...

    def count_tokens(self, text: str) -> int:
        """Tokens the backend would use for ``text`` (LV thresholds, metrics)."""
        return max(1, len(text) // 4)

    def stats(self) -> dict[str, float]:
        """Engine counters (peak KV blocks, steps, ...). Empty when the backend has none."""
        return {}

    def reported_load(self) -> float | None:
        """Running plus waiting sequences as the serving engine itself reports them (every
        client together), or None when the backend does not know (the default).

        The shared speculation budget takes it, when not None, as the engine's committed
        load, so several client processes on one server share one budget. It must return
        at once (no I/O on the caller's loop): a remote backend polls in the background and
        returns its latest figure."""
        return None

    async def start(self) -> None:  # noqa: B027 - optional hook, most backends start nothing
        """Bring the backend up (an engine process, a server's limits) and wait until it is
        ready; idempotent. spec-tot's apps call it before a run; properties such as
        ``capabilities`` then answer at once."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release connections, threads and memory."""


async def start_backends(*backends: object) -> None:
    """``await backend.start()`` for each distinct spec-tot backend among ``backends`` (the
    rest, such as reward functions, have nothing to start)."""
    seen: set[int] = set()
    for backend in backends:
        if isinstance(backend, GenerationBackend | RewardBackend) and id(backend) not in seen:
            seen.add(id(backend))
            await backend.start()


class RewardBackend(ABC):
    """Scores traces (PRM, verifier, judge).

    Contract: ``score`` returns, for each item, a tuple of per-step scores (finite real
    numbers, within ``score_range`` when it is stated) whose length equals
    ``len(item.steps)`` (an outcome scorer repeats its one score). It is called with
    batches; a batch is one forward pass where the backend can do that. The executor checks
    every score: a bad one fails only the query it belongs to.
    """

    # The range every score lies in, or None when the backend does not state one.
    score_range: tuple[float, float] | None = None

    @abstractmethod
    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]: ...

    def count_item_tokens(self, item: RewardItem) -> int:
        """Input tokens that scoring ``item`` costs (lazy verification's token threshold
        counts these); a backend with a prefix cache may count only the part it would
        compute."""
        return max(1, len(item.text) // 4)

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Bring the scorer up and wait until it is ready (see ``GenerationBackend.start``)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""


Factory = Callable[..., Any]
BACKEND_ENTRY_POINTS = "spec_tot.backends"


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """One registered backend.

    - ``factory``: a callable taking the options as keywords, or ``"module:attr"`` naming
      one (imported on first use, so optional dependencies cost nothing until then).
    - ``options``: where its option names and types are declared, each a config dataclass
      (its fields) or a callable (its named parameters), as an object or ``"module:attr"``;
      ``None`` for a backend that checks loose values itself (the CLI reads them as JSON).
    - ``aliases``: a field named in the backend's own errors -> the option the user gives
      for it (``create_local`` passes ``policy_path`` on as the engine's ``model``).
    - ``internal``: fields of its option sources that the factory sets itself, so they are
      not options (the HTTP backends' ``http`` config is built from its loose fields).
    """

    factory: Factory | str
    options: tuple[Any, ...] | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    internal: frozenset[str] = frozenset({"http"})

    def __post_init__(self) -> None:
        if not (callable(self.factory) or isinstance(self.factory, str)):
            raise ConfigError(
                "factory", f"expected a callable or 'module:attr', got {self.factory!r}"
            )
        if self.options is not None and not isinstance(self.options, tuple):
            raise ConfigError("options", f"expected a tuple or None, got {self.options!r}")


_HTTP = "spec_tot.adapters.http:HttpConfig"
_BUILT_IN: dict[str, BackendEntry] = {
    "scripted": BackendEntry(
        "spec_tot.adapters.scripted:create_scripted",
        options=("spec_tot.adapters.scripted:ScriptedConfig",),
    ),
    "local": BackendEntry(
        "spec_tot.adapters.local:create_local",
        options=(
            "spec_tot.adapters.local:create_local",
            "spec_tot.adapters.local.config:EngineConfig",
        ),
        aliases={"model": "policy_path"},
        internal=frozenset({"model", "http"}),
    ),
    "sim": BackendEntry(
        "spec_tot.adapters.sim:create_sim",
        options=("spec_tot.adapters.sim:create_sim", "spec_tot.adapters.sim:SimConfig"),
    ),
    "sglang": BackendEntry(
        "spec_tot.adapters.sglang:create_sglang",
        options=(
            "spec_tot.adapters.sglang:create_sglang",
            "spec_tot.adapters.sglang:SGLangConfig",
            _HTTP,
        ),
    ),
    "openai": BackendEntry(
        "spec_tot.adapters.openai_compat:create_openai",
        options=(
            "spec_tot.adapters.openai_compat:create_openai",
            "spec_tot.adapters.openai_compat:OpenAIConfig",
            _HTTP,
        ),
    ),
    "langchain": BackendEntry("spec_tot.adapters.langchain:LangChainBackend"),
}
BUILT_IN_BACKENDS: tuple[str, ...] = tuple(sorted(_BUILT_IN))


@dataclass
class BackendRegistry:
    """Maps a backend name to its ``BackendEntry`` (factory and option schema)."""

    _entries: dict[str, BackendEntry] = field(default_factory=dict)

    def register(
        self,
        name: str,
        factory: Factory | str,
        *,
        options: Sequence[Any] | None = None,
        aliases: Mapping[str, str] | None = None,
        internal: Sequence[str] = ("http",),
    ) -> None:
        """Register (or replace) ``name``; ``options``, ``aliases`` and ``internal`` as in
        ``BackendEntry``."""
        if not name or not isinstance(name, str):
            raise ConfigError("name", f"a backend name must be a non-empty string: {name!r}")
        schema = tuple(options) if options is not None else None
        self._entries[name] = BackendEntry(
            factory, schema, dict(aliases or {}), frozenset(internal)
        )

    def entry(self, name: str) -> BackendEntry:
        """The entry of ``name``; ``UnknownNameError`` listing the known names otherwise."""
        found = self._entries.get(name)
        if found is None:
            raise UnknownNameError("backend", name, self.names())
        return found

    def names(self) -> list[str]:
        return sorted(self._entries)

    def create(self, name: str, **options: Any) -> Any:
        factory = self.entry(name).factory
        if isinstance(factory, str):
            factory = load_target(factory)
        return factory(**options)

    def resolve(
        self, backend: Any, options: Mapping[str, Any] | None = None
    ) -> GenerationBackend | Callable[[], GenerationBackend]:
        """What ``compile(backend=...)`` accepts, checked now: a ``GenerationBackend``; a
        registered name (the backend is created on first use, with ``options``); or a
        LangChain chat model or LLM, wrapped in ``LangChainBackend`` (with ``options``)."""
        options = dict(options or {})
        if isinstance(backend, GenerationBackend):
            return backend
        if isinstance(backend, str):
            self.entry(backend)  # an unknown name fails now, not on first use
            return lambda: self.create(backend, **options)
        from langchain_core.language_models import BaseLanguageModel

        if isinstance(backend, BaseLanguageModel):
            wrapped: GenerationBackend = self.create("langchain", model=backend, **options)
            return wrapped
        raise ConfigError(
            "backend",
            "expected a GenerationBackend, a registered backend name "
            f"({', '.join(self.names())}) or a LangChain chat model, got {type(backend).__name__}",
        )


def default_registry() -> BackendRegistry:
    """A fresh registry: the built-in backends, then the plug-ins that installed
    distributions declare as entry points in the group ``spec_tot.backends`` (name: the
    backend's name; value: ``"module:factory"``, imported on first use).

    ``compile(backend="name")`` and the CLI both start from this registry, so a backend
    registered by a plug-in is seen by both, with no module-global state. A plug-in cannot
    shadow a built-in name (it is skipped with a warning). For a backend that only lives in
    a script, build it yourself (``registry.create(...)``) and pass the instance.
    """
    registry = BackendRegistry(dict(_BUILT_IN))
    for name, target in declared(BACKEND_ENTRY_POINTS, _BUILT_IN, warn=True).items():
        registry.register(name, target)
    return registry
