"""``ToTApp``: the immutable compiled ToT program, a langchain_core Runnable."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.runnables import Runnable, RunnableConfig

from spec_tot._private.compiled import CompiledGraph
from spec_tot._private.runnable import ChainRuns, configured_app
from spec_tot._private.threads import run_sync
from spec_tot.backends import GenerationBackend, RewardBackend, default_registry, start_backends
from spec_tot.config import ExecutorConfig
from spec_tot.errors import ConfigError, QueryTimeoutError
from spec_tot.events import EventSink
from spec_tot.executor.hub import BackendHub, QueryInput, hub_for
from spec_tot.executor.run_queries import RunSpec, run_queries
from spec_tot.graph_nodes import GraphParts, State
from spec_tot.policies import create_policy
from spec_tot.policies.base import SearchPolicy
from spec_tot.results import BatchResult, ToTResult

__all__ = ["BatchResult", "ToTApp", "ToTResult"]


def _default_input(value: Any) -> State:
    if isinstance(value, str):
        return {"question": value, "steps": []}
    if isinstance(value, Mapping):
        if "question" not in value:
            raise ConfigError("input", "a dict input needs a 'question' key")
        return {"steps": [], **value}
    raise ConfigError("input", f"expected a question string or a dict, got {type(value).__name__}")


def _default_answer(state: State) -> str | None:
    if state.get("answer") is not None:
        return str(state["answer"])
    steps = state.get("steps") or []
    return str(steps[-1]) if steps else None


class ToTApp(Runnable[Any, ToTResult]):
    """A compiled ThoughtGraph bound to a search policy, a backend and an executor config.

    Input: a question string or a state dict with ``question``. Output: ``ToTResult``.
    ``abatch``/``arun_batch`` run many queries at once on one backend (continuous batching
    across queries); ``arun_batch`` also returns the run's metrics.
    """

    def __init__(
        self,
        graph: CompiledGraph,
        policy_factory: Callable[[], SearchPolicy],
        backend: GenerationBackend | Callable[[], GenerationBackend],
        reward: RewardBackend | Callable[..., Any] | None,
        config: ExecutorConfig,
        answer: Callable[[State], str | None],
        check: Callable[[State, str | None], bool] | None,
        input_to_state: Callable[[Any], State],
    ) -> None:
        self.graph = graph
        self.policy_factory = policy_factory
        self._backend_source = backend
        self._backend: GenerationBackend | None = (
            backend if isinstance(backend, GenerationBackend) else None
        )
        self.reward = reward
        self.config = config
        self.answer_fn = answer
        self.check = check
        self.input_to_state = input_to_state

    @classmethod
    def build(
        cls,
        graph: GraphParts,
        *,
        search: str | SearchPolicy | Callable[[], SearchPolicy],
        search_params: dict[str, Any],
        backend: GenerationBackend | str | None,
        backend_options: dict[str, Any],
        reward: RewardBackend | Callable[..., Any] | None,
        config: ExecutorConfig | None,
        answer: Callable[[State], str | None] | None,
        check: Callable[[State, str | None], bool] | None,
        input_to_state: Callable[[Any], State] | None,
    ) -> ToTApp:
        compiled = CompiledGraph.from_builder(graph)
        if isinstance(search, str):
            name = search
            create_policy(name, **search_params)  # validate the parameters now
            policy_factory: Callable[[], SearchPolicy] = lambda: create_policy(  # noqa: E731
                name, **search_params
            )
        elif isinstance(search, SearchPolicy):
            raise ConfigError(
                "search",
                "pass a policy name or a zero-argument factory: policies hold "
                "per-query state, so one instance cannot serve several queries",
            )
        elif callable(search):
            policy_factory = search
        else:
            raise ConfigError("search", f"expected a policy name or factory, got {search!r}")
        if backend is None:
            raise ConfigError("backend", "compile() needs a backend (instance or name)")
        # A name, an instance or a LangChain model (wrapped), refused here if it is none.
        source = default_registry().resolve(backend, backend_options)
        return cls(
            compiled,
            policy_factory,
            source,
            reward,
            config or ExecutorConfig(),
            answer or _default_answer,
            check,
            input_to_state or _default_input,
        )

    # -- backend ------------------------------------------------------------------------------
    @property
    def backend(self) -> GenerationBackend:
        """The generation backend (created on first use when given by name)."""
        if self._backend is None:
            factory = self._backend_source
            assert callable(factory)
            self._backend = factory()
        return self._backend

    @property
    def reward_scorer(self) -> Any:
        """The default reward: the one given to compile, else the backend if it scores."""
        if self.reward is not None:
            return self.reward
        return self.backend if isinstance(self.backend, RewardBackend) else None

    # -- running ------------------------------------------------------------------------------
    async def arun_batch(
        self,
        inputs: Sequence[Any],
        *,
        max_concurrency: int | None = None,
        on_result: Callable[[ToTResult], None] | None = None,
        on_event: EventSink | None = None,
    ) -> BatchResult:
        """Run queries concurrently on one backend; one's failure never stops the others.
        ``on_result`` is called as each query finishes (progress bars); ``on_event`` gets
        every search event (``spec_tot.events.ToTEvent``) as it happens."""
        await start_backends(self.backend, self.reward_scorer)
        hub = hub_for(self.backend)
        queries = self._reserve(hub, inputs)
        return await self._run(hub, queries, max_concurrency, on_result, on_event)

    def _reserve(self, hub: BackendHub, inputs: Sequence[Any]) -> list[QueryInput]:
        """Reserve the queries' ids on the backend (explicit ones checked, the others
        ``q<n>``) before any query starts: a concurrent batch, app or call on the same
        backend cannot reuse one while it is queued or running."""
        return hub.reserve([self.input_to_state(value) for value in inputs])

    async def _run(
        self,
        hub: BackendHub,
        queries: list[QueryInput],
        max_concurrency: int | None,
        on_result: Callable[[ToTResult], None] | None,
        on_event: EventSink | None,
    ) -> BatchResult:
        """Run reserved queries; their ids are released as each ends."""
        run_spec = RunSpec(
            self.graph,
            self.policy_factory,
            self.backend,
            hub,
            self.reward_scorer,
            self.config,
            self.answer_fn,
            self.check,
        )
        try:
            return await run_queries(
                run_spec,
                queries,
                max_concurrency=max_concurrency or self.config.max_concurrency,
                on_result=on_result,
                on_event=on_event,
                release=lambda qid: hub.release([qid]),
            )
        finally:
            hub.release(q.query_id for q in queries)

    def run_batch(
        self,
        inputs: Sequence[Any],
        *,
        max_concurrency: int | None = None,
        on_result: Callable[[ToTResult], None] | None = None,
        on_event: EventSink | None = None,
    ) -> BatchResult:
        """Sync twin of ``arun_batch``."""
        result: BatchResult = run_sync(
            self.arun_batch(
                inputs, max_concurrency=max_concurrency, on_result=on_result, on_event=on_event
            )
        )
        return result

    # -- Runnable -----------------------------------------------------------------------------
    # RunnableConfig is honoured: callbacks/tags/metadata/run_name/run_id (one chain run per
    # query, search events as custom events), max_concurrency, configurable["spec_tot"]
    # (ExecutorConfig overrides) and an explicit recursion_limit (tree depth bound); see
    # spec_tot._private.runnable for its pieces (the run path is ``_configured``, here).
    # stream/astream/astream_events are Runnable's own, on top.
    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> ToTResult:
        result: ToTResult = run_sync(self.ainvoke(input, config, **kwargs))
        return result

    async def ainvoke(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> ToTResult:
        result = (await self._configured([input], [config]))[0]
        if result.status == "timeout":
            raise QueryTimeoutError("; ".join(result.errors))
        return result

    async def abatch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[ToTResult]:
        configs = list(config) if isinstance(config, list) else [config] * len(inputs)
        if len(configs) != len(inputs):
            raise ConfigError("config", f"{len(configs)} configs for {len(inputs)} inputs")
        return await self._configured(inputs, configs)

    def batch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[ToTResult]:
        # One event loop for the whole batch: queries share the backend's batching.
        results: list[ToTResult] = run_sync(
            self.abatch(inputs, config, return_exceptions=return_exceptions)
        )
        return results

    async def _configured(
        self, inputs: Sequence[Any], configs: Sequence[RunnableConfig | None]
    ) -> list[ToTResult]:
        """One batch run over ``inputs`` (shared batching), one chain run per input, events
        routed to their query's run. The first config's executor settings apply to the whole
        batch. The query ids are reserved up front (events need them) and released at the
        end."""
        app = configured_app(self, configs[0] if configs else None)
        await start_backends(app.backend, app.reward_scorer)
        hub = hub_for(app.backend)
        queries = app._reserve(hub, inputs)
        try:
            runs = await ChainRuns.start(self.get_name(), inputs, queries, configs)
            limit = next((c.get("max_concurrency") for c in configs if c), None)
            try:
                batch = await app._run(hub, queries, limit, None, runs.pump)
            except BaseException as exc:
                await runs.fail(exc)
                raise
            await runs.end(batch.results)
            return batch.results
        finally:
            hub.release(q.query_id for q in queries)

    async def aclose(self) -> None:
        if self._backend is not None:
            await self._backend.aclose()
