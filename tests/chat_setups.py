"""The chat models under test, on the scripted backend and on the embedded engine (the
shipped Game-of-24 policy and PRM, loaded once per test session)."""

from __future__ import annotations

from typing import Any

import pytest

from spec_tot import END, START, SamplingParams, ThoughtGraph
from spec_tot.adapters.scripted import ScriptedBackend
from spec_tot.app import ToTApp
from spec_tot.graphs.toy import compile_toy

ENGINE: dict[str, Any] = {}  # filled by the session fixture ``engine``


def toy_app(backend: Any = None, **config: Any) -> ToTApp:
    return compile_toy(
        backend=backend or ScriptedBackend(),
        search="beam",
        search_params={"n": 4, "width": 2},
        **config,
    )


def free_text_app(backend: Any) -> ToTApp:
    """A small beam search over any question: two steps of at most 12 tokens, scored by the
    backend's PRM; the answer is the best trace."""
    graph = ThoughtGraph()
    graph.add_thought(
        "propose",
        lambda s: "\n".join([s["question"], *s["steps"]]) + "\n",
        sampling=SamplingParams(temperature=0.8, max_tokens=12, stop=("\n",)),
    )
    graph.add_reward("prm")
    graph.add_edge(START, "propose")
    graph.add_edge("propose", "prm")
    graph.add_conditional_edges(
        "prm", lambda s: "end" if len(s["steps"]) >= 2 else "next", {"next": "propose", "end": END}
    )
    return graph.compile(
        search="beam",
        search_params={"n": 2, "width": 2, "max_depth": 2},
        backend=backend,
        answer=lambda s: "\n".join(s["steps"]) or None,
    )


def engine_backend() -> Any:
    if "backend" not in ENGINE:
        pytest.skip(ENGINE.get("why", "the embedded engine fixture did not run"))
    return ENGINE["backend"]


@pytest.fixture(scope="session")
def engine() -> Any:
    """One embedded engine for the session (loading and calibrating it takes seconds)."""
    from spec_tot.adapters.local import create_local
    from spec_tot.graphs import game24, game24_task

    missing = [
        k for k in ("policy", "prm") if not (game24_task.asset_dir(k) / "config.json").exists()
    ]
    if missing:
        ENGINE["why"] = f"Game-of-24 models not in graphs/assets/game24/{missing}"
        yield None
        return
    # saturation_batch given: skip the start-up measurement (the PRM knee is still measured)
    backend = create_local(**game24.PROGRAM.backend_options("local"), saturation_batch=4)
    ENGINE["backend"] = backend
    yield backend
    import asyncio

    asyncio.run(backend.aclose())
    ENGINE.clear()
