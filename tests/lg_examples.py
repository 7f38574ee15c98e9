"""The example graphs (examples/ is not a package): LangGraph's ToT and LATS tutorial shapes,
loaded once for the tests and the benchmark."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"examples/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def eager(app: Any) -> Any:
    """``app`` (from ``from_langgraph``) with its speculation gates held open: the tests that
    use it check what speculation does, and a loaded test machine (event-loop lag, a busy
    process) must not switch it off under them."""
    from spec_tot.langgraph import speculation_of

    slots = speculation_of(app).slots
    slots.max_lag_s = 1.0
    slots.max_cpu_share = float("inf")
    return app


tot = load("langgraph_tot")
lats = load("langgraph_lats")


def puzzles(n: int, seed: int = 7) -> list[str]:
    """``n`` Game-of-24 style inputs (four numbers from 1 to 13)."""
    rng = random.Random(seed)
    return [" ".join(str(rng.randint(1, 13)) for _ in range(4)) for _ in range(n)]


def tot_answer(state: dict[str, Any]) -> tuple[Any, ...]:
    """What a ToT run answers: the kept candidates (tokens, score, feedback) and depth."""
    kept = tuple((tuple(c.candidate.tokens), c.score, c.feedback) for c in state["candidates"])
    return kept, state["depth"]


def lats_answer(state: dict[str, Any]) -> tuple[Any, ...]:
    """What a LATS run answers: the best solution's trajectory and the tree's shape."""
    root = state["root"]
    best = root.get_best_solution().get_trajectory(include_reflections=False)
    return tuple(m.text for m in best), root.height, root.visits, root.is_solved
