"""ThoughtGraph builder and compile-time validation: every error names its node or field."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import GenerateOnlyBackend, RecordingBackend

from spec_tot.adapters.scripted import ScriptedBackend
from spec_tot.app import ToTApp
from spec_tot.config import MODES, ExecutorConfig
from spec_tot.errors import ConfigError, GraphValidationError, UnknownNameError
from spec_tot.graph import END, START, NodeKind, ThoughtGraph
from spec_tot.graphs.toy import build_toy_graph, compile_toy
from spec_tot.policies import POLICY_NAMES
from spec_tot.requests import SamplingParams


def prompt(state: dict[str, Any]) -> str:
    return "\n".join([state["question"], *state["steps"]])


def route(state: dict[str, Any]) -> str:
    return "done" if state["steps"] and state["steps"][-1].startswith("answer") else "more"


def ident(state: dict[str, Any]) -> dict[str, Any]:
    return {}


def scorer(items: list[Any]) -> list[float]:
    return [0.5 for _ in items]


def base_graph() -> ThoughtGraph:
    """A valid graph: START -> t -> r -> (t | END)."""
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r", scorer)
    g.add_edge(START, "t")
    g.add_edge("t", "r")
    g.add_conditional_edges("r", route, {"more": "t", "done": END})
    return g


def compile_g(g: ThoughtGraph, **kwargs: Any) -> ToTApp:
    kwargs.setdefault("backend", ScriptedBackend())
    return g.compile(**kwargs)


def node_error(g: ThoughtGraph, **kwargs: Any) -> GraphValidationError:
    with pytest.raises(GraphValidationError) as info:
        compile_g(g, **kwargs)
    err = info.value
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    assert err.field == f"node {err.node!r}"
    assert repr(err.node) in str(err)
    return err


# -- valid graphs ----------------------------------------------------------------------------
def test_base_graph_compiles() -> None:
    app = compile_g(base_graph())
    assert isinstance(app, ToTApp)
    assert set(app.graph.nodes) == {"t", "r"}
    assert app.graph.edges == {START: "t", "t": "r"}
    assert app.graph.kind("t") is NodeKind.THOUGHT
    assert app.graph.kind("r") is NodeKind.REWARD


def test_toy_graph_compiles() -> None:
    app = compile_toy(backend=ScriptedBackend(), search="beam", search_params={"n": 4, "width": 2})
    assert set(app.graph.nodes) == {"propose", "score"}
    assert app.graph.entry({}) == "propose"


def test_graph_with_function_pure_tool_and_two_thoughts_compiles() -> None:
    g = ThoughtGraph()
    g.add_function("prep", ident)
    g.add_thought("plan", prompt)
    g.add_function("mid", ident)
    g.add_tool("calc", ident, speculable=True, pure=True)
    g.add_thought("act", prompt)
    g.add_reward("r")
    g.add_edge(START, "prep")
    g.add_edge("prep", "plan")
    g.add_edge("plan", "mid")
    g.add_edge("mid", "calc")
    g.add_edge("calc", "act")
    g.add_edge("act", "r")
    g.add_conditional_edges("r", lambda s: END if s["steps"] else "plan", ["plan", END])
    app = g.compile(backend=ScriptedBackend())
    assert app.graph.kind("calc") is NodeKind.TOOL
    assert app.graph.nodes["calc"].pure and app.graph.nodes["calc"].speculable
    # a list path map maps each name to itself
    assert app.graph.next("r", {"steps": ["answer: 1"]}) == END
    assert app.graph.next("r", {"steps": []}) == "plan"
    assert dict(app.graph.branches["r"].path_map or {}) == {"plan": "plan", END: END}


def test_tool_defaults_are_non_speculable() -> None:
    g = ThoughtGraph()
    g.add_tool("side", ident)
    assert not g.nodes["side"].speculable and not g.nodes["side"].pure


def test_builder_is_fluent_and_compiled_graph_is_frozen() -> None:
    g = ThoughtGraph()
    assert g.add_thought("t", prompt) is g
    assert g.add_reward("r", scorer) is g
    assert g.add_edge(START, "t").add_edge("t", "r").add_edge("r", END) is g
    app = g.compile(backend=ScriptedBackend())
    with pytest.raises(TypeError):
        app.graph.nodes["x"] = app.graph.nodes["t"]  # type: ignore[index]
    g.add_function("late", ident)  # mutating the builder afterwards does not touch the app
    assert "late" not in app.graph.nodes


def test_sampling_dict_and_default() -> None:
    g = ThoughtGraph()
    g.add_thought("a", prompt, sampling={"temperature": 0.0, "max_tokens": 5})
    g.add_thought("b", prompt)
    g.add_thought("c", prompt, sampling=SamplingParams(top_k=3))
    assert g.nodes["a"].sampling == SamplingParams(temperature=0.0, max_tokens=5)
    assert g.nodes["b"].sampling is not None and g.nodes["b"].sampling.stop == ("\n",)
    assert g.nodes["c"].sampling == SamplingParams(top_k=3)


# -- structure errors ------------------------------------------------------------------------
def test_unknown_node_in_edge() -> None:
    g = base_graph()
    g.add_function("f", ident)
    g.edges["t"] = ["ghost"]  # replace t -> r
    g.add_edge("f", END)
    err = node_error(g)
    assert err.node == "ghost"
    assert "unknown node" in str(err) and "'t'" in str(err)


def test_unknown_node_as_edge_source() -> None:
    g = base_graph()
    g.add_edge("ghost", "t")
    err = node_error(g)
    assert err.node == "ghost"
    assert "unknown" in str(err)


def test_unknown_node_in_conditional_path_map() -> None:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r", scorer)
    g.add_edge(START, "t")
    g.add_edge("t", "r")
    g.add_conditional_edges("r", route, {"more": "nowhere", "done": END})
    err = node_error(g)
    assert err.node == "nowhere"
    assert "'r'" in str(err)


def test_unreachable_node() -> None:
    g = base_graph()
    g.add_function("orphan", ident)
    g.add_edge("orphan", END)
    err = node_error(g)
    assert err.node == "orphan"
    assert "unreachable" in str(err)


def test_dead_end_node() -> None:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r", scorer)
    g.add_edge(START, "t")
    g.add_edge("t", "r")
    err = node_error(g)
    assert err.node == "r"
    assert "dead end" in str(err)


def test_no_path_to_end() -> None:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r", scorer)
    g.add_edge(START, "t")
    g.add_edge("t", "r")
    g.add_edge("r", "t")
    err = node_error(g)
    assert err.node == "t"
    assert "no path to END" in str(err)


def test_cycle_without_reward() -> None:
    # thought -> function -> thought, the only exit goes through the reward.
    g = ThoughtGraph()
    g.add_thought("think", prompt)
    g.add_function("again", ident)
    g.add_reward("r", scorer)
    g.add_edge(START, "think")
    g.add_edge("think", "again")
    g.add_conditional_edges("again", route, {"more": "think", "done": "r"})
    g.add_edge("r", END)
    err = node_error(g)
    assert err.node in {"think", "again"}
    assert "cycle" in str(err)


def test_function_self_loop_is_a_cycle() -> None:
    g = base_graph()
    g.edges["t"] = ["f"]
    g.add_function("f", ident)
    g.add_conditional_edges("f", lambda s: "x", {"x": "f", "y": "r"})
    err = node_error(g)
    assert err.node == "f"
    assert "cycle" in str(err)


def test_cycle_through_reward_is_fine() -> None:
    compile_g(base_graph())  # t -> r -> t is the normal step loop


def test_speculable_tool_must_be_pure() -> None:
    g = base_graph()
    g.edges["t"] = ["side"]
    g.add_tool("side", ident, speculable=True)
    g.add_edge("side", "r")
    err = node_error(g)
    assert err.node == "side"
    assert "pure" in str(err)


def test_no_entry_point() -> None:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r", scorer)
    g.add_edge("t", "r")
    g.add_edge("r", END)
    err = node_error(g)
    assert err.node == START
    assert "entry point" in str(err)


def test_no_thought_reachable() -> None:
    g = ThoughtGraph()
    g.add_function("f", ident)
    g.add_edge(START, "f")
    g.add_edge("f", END)
    err = node_error(g)
    assert err.node == START
    assert "thought" in str(err)


def test_thought_can_reach_end_without_reward() -> None:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r", scorer)
    g.add_edge(START, "t")
    g.add_conditional_edges("t", route, {"more": "r", "done": END})
    g.add_edge("r", END)
    err = node_error(g)
    assert err.node == "t"
    assert "without passing a reward" in str(err)


def test_reward_reachable_before_any_thought() -> None:
    g = ThoughtGraph()
    g.add_reward("early", scorer)
    g.add_thought("t", prompt)
    g.add_reward("r", scorer)
    g.add_edge(START, "early")
    g.add_edge("early", "t")
    g.add_edge("t", "r")
    g.add_edge("r", END)
    err = node_error(g)
    assert err.node == "early"
    assert "before any thought" in str(err)


def test_reward_scored_twice() -> None:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r1", scorer)
    g.add_reward("r2", scorer)
    g.add_edge(START, "t")
    g.add_edge("t", "r1")
    g.add_edge("r1", "r2")
    g.add_edge("r2", END)
    err = node_error(g)
    assert err.node == "r2"
    assert "scored twice" in str(err)


def test_reward_without_scorer_and_no_default() -> None:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("judge")  # no scorer
    g.add_edge(START, "t")
    g.add_edge("t", "judge")
    g.add_edge("judge", END)
    err = node_error(g, backend=GenerateOnlyBackend())
    assert err.node == "judge"
    assert "no scorer" in str(err)
    # no backend at all: still the reward node is named first
    with pytest.raises(GraphValidationError) as info:
        g.compile()
    assert info.value.node == "judge"
    # a compile-time reward, a RewardBackend backend or a named backend fixes it
    g.compile(backend=GenerateOnlyBackend(), reward=scorer)
    g.compile(backend=RecordingBackend())
    g.compile(backend="scripted")


def test_plain_and_conditional_edge_on_one_node() -> None:
    g = base_graph()
    with pytest.raises(GraphValidationError) as info:
        g.add_edge("r", END)
    assert info.value.node == "r"
    assert "conditional" in str(info.value)
    g2 = ThoughtGraph()
    g2.add_thought("t", prompt)
    g2.add_edge("t", "r")
    with pytest.raises(GraphValidationError) as info:
        g2.add_conditional_edges("t", route, ["r", END])
    assert info.value.node == "t"
    assert "plain edge" in str(info.value)


def test_two_conditional_edges_on_one_node() -> None:
    g = base_graph()
    with pytest.raises(GraphValidationError) as info:
        g.add_conditional_edges("r", route, ["t", END])
    assert info.value.node == "r"


def test_two_plain_edges_from_one_node() -> None:
    g = ThoughtGraph()
    g.add_thought("t", prompt)
    g.add_reward("r", scorer)
    g.add_reward("r2", scorer)
    g.add_edge(START, "t")
    g.add_edge("t", "r")
    g.add_edge("t", "r2")
    g.add_edge("r", END)
    g.add_edge("r2", END)
    err = node_error(g)
    assert err.node == "t"
    assert "2 plain edges" in str(err)


def test_end_and_start_edge_rules() -> None:
    g = ThoughtGraph()
    with pytest.raises(GraphValidationError) as info:
        g.add_edge(END, "t")
    assert info.value.node == END
    with pytest.raises(GraphValidationError) as info:
        g.add_edge("t", START)
    assert info.value.node == START


# -- node definition errors ------------------------------------------------------------------
def test_duplicate_node_names() -> None:
    g = ThoughtGraph()
    g.add_thought("x", prompt)
    with pytest.raises(GraphValidationError) as info:
        g.add_function("x", ident)
    assert info.value.node == "x"
    assert "already exists" in str(info.value)
    assert g.nodes["x"].kind is NodeKind.THOUGHT  # the first one is kept


@pytest.mark.parametrize("name", [START, END])
def test_reserved_names(name: str) -> None:
    g = ThoughtGraph()
    with pytest.raises(GraphValidationError) as info:
        g.add_thought(name, prompt)
    assert info.value.node == name
    assert "reserved" in str(info.value)
    assert name not in g.nodes


def test_slash_in_name_rejected() -> None:
    with pytest.raises(GraphValidationError) as info:
        ThoughtGraph().add_function("a/b", ident)
    assert info.value.node == "a/b"


@pytest.mark.parametrize("name", ["", None, 3])
def test_empty_or_non_string_name(name: Any) -> None:
    with pytest.raises(ConfigError) as info:
        ThoughtGraph().add_function(name, ident)
    assert info.value.field == "name"


@pytest.mark.parametrize(
    ("add", "field"),
    [
        (lambda g: g.add_thought("n", "not callable"), "prompt"),
        (lambda g: g.add_reward("n", 42), "scorer"),
        (lambda g: g.add_tool("n", None), "fn"),
        (lambda g: g.add_function("n", "x"), "fn"),
        (lambda g: g.add_conditional_edges("n", "x"), "router"),
    ],
)
def test_non_callables_rejected(add: Any, field: str) -> None:
    with pytest.raises(GraphValidationError) as info:
        add(ThoughtGraph())
    assert info.value.node == "n"
    assert f"{field} must be callable" in str(info.value)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"top_k": 0}, "top_k"),
        ({"temprature": 0.5}, "temprature"),
    ],
)
def test_invalid_sampling_dict(sampling: dict[str, Any], field: str) -> None:
    g = ThoughtGraph()
    with pytest.raises(GraphValidationError) as info:
        g.add_thought("gen", prompt, sampling=sampling)
    assert info.value.node == "gen"
    assert field in str(info.value)
    assert "sampling" in str(info.value)
    assert "gen" not in g.nodes


# -- compile arguments -----------------------------------------------------------------------
def test_invalid_policy_params_at_compile_time() -> None:
    with pytest.raises(ConfigError) as info:
        compile_g(base_graph(), search="beam", search_params={"width": 0})
    assert info.value.field == "width"
    assert not isinstance(info.value, GraphValidationError)
    with pytest.raises(ConfigError) as info:
        compile_g(base_graph(), search="beam", search_params={"n": 2, "width": 4})
    assert info.value.field == "width"
    with pytest.raises(ConfigError) as info:
        compile_g(base_graph(), search="best_of_n", search_params={"n": 0})
    assert info.value.field == "n"


def test_unexpected_policy_param() -> None:
    """A ConfigError naming the parameter and the policy, at compile time."""
    with pytest.raises(ConfigError, match="nope: unknown parameter of policy 'beam'"):
        compile_g(base_graph(), search="beam", search_params={"nope": 1})


def test_unknown_policy_name_lists_names() -> None:
    with pytest.raises(UnknownNameError) as info:
        compile_g(base_graph(), search="beem")
    assert isinstance(info.value, ValueError)
    assert info.value.name == "beem"
    message = str(info.value)
    assert "'beem'" in message
    for name in POLICY_NAMES:
        assert name in message


def test_unknown_backend_name_lists_names() -> None:
    with pytest.raises(UnknownNameError) as info:
        base_graph().compile(backend="nonesuch")
    assert info.value.name == "nonesuch"
    assert info.value.kind == "backend"
    for name in ("scripted", "local", "sglang", "openai", "sim"):
        assert name in str(info.value)


def test_named_backend_created_lazily() -> None:
    app = base_graph().compile(backend="scripted", backend_options={"depth": 2})
    assert app._backend is None
    assert isinstance(app.backend, ScriptedBackend)
    assert app.backend.config.depth == 2
    assert app.backend is app.backend  # created once


def test_no_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        base_graph().compile()
    assert info.value.field == "backend"


def test_policy_instance_rejected_factory_accepted() -> None:
    from spec_tot.policies import create_policy

    with pytest.raises(ConfigError) as info:
        compile_g(base_graph(), search=create_policy("beam"))
    assert info.value.field == "search"
    app = compile_g(base_graph(), search=lambda: create_policy("beam", n=2, width=1))
    assert app.policy_factory() is not app.policy_factory()
    with pytest.raises(ConfigError) as info:
        compile_g(base_graph(), search=42)
    assert info.value.field == "search"


def test_unknown_executor_mode() -> None:
    with pytest.raises(UnknownNameError) as info:
        ExecutorConfig(mode="turbo")
    assert info.value.kind == "executor mode"
    assert info.value.name == "turbo"
    assert "baseline" in MODES
    for mode in MODES:  # the message lists every known mode
        assert mode in str(info.value)
    assert ExecutorConfig().mode == "baseline"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"query_timeout_s": 0.0}, "query_timeout_s"),
        ({"query_timeout_s": float("inf")}, "query_timeout_s"),
        ({"query_timeout_s": float("nan")}, "query_timeout_s"),
        ({"goodput_deadline_s": 0.0}, "goodput_deadline_s"),
        ({"max_nodes": 1}, "max_nodes"),
    ],
)
def test_executor_config_validation(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        ExecutorConfig(**kwargs)
    assert info.value.field == field


def test_toy_builder_options() -> None:
    g = build_toy_graph(temperature=0.0, max_tokens=7)
    sampling = g.nodes["propose"].sampling
    assert sampling is not None and sampling.greedy and sampling.max_tokens == 7
