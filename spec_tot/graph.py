"""``ThoughtGraph``: the mutable, LangGraph-style builder of a ToT program.

A graph is the per-branch pipeline that makes and scores one tree node. Walking it from
``START`` reaches a ``thought`` node (an LLM expansion: one tree node per sample), then
``function``/``tool`` nodes, then a ``reward`` node (the barrier speculation runs ahead of);
the edge after the reward either loops back for the next step or reaches ``END`` (the node is
terminal). ``compile()`` validates the structure and returns an immutable ``ToTApp``.

State is a plain dict. Node functions return a dict of updates (last write wins).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spec_tot.backends import GenerationBackend, RewardBackend
from spec_tot.errors import ConfigError, GraphValidationError
from spec_tot.graph_nodes import (
    END,
    START,
    ConditionalEdge,
    FunctionFn,
    GraphNode,
    NodeKind,
    ParseFn,
    PromptFn,
    RouterFn,
    ScoreFn,
    State,
    ToolFn,
    append_step,
    default_reward_item,
)
from spec_tot.requests import SamplingParams

if TYPE_CHECKING:
    from spec_tot.app import ToTApp
    from spec_tot.config import ExecutorConfig
    from spec_tot.policies.base import SearchPolicy

__all__ = [
    "END",
    "START",
    "ConditionalEdge",
    "GraphNode",
    "NodeKind",
    "State",
    "ThoughtGraph",
]


class ThoughtGraph:
    """Builder. Add nodes and edges, then ``compile()``; errors name the node."""

    def __init__(self) -> None:
        self.nodes: dict[str, GraphNode] = {}
        self.edges: dict[str, list[str]] = {}
        self.branches: dict[str, ConditionalEdge] = {}

    # -- nodes --------------------------------------------------------------------------------
    def add_thought(
        self,
        name: str,
        prompt: PromptFn,
        *,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        parse: ParseFn | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ThoughtGraph:
        """An LLM expansion. ``prompt(state)`` builds the prompt text; ``parse(state, text)``
        turns a sample into state updates (default: append it to ``state["steps"]``)."""
        self._check_callable(name, "prompt", prompt)
        params = self._sampling(name, sampling)
        return self._add(
            GraphNode(
                name,
                NodeKind.THOUGHT,
                prompt=prompt,
                sampling=params,
                parse=parse or append_step,
                metadata=dict(metadata or {}),
            )
        )

    def add_reward(
        self,
        name: str,
        scorer: RewardBackend | ScoreFn | None = None,
        *,
        reward_input: Callable[[State], tuple[str, tuple[str, ...]]] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ThoughtGraph:
        """Scores the branch. ``scorer`` is a RewardBackend or a callable over a batch of
        RewardItems returning one score or one tuple of step scores per item (sync or async);
        None uses the reward backend given to ``compile``. ``reward_input(state)`` returns
        (question, steps); the default reads ``state["question"]`` and ``state["steps"]``."""
        if scorer is not None and not isinstance(scorer, RewardBackend):
            self._check_callable(name, "scorer", scorer)
        return self._add(
            GraphNode(
                name,
                NodeKind.REWARD,
                scorer=scorer,
                reward_input=reward_input or default_reward_item,
                metadata=dict(metadata or {}),
            )
        )

    def add_tool(
        self,
        name: str,
        fn: ToolFn,
        *,
        speculable: bool = False,
        pure: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> ThoughtGraph:
        """A side-effecting call. It runs only on committed branches unless it declares
        itself ``pure`` and ``speculable``."""
        self._check_callable(name, "fn", fn)
        node = GraphNode(
            name,
            NodeKind.TOOL,
            fn=fn,
            speculable=speculable,
            pure=pure,
            metadata=dict(metadata or {}),
        )
        return self._add(node)

    def add_function(
        self, name: str, fn: FunctionFn, *, metadata: Mapping[str, Any] | None = None
    ) -> ThoughtGraph:
        """A pure state transform."""
        self._check_callable(name, "fn", fn)
        return self._add(GraphNode(name, NodeKind.FUNCTION, fn=fn, metadata=dict(metadata or {})))

    # -- edges --------------------------------------------------------------------------------
    def add_edge(self, source: str, target: str) -> ThoughtGraph:
        if source == END:
            raise GraphValidationError(END, "END has no outgoing edges")
        if target == START:
            raise GraphValidationError(START, "START has no incoming edges")
        if source in self.branches:
            raise GraphValidationError(source, "already has conditional edges; not both")
        self.edges.setdefault(source, []).append(target)
        return self

    def set_entry_point(self, name: str) -> ThoughtGraph:
        return self.add_edge(START, name)

    def add_conditional_edges(
        self,
        source: str,
        router: RouterFn,
        path_map: Mapping[Hashable, str] | Sequence[str] | None = None,
    ) -> ThoughtGraph:
        """``router(state)`` picks the next node (a name, or a key of ``path_map``)."""
        self._check_callable(source, "router", router)
        if source in self.edges:
            raise GraphValidationError(source, "already has a plain edge; not both")
        if source in self.branches:
            raise GraphValidationError(source, "already has conditional edges")
        mapping: Mapping[Hashable, str] | None
        if path_map is None or isinstance(path_map, Mapping):
            mapping = path_map
        else:
            mapping = {name: name for name in path_map}
        self.branches[source] = ConditionalEdge(router, mapping)
        return self

    # -- compile ------------------------------------------------------------------------------
    def compile(
        self,
        *,
        search: str | SearchPolicy | Callable[[], SearchPolicy] = "beam",
        search_params: Mapping[str, Any] | None = None,
        backend: GenerationBackend | str | None = None,
        backend_options: Mapping[str, Any] | None = None,
        reward: RewardBackend | ScoreFn | None = None,
        config: ExecutorConfig | None = None,
        answer: Callable[[State], str | None] | None = None,
        check: Callable[[State, str | None], bool] | None = None,
        input_to_state: Callable[[Any], State] | None = None,
    ) -> ToTApp:
        """Validate and freeze. See ``ToTApp`` for the meaning of each argument."""
        from spec_tot._private.validate import validate_graph
        from spec_tot.app import ToTApp

        # A named backend is created lazily; whether it scores is checked when it exists.
        has_default_reward = reward is not None or isinstance(backend, RewardBackend | str)
        validate_graph(self, has_default_reward=has_default_reward)
        return ToTApp.build(
            self,
            search=search,
            search_params=dict(search_params or {}),
            backend=backend,
            backend_options=dict(backend_options or {}),
            reward=reward,
            config=config,
            answer=answer,
            check=check,
            input_to_state=input_to_state,
        )

    # -- helpers ------------------------------------------------------------------------------
    def _add(self, node: GraphNode) -> ThoughtGraph:
        if not node.name or not isinstance(node.name, str):
            raise ConfigError("name", "node names must be non-empty strings")
        if node.name in (START, END):
            raise GraphValidationError(node.name, "is reserved")
        if "/" in node.name:
            raise GraphValidationError(node.name, "node names may not contain '/'")
        if node.name in self.nodes:
            raise GraphValidationError(node.name, "already exists")
        self.nodes[node.name] = node
        return self

    @staticmethod
    def _check_callable(node: str, field_name: str, value: object) -> None:
        if not callable(value):
            raise GraphValidationError(node, f"{field_name} must be callable, got {value!r}")

    @staticmethod
    def _sampling(node: str, sampling: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        if sampling is None:
            return SamplingParams(stop=("\n",))
        if isinstance(sampling, SamplingParams):
            return sampling
        try:
            return SamplingParams(**dict(sampling))
        except ConfigError as exc:
            raise GraphValidationError(node, f"sampling {exc}") from exc
        except TypeError as exc:
            raise GraphValidationError(node, f"sampling: {exc}") from exc
