"""A toy ToT program for the scripted backend: propose a step, score it, stop at an answer.

Used by tests, by ``spec-tot bench --backend scripted`` and as the smallest example of a
ThoughtGraph. Prompt: the question, then one step per line (the scripted backend's
convention).
"""

from __future__ import annotations

from typing import Any

from spec_tot.app import ToTApp
from spec_tot.graph import END, START, State, ThoughtGraph
from spec_tot.programs import Program
from spec_tot.requests import SamplingParams

__all__ = ["ANSWER_PREFIX", "PROGRAM", "build_toy_graph", "compile_toy", "toy_questions"]

ANSWER_PREFIX = "answer: "


def _prompt(state: State) -> str:
    return "\n".join([state["question"], *state["steps"]])


def _route(state: State) -> str:
    steps = state["steps"]
    return "done" if steps and steps[-1].startswith(ANSWER_PREFIX) else "more"


def _answer(state: State) -> str | None:
    steps = state["steps"]
    if steps and steps[-1].startswith(ANSWER_PREFIX):
        return str(steps[-1][len(ANSWER_PREFIX) :])
    return None


def _check(state: State, answer: str | None) -> bool:
    return answer is not None and answer == str(state.get("target", "24"))


def build_toy_graph(*, temperature: float = 0.8, max_tokens: int = 64) -> ThoughtGraph:
    graph = ThoughtGraph()
    graph.add_thought(
        "propose",
        _prompt,
        sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens, stop=("\n",)),
    )
    graph.add_reward("score")
    graph.add_edge(START, "propose")
    graph.add_edge("propose", "score")
    graph.add_conditional_edges("score", _route, {"more": "propose", "done": END})
    return graph


def compile_toy(**compile_args: Any) -> ToTApp:
    """The toy graph compiled; ``compile_args`` go to ``ThoughtGraph.compile``."""
    return build_toy_graph().compile(answer=_answer, check=_check, **compile_args)


def toy_questions(n: int) -> list[dict[str, Any]]:
    return [{"question": f"toy puzzle {i}", "target": "24"} for i in range(n)]


def _backend_options(backend: str) -> dict[str, Any]:
    return {}


PROGRAM = Program(
    name="toy",
    description="toy puzzles on the deterministic scripted backend",
    default_backend="scripted",
    default_search="beam",
    build=compile_toy,
    inputs=toy_questions,
    backend_options=_backend_options,
)
