"""Mermaid rendering of a compiled ThoughtGraph."""

from __future__ import annotations

from spec_tot._private.compiled import CompiledGraph
from spec_tot.graph_nodes import END, START, NodeKind

__all__ = ["graph_to_mermaid"]

_SHAPES = {
    NodeKind.THOUGHT: ('["', '"]'),
    NodeKind.REWARD: ('{{"', '"}}'),
    NodeKind.TOOL: ('[["', '"]]'),
    NodeKind.FUNCTION: ('("', '")'),
}


def _ident(name: str) -> str:
    return {START: "__start__", END: "__end__"}.get(
        name, "n_" + "".join(c if c.isalnum() else "_" for c in name)
    )


def graph_to_mermaid(graph: CompiledGraph) -> str:
    lines = ["flowchart TD", f"    {_ident(START)}([START])", f"    {_ident(END)}([END])"]
    for name, node in graph.nodes.items():
        left, right = _SHAPES[node.kind]
        label = f"{name}<br/><i>{node.kind.value}</i>"
        if node.kind is NodeKind.TOOL and not node.speculable:
            label += " (committed only)"
        lines.append(f"    {_ident(name)}{left}{label}{right}")
    for source, target in graph.edges.items():
        lines.append(f"    {_ident(source)} --> {_ident(target)}")
    for source, branch in graph.branches.items():
        if branch.path_map is None:
            for name in [*graph.nodes, END]:
                lines.append(f"    {_ident(source)} -.-> {_ident(name)}")
            continue
        for key, target in branch.path_map.items():
            lines.append(f"    {_ident(source)} -. {key} .-> {_ident(target)}")
    return "\n".join(lines) + "\n"
