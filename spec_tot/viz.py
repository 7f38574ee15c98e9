"""The search tree as text diagrams (Mermaid, Graphviz DOT) and as a ``rich`` tree.

Each node gets one style: ``answer`` (the chosen answer node, or every finished trace when
none is named), ``cancelled``, ``pruned``, ``speculative`` (not adopted) or ``committed``.
``LiveTree`` rebuilds the tree from ``ToTEvent``s while a run is in progress (it is an
``on_event`` sink), for ``spec-tot run --show-tree``::

    view = LiveTree()
    with rich.live.Live(view.render(), refresh_per_second=8) as live:
        def on_event(event):
            view(event)
            live.update(view.render())
        app.run_batch(inputs, on_event=on_event)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from spec_tot.events import ToTEvent
from spec_tot.tree import Node, NodeStatus, SearchTree

if TYPE_CHECKING:
    from rich.tree import Tree

    from spec_tot.app import ToTResult

__all__ = [
    "STYLES",
    "LiveTree",
    "NodeStyle",
    "answer_node_id",
    "live_tree",
    "node_style",
    "tree_to_dot",
    "tree_to_mermaid",
]

NodeStyle = Literal["committed", "speculative", "pruned", "cancelled", "answer"]

# style -> (fill, stroke, dashed, rich style)
STYLES: dict[NodeStyle, tuple[str, str, bool, str]] = {
    "committed": ("#dbeafe", "#1d4ed8", False, "blue"),
    "speculative": ("#fef3c7", "#b45309", True, "yellow"),
    "pruned": ("#e5e7eb", "#6b7280", False, "dim"),
    "cancelled": ("#fee2e2", "#b91c1c", True, "red strike"),
    "answer": ("#dcfce7", "#15803d", False, "bold green"),
}


def answer_node_id(result: ToTResult) -> str | None:
    """The node a result's answer came from (best-scored terminal with that answer)."""
    finals = [n for n in result.tree.terminals() if n.answer == result.answer]
    finals.sort(key=lambda n: (-(n.reward if n.reward is not None else float("-inf")), n.key))
    return finals[0].id if finals else None


def _resolve(tree: SearchTree | ToTResult, answer_id: str | None) -> tuple[SearchTree, str | None]:
    if isinstance(tree, SearchTree):
        return tree, answer_id
    return tree.tree, answer_id or answer_node_id(tree)


def node_style(node: Node, answer_id: str | None = None) -> NodeStyle:
    if node.status is NodeStatus.CANCELLED:
        return "cancelled"
    if node.status is NodeStatus.PRUNED:
        return "pruned"
    if node.speculative:
        return "speculative"
    is_final = node.terminal and node.status is NodeStatus.SCORED
    if node.id == answer_id or (answer_id is None and is_final):
        return "answer"
    return "committed"


def _label(node: Node, width: int) -> str:
    if node.parent is None:
        return "root"
    text = node.text.strip().replace("\n", " ")
    text = text if len(text) <= width else text[: width - 1] + "…"
    score = f" [{node.reward:.2f}]" if node.reward is not None else ""
    return f"{text}{score}"


def _ids(tree: SearchTree) -> dict[str, str]:
    return {n.id: f"n{i}" for i, n in enumerate(tree.nodes())}


def tree_to_mermaid(
    tree: SearchTree | ToTResult, *, answer_id: str | None = None, width: int = 40
) -> str:
    """A Mermaid flowchart of the tree; one ``classDef`` per style."""
    tree, answer_id = _resolve(tree, answer_id)
    ids = _ids(tree)
    lines = ["flowchart TD"]
    for node in tree.nodes():
        label = _label(node, width).replace('"', "#quot;")
        lines.append(f'    {ids[node.id]}["{label}"]:::{node_style(node, answer_id)}')
        if node.parent is not None:
            lines.append(f"    {ids[node.parent.id]} --> {ids[node.id]}")
    for name, (fill, stroke, dashed, _) in STYLES.items():
        dash = ",stroke-dasharray:4 3" if dashed else ""
        lines.append(f"    classDef {name} fill:{fill},stroke:{stroke}{dash}")
    return "\n".join(lines) + "\n"


def tree_to_dot(
    tree: SearchTree | ToTResult, *, answer_id: str | None = None, width: int = 40
) -> str:
    """A Graphviz DOT digraph of the tree, styled by node status."""
    tree, answer_id = _resolve(tree, answer_id)
    ids = _ids(tree)
    lines = [
        "digraph tot {",
        "    rankdir=TB;",
        '    node [shape=box, style="rounded,filled", fontname="Helvetica"];',
    ]
    for node in tree.nodes():
        style = node_style(node, answer_id)
        fill, stroke, dashed, _ = STYLES[style]
        label = _label(node, width).replace("\\", "\\\\").replace('"', '\\"')
        shape = ',style="rounded,filled,dashed"' if dashed else ""
        lines.append(
            f'    {ids[node.id]} [label="{label}", fillcolor="{fill}", color="{stroke}", '
            f'class="{style}"{shape}];'
        )
        if node.parent is not None:
            lines.append(f"    {ids[node.parent.id]} -> {ids[node.id]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def live_tree(
    tree: SearchTree | ToTResult, *, answer_id: str | None = None, width: int = 40
) -> Tree:
    """A ``rich.tree.Tree`` of the search tree (print it, or show it in ``rich.live.Live``)."""
    from rich.tree import Tree

    tree, answer_id = _resolve(tree, answer_id)
    top = Tree(f"[bold]{tree.question}[/bold] ({tree.query_id})")
    stack: list[tuple[Node, Tree]] = [(c, top) for c in reversed(tree.root.children)]
    while stack:
        node, parent = stack.pop()
        style = node_style(node, answer_id)
        branch = parent.add(f"{_label(node, width)} ({style})", style=STYLES[style][3])
        stack.extend((c, branch) for c in reversed(node.children))
    return top


@dataclass
class _Seen:
    parent: str | None
    label: str = "…"
    style: NodeStyle = "committed"
    children: list[str] = field(default_factory=list)


class LiveTree:
    """An ``on_event`` sink that keeps every query's tree as events arrive."""

    def __init__(self, width: int = 40) -> None:
        self.width = width
        self.nodes: dict[str, _Seen] = {}
        self.roots: dict[str, list[str]] = {}

    def __call__(self, event: ToTEvent) -> None:
        nid, data = event.node_id, event.data
        if event.kind == "expanded" and nid is not None:
            parent = str(data.get("parent", ""))
            style: NodeStyle = "speculative" if event.speculative else "committed"
            self.nodes[nid] = _Seen(parent, style=style)
            if parent in self.nodes:
                self.nodes[parent].children.append(nid)
            else:
                self.roots.setdefault(event.query_id, []).append(nid)
            return
        seen = self.nodes.get(nid or "")
        if seen is None:
            return
        if event.kind == "scored":
            text = str(data.get("text", "")).strip().replace("\n", " ")[: self.width]
            reward = data.get("reward")
            seen.label = f"{text} [{reward:.2f}]" if isinstance(reward, float) else text
        elif event.kind == "speculative_hit":
            seen.style = "committed"
        elif event.kind in ("pruned", "cancelled", "answer"):
            seen.style = event.kind

    def render(self) -> Tree:
        from rich.tree import Tree

        top = Tree("[bold]spec-tot[/bold]")
        for query_id, roots in self.roots.items():
            branch = top.add(f"[bold]{query_id}[/bold]")
            stack = [(nid, branch) for nid in reversed(roots)]
            while stack:
                nid, parent = stack.pop()
                seen = self.nodes[nid]
                sub = parent.add(f"{seen.label} ({seen.style})", style=STYLES[seen.style][3])
                stack.extend((c, sub) for c in reversed(seen.children))
        return top
