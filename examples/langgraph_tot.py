"""LangGraph's Tree-of-Thoughts tutorial graph, unmodified, run speculatively by spec-tot.

The graph has the tutorial's shape: ``expand`` asks a chat model (structured output) for
``k`` equation guesses from the seed candidate, ``score`` checks them, ``prune`` keeps the
best ``beam_size`` of the pool (parents stay in it), and ``should_terminate`` either ends
(a candidate reached ``threshold``, or ``max_depth``) or ``Send``s one ``expand`` per kept
beam. The only addition is node metadata telling spec-tot what may run ahead: ``expand``
and ``score`` are pure, ``prune`` is a top-k select.

The chat model here is ``ScriptedChatModel`` (its guesses are a function of the prompt,
with 10-200 ms of latency); put ``ChatOpenAI(...)`` or ``ChatSpecTot(backend=...)`` there
instead.

    python examples/langgraph_tot.py
"""

from __future__ import annotations

import ast
import asyncio
import operator
import re
import time
from typing import Annotated, Any, Literal, NamedTuple

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.prompts import ChatPromptTemplate
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import Send
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from spec_tot.adapters.scripted_chat import ScriptedChatModel, render, stable_unit
from spec_tot.langgraph import arun, from_langgraph

Op = Literal["+", "-", "*", "/"]
OPS: dict[str, Any] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
}


class Equation(BaseModel):
    """An equation in reverse-polish notation over the puzzle's numbers."""

    tokens: list[float | Op] = Field(description="RPN tokens, e.g. [3, 4, '+', 2, '*']")

    def compute(self) -> float:
        stack: list[float] = []
        for token in self.tokens:
            if isinstance(token, float):
                stack.append(token)
            else:
                right, left = stack.pop(), stack.pop()
                stack.append(OPS[token](left, right))
        return stack[0]


class GuessEquations(BaseModel):
    """Several equations submitted as guesses."""

    reasoning: str = Field(description="How the guesses were found")
    equations: list[Equation] = Field(description="The guesses")


class Candidate(NamedTuple):
    candidate: Equation
    score: float | None = None
    feedback: str | None = None

    def __str__(self) -> str:
        try:
            value: Any = self.candidate.compute()
        except Exception as exc:
            value = f"invalid: {exc!r}"
        return f"Equation({self.candidate.tokens}) = {value} (Reward: {self.score})"


def compute_score(problem: str, candidate: Candidate) -> Candidate:
    numbers = sorted(float(x) for x in problem.split())
    used = sorted(t for t in candidate.candidate.tokens if isinstance(t, float))
    if used != numbers:
        return Candidate(candidate.candidate, 0.0, "use each number exactly once")
    try:
        result = candidate.candidate.compute()
    except Exception as exc:
        return Candidate(candidate.candidate, 0.0, f"invalid equation: {exc!r}")
    return Candidate(candidate.candidate, 1 / (1 + abs(24 - result)), f"result: {result}")


def _merge(existing: list[Any] | None = None, update: list[Any] | str | None = None) -> list[Any]:
    if update == "clear":
        return []
    return [*(existing or []), *(update or [])]


class ToTState(TypedDict):
    problem: str
    candidates: Annotated[list[Candidate], _merge]
    scored_candidates: Annotated[list[Candidate], _merge]
    depth: Annotated[int, operator.add]


class Context(TypedDict, total=False):
    max_depth: int
    threshold: float
    k: int
    beam_size: int


def settings(ctx: Context | None) -> dict[str, Any]:
    ctx = ctx or {}
    return {
        "max_depth": ctx.get("max_depth", 10),
        "threshold": ctx.get("threshold", 0.9),
        "k": ctx.get("k", 5),
        "beam_size": ctx.get("beam_size", 3),
    }


class ExpansionState(ToTState, total=False):
    seed: Candidate | None


PROMPT = ChatPromptTemplate.from_messages(
    [
        (
            "system",
            "You are playing the Game of 24. Using the provided numbers, create an equation "
            "that evaluates to 24.\nSubmit exactly {k} guesses for this round.",
        ),
        ("user", "Solve the 24 game for these numbers: {problem}.{candidate}"),
    ]
).partial(candidate="")


def build_tot_graph(llm: BaseChatModel, *, sync: bool = True) -> StateGraph[Any, Any, Any, Any]:
    """The tutorial graph over ``llm``, with spec-tot metadata on its nodes. ``sync``: its
    node functions are sync, as the tutorial writes them (``solver.invoke``); else
    ``expand`` is an async function (``await solver.ainvoke``)."""
    solver = PROMPT | llm.with_structured_output(GuessEquations)

    def inputs(state: ExpansionState, runtime: Runtime[Context]) -> dict[str, Any]:
        seed = state.get("seed")
        candidate = "" if not seed else "\n\n" + str(seed)
        return {
            "problem": state["problem"],
            "candidate": candidate,
            "k": settings(runtime.context)["k"],
        }

    def expand_sync(state: ExpansionState, *, runtime: Runtime[Context]) -> dict[str, Any]:
        try:
            guesses: Any = solver.invoke(inputs(state, runtime))
        except Exception:
            return {"candidates": []}
        return {"candidates": [Candidate(candidate=e) for e in guesses.equations]}

    async def expand_async(state: ExpansionState, *, runtime: Runtime[Context]) -> dict[str, Any]:
        try:
            guesses: Any = await solver.ainvoke(inputs(state, runtime))
        except Exception:
            return {"candidates": []}
        return {"candidates": [Candidate(candidate=e) for e in guesses.equations]}

    expand = expand_sync if sync else expand_async

    def score(state: ToTState) -> dict[str, Any]:
        scored = [compute_score(state["problem"], c) for c in state["candidates"]]
        return {"scored_candidates": scored, "candidates": "clear"}

    def prune(state: ToTState, *, runtime: Runtime[Context]) -> dict[str, Any]:
        beam = settings(runtime.context)["beam_size"]
        ranked = sorted(state["scored_candidates"], key=lambda c: c[1], reverse=True)
        return {"candidates": ranked[:beam], "scored_candidates": "clear", "depth": 1}

    def should_terminate(state: ToTState, runtime: Runtime[Context]) -> Any:
        ctx = settings(runtime.context)
        solved = state["candidates"][0].score >= ctx["threshold"]
        if solved or state["depth"] >= ctx["max_depth"]:
            return END
        return [Send("expand", {**state, "seed": c}) for c in state["candidates"]]

    builder = StateGraph(ToTState, context_schema=Context)
    # The only change to the tutorial: what may run ahead of the superstep barrier.
    builder.add_node(
        "expand", expand, metadata={"spec_tot": {"kind": "thought", "reads": ["problem", "seed"]}}
    )
    builder.add_node("score", score, metadata={"spec_tot": {"kind": "reward"}})
    builder.add_node("prune", prune, metadata={"spec_tot": {"kind": "select", "top_k": True}})
    builder.add_edge(START, "expand")
    builder.add_edge("expand", "score")
    builder.add_edge("score", "prune")
    builder.add_conditional_edges("prune", should_terminate, path_map=["expand", END])
    return builder


# -- a stand-in for the LLM: guesses as a function of the prompt --------------------------------
_SEED_RE = re.compile(r"Equation\((\[.*?\])\)")


def _random_rpn(numbers: list[float], u: float, v: float) -> list[Any]:
    order = sorted(numbers, key=lambda x: stable_unit(u, x, numbers.index(x)))
    ops = [list(OPS)[int(stable_unit(v, i) * 4)] for i in range(3)]
    if stable_unit(u, v) < 0.5:  # ((a b op) c op) d op
        return [order[0], order[1], ops[0], order[2], ops[1], order[3], ops[2]]
    return [order[0], order[1], ops[0], order[2], order[3], ops[1], ops[2]]  # (a b op) (c d op) op


def _mutate(tokens: list[Any], u: float) -> list[Any]:
    out = list(tokens)
    ops = [i for i, t in enumerate(out) if isinstance(t, str)]
    nums = [i for i, t in enumerate(out) if not isinstance(t, str)]
    if u < 0.6 and ops:  # change one operator
        i = ops[int(u / 0.6 * len(ops))]
        out[i] = list(OPS)[(list(OPS).index(out[i]) + 1 + int(u * 7) % 3) % 4]
    elif len(nums) > 1:  # swap two numbers
        a, b = nums[int(u * 10) % len(nums)], nums[int(u * 100) % len(nums)]
        out[a], out[b] = out[b], out[a]
    return out


def guess_equations(messages: list[BaseMessage], tools: list[dict[str, Any]], index: int) -> Any:
    """Replies as a model bound to ``GuessEquations`` would: k guesses, derived from the
    prompt (the puzzle and the seed candidate) and nothing else."""
    text = render(messages)
    k = int(re.search(r"exactly (\d+) guesses", text).group(1))  # type: ignore[union-attr]
    problem = re.search(r"these numbers: ([\d ]+)\.", text).group(1)  # type: ignore[union-attr]
    numbers = [float(x) for x in problem.split()]
    seed = _SEED_RE.search(text)
    equations = []
    for i in range(k):
        u, v = stable_unit(text, i, "u"), stable_unit(text, i, "v")
        if seed is not None and u < 0.75:
            tokens = _mutate(ast.literal_eval(seed.group(1)), stable_unit(text, i, "m"))
        else:
            tokens = _random_rpn(numbers, u, v)
        equations.append({"tokens": tokens})
    args = {"reasoning": f"{k} guesses", "equations": equations}
    call_id = f"call_{int(stable_unit(text, index) * 1e9)}"
    call = {"name": "GuessEquations", "args": args, "id": call_id}
    return AIMessage(content="", tool_calls=[call])


def tot_model(*, min_latency_s: float = 0.01, max_latency_s: float = 0.2, seed: int = 0) -> Any:
    return ScriptedChatModel(
        respond=guess_equations, min_latency_s=min_latency_s, max_latency_s=max_latency_s, seed=seed
    )


PUZZLES = ["1 1 4 6", "1 1 11 11", "1 2 3 4", "2 3 5 12", "3 3 8 8", "1 5 5 5", "4 4 10 10"]


def best(state: dict[str, Any]) -> str:
    top = state["candidates"][0]
    return f"{top.candidate.tokens} score={top.score:.3f} depth={state['depth']}"


async def main(min_latency_s: float = 0.01, max_latency_s: float = 0.2) -> None:
    context: Context = {"max_depth": 6, "k": 5, "beam_size": 3}
    llm = tot_model(min_latency_s=min_latency_s, max_latency_s=max_latency_s)
    graph = build_tot_graph(llm)
    for name, runner in (("langgraph", graph.compile()), ("spec-tot", from_langgraph(graph))):
        started = time.perf_counter()
        finals = await asyncio.gather(
            *(runner.ainvoke({"problem": p}, context=context) for p in PUZZLES)
        )
        wall = time.perf_counter() - started
        print(f"{name:10s} {wall:.2f}s")
        for puzzle, final in zip(PUZZLES, finals, strict=True):
            print(f"  {puzzle:12s} {best(final)}")
    app = from_langgraph(graph)
    result = await arun(app, {"problem": PUZZLES[0]}, context=context)
    m = result.metrics
    print(
        f"one run: {m.steps} supersteps, {m.committed} committed tasks, {m.speculative} "
        f"speculative ({m.adopted} adopted, {m.cancelled} cancelled, {m.unused} unused)"
    )


if __name__ == "__main__":
    asyncio.run(main())
