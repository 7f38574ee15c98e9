"""LangGraph's LATS tutorial graph (Language Agent Tree Search), unmodified, run by spec-tot.

The graph has the tutorial's shape: ``start`` answers and reflects once, then ``expand``
selects a leaf by UCT, samples ``N`` candidates in one call (``generate(..., n=N)``), runs
their tool calls with a ``ToolNode``, reflects on each candidate (structured output) and
grows the tree in place; ``should_loop`` ends when a solution is found or the tree is deep.
Both nodes call tools and mutate the tree, so their metadata says ``tool``: spec-tot runs them
on the committed path only, as LangGraph does (the search tool below counts its calls and
checks that no speculative branch ever reaches it).

    python examples/langgraph_lats.py
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict, deque
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.output_parsers.openai_tools import JsonOutputToolsParser, PydanticToolsParser
from langchain_core.prompt_values import ChatPromptValue
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables import chain as as_runnable
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from spec_tot.adapters.scripted_chat import ScriptedChatModel, render, stable_unit
from spec_tot.branch_context import current_branch
from spec_tot.langgraph import from_langgraph


class Reflection(BaseModel):
    reflections: str = Field(description="Critique of the candidate response")
    score: int = Field(description="Score from 0 to 10", ge=0, le=10)
    found_solution: bool = Field(description="Whether the response solves the task")

    def as_message(self) -> HumanMessage:
        return HumanMessage(content=f"Reasoning: {self.reflections}\nScore: {self.score}")

    @property
    def normalized_score(self) -> float:
        return self.score / 10.0


class Node:
    """A search-tree node: the messages of one step, its reflection and UCT statistics."""

    def __init__(
        self, messages: list[BaseMessage], reflection: Reflection, parent: Node | None = None
    ) -> None:
        self.messages = messages
        self.parent = parent
        self.children: list[Node] = []
        self.value = 0.0
        self.visits = 0
        self.reflection = reflection
        self.depth = parent.depth + 1 if parent is not None else 1
        self._is_solved = reflection.found_solution
        if self._is_solved:
            self._mark_tree_as_solved()
        self.backpropagate(reflection.normalized_score)

    @property
    def is_solved(self) -> bool:
        return self._is_solved

    @property
    def is_terminal(self) -> bool:
        return not self.children

    @property
    def height(self) -> int:
        return 1 + max((c.height for c in self.children), default=0)

    def upper_confidence_bound(self, exploration_weight: float = 1.0) -> float:
        if self.parent is None:
            raise ValueError("the root has no UCT")
        if self.visits == 0:
            return self.value
        exploration = math.sqrt(math.log(self.parent.visits) / self.visits)
        return self.value / self.visits + exploration_weight * exploration

    def backpropagate(self, reward: float) -> None:
        node: Node | None = self
        while node is not None:
            node.visits += 1
            node.value = (node.value * (node.visits - 1) + reward) / node.visits
            node = node.parent

    def get_messages(self, include_reflections: bool = True) -> list[BaseMessage]:
        if include_reflections:
            return [*self.messages, self.reflection.as_message()]
        return list(self.messages)

    def get_trajectory(self, include_reflections: bool = True) -> list[BaseMessage]:
        messages: list[BaseMessage] = []
        node: Node | None = self
        while node is not None:
            messages.extend(node.get_messages(include_reflections)[::-1])
            node = node.parent
        return messages[::-1]

    def _all_children(self) -> list[Node]:
        out, queue = [], deque([self])
        while queue:
            node = queue.popleft()
            out.extend(node.children)
            queue.extend(node.children)
        return out

    def get_best_solution(self) -> Node:
        nodes = [self, *self._all_children()]
        return max(nodes, key=lambda n: int(n.is_terminal and n.is_solved) * n.value)

    def _mark_tree_as_solved(self) -> None:
        parent = self.parent
        while parent is not None:
            parent._is_solved = True
            parent = parent.parent


class TreeState(TypedDict):
    root: Node
    input: str


class SearchLog:
    """What the search tool did: its calls, and any call from a speculative branch."""

    def __init__(self) -> None:
        self.calls = 0
        self.speculative_calls = 0
        self._lock = threading.Lock()

    def record(self) -> None:
        branch = current_branch.get()
        with self._lock:
            self.calls += 1
            self.speculative_calls += bool(branch is not None and branch.speculative)


def build_lats_graph(llm: Any, log: SearchLog) -> StateGraph[Any, Any, Any, Any]:
    """The tutorial graph over ``llm``; the search tool reports to ``log``."""

    @tool
    def search(query: str) -> str:
        """Search the web for ``query``."""
        log.record()
        return f"results for {query!r}: {int(stable_unit(query) * 1000)}"

    tools = [search]
    tool_node = ToolNode(tools=tools)
    reflect_prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Reflect and grade the assistant response to the user question below."),
            ("user", "{input}"),
            MessagesPlaceholder(variable_name="candidate"),
        ]
    )
    reflection_llm_chain = (
        reflect_prompt
        | llm.bind_tools(tools=[Reflection], tool_choice="Reflection")
        | PydanticToolsParser(tools=[Reflection])
    )

    @as_runnable
    def reflection_chain(inputs: dict[str, Any]) -> Reflection:
        reflection: Reflection = reflection_llm_chain.invoke(inputs)[0]
        if not isinstance(inputs["candidate"][-1], AIMessage):
            reflection.found_solution = False
        return reflection

    prompt_template = ChatPromptTemplate.from_messages(
        [
            ("system", "You are an AI assistant."),
            ("user", "{input}"),
            MessagesPlaceholder(variable_name="messages", optional=True),
        ]
    )
    initial_answer_chain = prompt_template | llm.bind_tools(tools=tools)
    parser = JsonOutputToolsParser(return_id=True)

    def run_tools(parsed: list[dict[str, Any]]) -> list[BaseMessage]:
        calls = [{"name": r["type"], "args": r["args"], "id": r["id"]} for r in parsed]
        return [
            tool_node.invoke({"messages": [AIMessage(content="", tool_calls=[c])]})["messages"][0]
            for c in calls
        ]

    def generate_initial_response(state: TreeState) -> dict[str, Any]:
        res = initial_answer_chain.invoke({"input": state["input"]})
        output_messages = [res, *run_tools(parser.invoke(res))]
        reflection = reflection_chain.invoke(
            {"input": state["input"], "candidate": output_messages}
        )
        return {**state, "root": Node(output_messages, reflection=reflection)}

    def generate_candidates(messages: ChatPromptValue, config: RunnableConfig) -> list[Any]:
        n = config["configurable"].get("N", 5)
        bound_kwargs = llm.bind_tools(tools=tools).kwargs
        result = llm.generate(
            [messages.to_messages()],
            n=n,
            callbacks=config["callbacks"],
            run_name="GenerateCandidates",
            **bound_kwargs,
        )
        return [gen.message for gen in result.generations[0]]

    expansion_chain = prompt_template | generate_candidates

    def select(root: Node) -> Node:
        node = root
        while node.children:
            node = max(node.children, key=lambda child: child.upper_confidence_bound())
        return node

    def expand(state: TreeState, config: RunnableConfig) -> TreeState:
        root = state["root"]
        best_candidate = select(root)
        messages = best_candidate.get_trajectory()
        new_candidates = expansion_chain.invoke(
            {"input": state["input"], "messages": messages}, config
        )
        parsed = parser.batch(new_candidates)
        responses: dict[int, list[BaseMessage]] = defaultdict(list)
        for i, tool_calls in enumerate(parsed):
            responses[i].extend(run_tools(tool_calls))
        output_messages = [[c, *responses[i]] for i, c in enumerate(new_candidates)]
        reflections = reflection_chain.batch(
            [{"input": state["input"], "candidate": m} for m in output_messages], config
        )
        children = [
            Node(m, parent=best_candidate, reflection=r)
            for m, r in zip(output_messages, reflections, strict=True)
        ]
        best_candidate.children.extend(children)
        return state

    def should_loop(state: TreeState) -> str:
        root = state["root"]
        if root.is_solved or root.height > 5:
            return END
        return "expand"

    builder = StateGraph(TreeState)
    # Both nodes call tools and grow the tree in place: committed paths only.
    builder.add_node("start", generate_initial_response, metadata={"spec_tot": {"kind": "tool"}})
    builder.add_node("expand", expand, metadata={"spec_tot": {"kind": "tool"}})
    builder.add_edge(START, "start")
    builder.add_conditional_edges("start", should_loop, ["expand", END])
    builder.add_conditional_edges("expand", should_loop, ["expand", END])
    return builder


# -- a stand-in for the LLM ------------------------------------------------------------------
def lats_respond(messages: list[BaseMessage], tools: list[dict[str, Any]], index: int) -> Any:
    """Candidates (a search call or a draft answer) and reflections, as functions of the
    conversation."""
    text = render(messages)
    u = stable_unit(text, index)
    call_id = f"call_{int(stable_unit(text, index, 'id') * 1e9)}"
    if any(t["name"] == "Reflection" for t in tools):
        score = min(10, int(u * 11))
        args = {"reflections": f"critique {int(u * 100)}", "score": score}
        args["found_solution"] = score >= 10
        return AIMessage(
            content="", tool_calls=[{"name": "Reflection", "args": args, "id": call_id}]
        )
    if u < 0.4:
        query = f"facts {int(stable_unit(text, index, 'q') * 100)}"
        return AIMessage(
            content="", tool_calls=[{"name": "search", "args": {"query": query}, "id": call_id}]
        )
    return f"draft answer {int(u * 10_000)}"


def lats_model(*, min_latency_s: float = 0.01, max_latency_s: float = 0.2, seed: int = 0) -> Any:
    return ScriptedChatModel(
        respond=lats_respond, min_latency_s=min_latency_s, max_latency_s=max_latency_s, seed=seed
    )


def best_answer(state: dict[str, Any]) -> str:
    node = state["root"].get_best_solution()
    return str(node.get_trajectory(include_reflections=False)[-1].content)


def main(min_latency_s: float = 0.01, max_latency_s: float = 0.2) -> None:
    question = "Write a short report on lithium pollution."
    for name in ("langgraph", "spec-tot"):
        log = SearchLog()
        model = lats_model(min_latency_s=min_latency_s, max_latency_s=max_latency_s)
        graph = build_lats_graph(model, log)
        runner = graph.compile() if name == "langgraph" else from_langgraph(graph)
        final = runner.invoke({"input": question})
        print(f"{name:10s} height={final['root'].height} answer={best_answer(final)!r}")
        print(f"{'':10s} search calls={log.calls} (speculative: {log.speculative_calls})")


if __name__ == "__main__":
    main()
