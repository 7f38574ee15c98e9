"""A side-effecting LangChain tool inside a ToT program: every step is "sent" by a tool (a
stand-in for an e-mail, a payment, a database write). spec-tot runs it only on committed
branches, so speculation never sends anything a baseline run would not: the call log printed
below holds only committed nodes, in every mode.

    python examples/tool_agent.py
"""

from __future__ import annotations

from langchain_core.tools import tool

from spec_tot import END, START, ExecutorConfig, ThoughtGraph
from spec_tot.adapters.langchain import add_tool
from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig

SENT: list[str] = []


@tool
def send(message: str) -> str:
    """Send a message (a side effect that must never happen speculatively)."""
    SENT.append(message)
    return f"sent #{len(SENT)}"


def build() -> ThoughtGraph:
    graph = ThoughtGraph()
    graph.add_thought("propose", lambda s: "\n".join([s["question"], *s["steps"]]))
    # Non-speculable (the default): a speculative branch waits here until it is adopted.
    add_tool(graph, "send", send, args=lambda s: {"message": s["steps"][-1]}, result_key="receipt")
    graph.add_reward("score")
    graph.add_edge(START, "propose")
    graph.add_edge("propose", "send")
    graph.add_edge("send", "score")
    graph.add_conditional_edges(
        "score",
        lambda s: "done" if s["steps"][-1].startswith("answer: ") else "more",
        {"more": "propose", "done": END},
    )
    return graph


def main() -> None:
    for mode in ("baseline", "full"):
        SENT.clear()
        app = build().compile(
            search="beam",
            search_params={"n": 4, "width": 2},
            backend=ScriptedBackend(ScriptedConfig(token_latency_s=0.001, straggler_rate=0.4)),
            config=ExecutorConfig(mode=mode),
            answer=lambda s: s["steps"][-1].removeprefix("answer: "),
        )
        result = app.invoke("toy puzzle 0")
        committed = {n.text for n in result.tree.nodes() if n.parent and not n.speculative}
        speculative = sum(1 for n in result.tree.nodes() if n.speculative)
        print(
            f"{mode}: answer={result.answer!r}, {len(SENT)} tool calls, "
            f"{speculative} never-adopted speculative nodes"
        )
        for i, message in enumerate(SENT, 1):
            print(f"  call {i:2d}: send({message!r})")
        assert set(SENT) <= committed, "a tool ran on a speculative branch"


if __name__ == "__main__":
    main()
