"""LangGraph's Tree-of-Thought tutorial shape (expand -> score -> prune, one ``Send`` per kept
beam, conditional end), annotated for spec-tot, run twice: by LangGraph's own runtime and by
spec-tot's executor through ``spec_tot.from_langgraph``.

Both runtimes call the same backend with the same per-branch request ids and seeds, so in
baseline mode they answer the same; in full mode spec-tot speculates past the reward barrier.

    python examples/langgraph_tot.py
"""

from __future__ import annotations

import asyncio
import operator
import time
from dataclasses import replace
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

import spec_tot
from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.executor import request_seed  # the executor's per-request seed rule
from spec_tot.requests import GenerateRequest, RewardItem, SamplingParams

SAMPLING = SamplingParams(temperature=0.8, max_tokens=64, stop=("\n",))
ANSWER = "answer: "


class Beam(TypedDict):
    id: str  # spec-tot's node id: query id, then "/i" per level
    steps: list[str]
    seq: tuple[int, ...]  # creation order (round, rank of the parent, sample)
    score: float


def _merge(left: list[Beam], right: list[Beam] | str) -> list[Beam]:
    return [] if right == "clear" else [*left, *right]


class ToTState(TypedDict, total=False):
    question: str
    query_id: str
    beam: Beam  # the beam one Send expands (absent at the root)
    rank: int
    round: int
    candidates: Annotated[list[Beam], _merge]
    scored: Annotated[list[Beam], _merge]
    beams: list[Beam]
    finished: Annotated[list[Beam], operator.add]
    depth: Annotated[int, operator.add]


# -- what both runtimes share: branch-state callables --------------------------------------
def prompt(state: dict[str, Any]) -> str:
    return "\n".join([state["question"], *state["steps"]])


def is_answer(state: dict[str, Any]) -> bool:
    steps = state["steps"]
    return bool(steps) and str(steps[-1]).startswith(ANSWER)


def answer_of(state: dict[str, Any]) -> str | None:
    return str(state["steps"][-1])[len(ANSWER) :] if is_answer(state) else None


def build_state_graph(
    backend: ScriptedBackend, *, n: int = 8, width: int = 2, max_depth: int = 3, seed: int = 0
) -> StateGraph[Any, Any, Any, Any]:
    """The tutorial graph. ``n`` samples at the root, keep ``n // width`` beams a round, expand
    each with ``width`` samples; stop after ``n`` finished answers or when nothing is left."""
    keep = n // width

    async def expand(state: ToTState) -> dict[str, Any]:
        beam = state.get("beam") or Beam(id=state["query_id"], steps=[], seq=(), score=0.0)
        count = n if "beam" not in state else width
        branch = {"question": state["question"], "steps": beam["steps"]}

        async def sample(i: int) -> Beam:
            rid = f"{beam['id']}/{i}"
            request = GenerateRequest(
                rid,
                replace(SAMPLING, seed=request_seed(seed, state["query_id"], rid)),
                prompt=prompt(branch),
            )
            text = (await backend.generate(request)).completions[0].text.strip()
            order = (state.get("round", 0), state.get("rank", 0), i)
            return Beam(id=rid, steps=[*beam["steps"], text], seq=order, score=0.0)

        return {"candidates": list(await asyncio.gather(*(sample(i) for i in range(count))))}

    async def score(state: ToTState) -> dict[str, Any]:
        cands = sorted(state["candidates"], key=lambda c: c["seq"])
        items = [RewardItem(c["id"], state["question"], tuple(c["steps"])) for c in cands]
        scores = await backend.score(items)
        scored = [Beam(**{**c, "score": s[-1]}) for c, s in zip(cands, scores, strict=True)]
        return {"scored": scored, "candidates": "clear"}

    def prune(state: ToTState) -> dict[str, Any]:
        scored = sorted(state["scored"], key=lambda c: c["seq"])
        done = [c for c in scored if is_answer({"steps": c["steps"]})]
        completed = len(state.get("finished", [])) + len(done)
        live = [c for c in scored if c not in done and len(c["steps"]) < max_depth]
        ranked = sorted(live, key=lambda c: (-c["score"], c["seq"]))
        kept = ranked[:keep] if completed < n else []
        return {"beams": kept, "finished": done, "scored": "clear", "depth": 1}

    def should_continue(state: ToTState) -> Any:
        if not state["beams"]:
            return END
        nxt = state.get("depth", 0)
        return [
            Send("expand", {**_base(state), "beam": b, "rank": r, "round": nxt})
            for r, b in enumerate(state["beams"])
        ]

    builder = StateGraph(ToTState)
    thought = {"kind": "thought", "prompt": prompt, "sampling": SAMPLING}
    builder.add_node("expand", expand, metadata={"spec_tot": thought})
    builder.add_node("score", score, metadata={"spec_tot": {"kind": "reward"}})
    select = {"kind": "select", "terminal": is_answer, "answer": answer_of}
    builder.add_node("prune", prune, metadata={"spec_tot": select})
    builder.add_edge(START, "expand")
    builder.add_edge("expand", "score")
    builder.add_edge("score", "prune")
    builder.add_conditional_edges("prune", should_continue, ["expand", END])
    return builder


def _base(state: ToTState) -> dict[str, Any]:
    return {"question": state["question"], "query_id": state["query_id"]}


def langgraph_answer(final: dict[str, Any]) -> str | None:
    """The answer LangGraph's run gives: the best finished beam (ties to the first made)."""
    finished = sorted(final.get("finished", []), key=lambda c: (-c["score"], c["seq"]))
    return answer_of({"steps": finished[0]["steps"]}) if finished else None


async def run_langgraph(backend: ScriptedBackend, questions: list[str], **kw: Any) -> list[Any]:
    graph = build_state_graph(backend, **kw).compile()
    finals = await asyncio.gather(
        *(
            graph.ainvoke({"question": q, "query_id": f"p{i}"}, {"recursion_limit": 100})
            for i, q in enumerate(questions)
        )
    )
    return [langgraph_answer(f) for f in finals]


async def run_spec_tot(
    backend: ScriptedBackend,
    questions: list[str],
    mode: str,
    *,
    n: int = 8,
    width: int = 2,
    max_depth: int = 3,
) -> tuple[list[str | None], Any]:
    app = spec_tot.from_langgraph(
        build_state_graph(backend, n=n, width=width, max_depth=max_depth),
        backend=backend,
        search="beam",
        search_params={"n": n, "width": width, "max_depth": max_depth},
        config=spec_tot.ExecutorConfig(mode=mode),
    )
    inputs = [{"question": q, "query_id": f"p{i}"} for i, q in enumerate(questions)]
    batch = await app.arun_batch(inputs)
    return [r.answer for r in batch.results], batch.metrics


async def main() -> None:
    # Straggler-heavy: 30% of steps are 8x longer; answers at depth 5.
    slow = ScriptedConfig(token_latency_s=0.002, straggler_rate=0.3, p_correct=0.3, depth=5)
    shape = {"n": 4, "width": 2, "max_depth": 5}
    questions = [f"puzzle {i}" for i in range(8)]
    timings: dict[str, float] = {}
    answers: dict[str, list[str | None]] = {}
    for name in ("langgraph", "baseline", "full"):
        backend = ScriptedBackend(slow)
        started = time.perf_counter()
        if name == "langgraph":
            answers[name] = await run_langgraph(backend, questions, **shape)
        else:
            answers[name], _ = await run_spec_tot(backend, questions, name, **shape)
        timings[name] = time.perf_counter() - started
        print(f"{name:9s} {timings[name]:.2f}s answers={answers[name]}")
    assert answers["langgraph"] == answers["baseline"] == answers["full"]
    print(f"full vs spec-tot baseline: {timings['baseline'] / timings['full']:.2f}x faster")


if __name__ == "__main__":
    asyncio.run(main())
