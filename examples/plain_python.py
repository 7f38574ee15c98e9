"""The smallest spec-tot program in plain Python: a ThoughtGraph (propose -> score, loop until
an answer), compiled with beam search on the deterministic scripted backend, run in baseline
and full mode; prints the answers, the metrics and the tree as Mermaid.

    python examples/plain_python.py
"""

from __future__ import annotations

from spec_tot import END, START, ExecutorConfig, SamplingParams, ThoughtGraph
from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.viz import live_tree, tree_to_mermaid


def build() -> ThoughtGraph:
    graph = ThoughtGraph()
    graph.add_thought(
        "propose",
        lambda s: "\n".join([s["question"], *s["steps"]]),  # the scripted backend's convention
        sampling=SamplingParams(temperature=0.8, max_tokens=64, stop=("\n",)),
    )
    graph.add_reward("score")  # scored by the backend (the scripted one also scores)
    graph.add_edge(START, "propose")
    graph.add_edge("propose", "score")
    graph.add_conditional_edges(
        "score",
        lambda s: "done" if s["steps"][-1].startswith("answer: ") else "more",
        {"more": "propose", "done": END},
    )
    return graph


def main() -> None:
    from rich.console import Console

    slow = ScriptedConfig(token_latency_s=0.002, straggler_rate=0.3)
    questions = [f"puzzle {i}" for i in range(4)]
    for mode in ("baseline", "full"):
        app = build().compile(
            search="beam",
            search_params={"n": 4, "width": 2},
            backend=ScriptedBackend(slow),
            config=ExecutorConfig(mode=mode),
            answer=lambda s: s["steps"][-1].removeprefix("answer: "),
        )
        batch = app.run_batch(questions)
        m = batch.metrics
        print(
            f"{mode:8s} answers={[r.answer for r in batch.results]} wall={m.wall_s:.2f}s "
            f"wasted_tokens={m.wasted_tokens} spec_hit_rate={m.spec_hit_rate:.2f}"
        )
    print(tree_to_mermaid(batch.results[0]))
    Console().print(live_tree(batch.results[0]))


if __name__ == "__main__":
    main()
