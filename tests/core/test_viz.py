"""Search-tree rendering: Mermaid, DOT, rich, and the live tree built from events."""

from __future__ import annotations

from rich.console import Console

from spec_tot.adapters.scripted import ScriptedBackend, ScriptedConfig
from spec_tot.config import ExecutorConfig
from spec_tot.events import ToTEvent
from spec_tot.graphs.toy import compile_toy
from spec_tot.tree import NodeStatus
from spec_tot.viz import LiveTree, answer_node_id, live_tree, tree_to_dot, tree_to_mermaid


def _run(mode: str = "full") -> tuple[object, list[ToTEvent]]:
    backend = ScriptedBackend(ScriptedConfig(token_latency_s=0.001, straggler_rate=0.3))
    app = compile_toy(
        backend=backend,
        search="beam",
        search_params={"n": 4, "width": 2},
        config=ExecutorConfig(mode=mode),
    )
    events: list[ToTEvent] = []
    batch = app.run_batch(["toy puzzle 0"], on_event=events.append)
    return batch.results[0], events


def test_mermaid_and_dot_style_every_status() -> None:
    result, _ = _run()
    tree = result.tree  # type: ignore[attr-defined]
    node = next(n for n in tree.nodes() if n.parent is not None)
    node.status, node.text = NodeStatus.PRUNED, 'say "hi"'
    mermaid = tree_to_mermaid(result)  # type: ignore[arg-type]
    assert mermaid.startswith("flowchart TD")
    assert mermaid.count("-->") == len(tree) - 1
    assert ":::answer" in mermaid and ":::pruned" in mermaid and "#quot;hi#quot;" in mermaid
    for name in ("committed", "speculative", "pruned", "cancelled", "answer"):
        assert f"classDef {name} " in mermaid
    dot = tree_to_dot(result)  # type: ignore[arg-type]
    assert dot.startswith("digraph tot {") and dot.rstrip().endswith("}")
    assert dot.count("->") == len(tree) - 1 and '\\"hi\\"' in dot
    assert 'class="answer"' in dot and 'class="pruned"' in dot
    answer = answer_node_id(result)  # type: ignore[arg-type]
    assert answer is not None and tree[answer].answer == result.answer  # type: ignore[attr-defined]
    assert tree_to_mermaid(tree).count(":::answer") == len(tree.terminals())


def test_rich_tree_and_live_tree_from_events() -> None:
    result, events = _run()
    console = Console(record=True, width=120)
    console.print(live_tree(result))  # type: ignore[arg-type]
    text = console.export_text()
    assert "toy puzzle 0" in text and "(answer)" in text
    view = LiveTree()
    for event in events:
        view(event)
    tree = result.tree  # type: ignore[attr-defined]
    assert set(view.nodes) == {n.id for n in tree.nodes() if n.parent is not None}
    console.print(view.render())
    assert "q0" in console.export_text()
    cancelled = {e.node_id for e in events if e.kind == "cancelled"}
    assert all(view.nodes[c].style == "cancelled" for c in cancelled if c in view.nodes)
