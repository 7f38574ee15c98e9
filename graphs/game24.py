"""Game of 24 as a ThoughtGraph: propose one step, score it with the PRM, repeat.

Each tree node is one step such as ``8/2=4 (left: 3 4 4)``. A branch ends after three steps
or at an illegal step. The answer is the trace itself (one step per line), checked by the
exact solver. Works with every search policy.

``Game24Drafter`` is the program's drafter for the embedded engine's token speculation
(``drafter="spec_tot.graphs.game24:game24_drafter"``, the program's default backend option):
once a step's operation is written, the result and its ``(left: ...)`` part are forced, so it
proposes them (and the newline that ends the step) for the engine to verify in one pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from spec_tot.app import ToTApp
from spec_tot.drafting import DraftContext, Drafter
from spec_tot.errors import ConfigError
from spec_tot.graph import END, START, State, ThoughtGraph
from spec_tot.graphs import game24_task as task
from spec_tot.programs import Program
from spec_tot.requests import SamplingParams

__all__ = [
    "DEFAULT_SEARCH_PARAMS",
    "PROGRAM",
    "Game24Drafter",
    "build_game24_graph",
    "compile_game24",
    "game24_drafter",
    "game24_inputs",
]

# Policy parameters used when the caller gives none (width 8, as the ToT evaluation).
DEFAULT_SEARCH_PARAMS: dict[str, dict[str, Any]] = {
    "rebase": {"width": 8, "max_depth": 3},
    "ets": {"width": 8, "max_depth": 3},
    "beam": {"n": 8, "width": 4, "max_depth": 3},
    "dvts": {"n": 8, "width": 4, "max_depth": 3},
    "best_of_n": {"n": 8, "max_depth": 3, "vote": "best"},
    "tot_bfs": {"breadth": 5, "width": 8, "max_depth": 3},
    "tot_dfs": {"width": 8, "max_depth": 3},
    "mcts": {"width": 4, "max_depth": 3},
    "rstar": {"width": 4, "max_depth": 3},
    "rest_mcts": {"width": 4, "max_depth": 3},
}


def _prompt(state: State) -> str:
    return task.prompt(state["question"], state["steps"])


def _parse(state: State, text: str) -> dict[str, Any]:
    """Append the step, and keep the numbers it leaves (None once a step is illegal) in
    ``left``, so that the router never re-parses the whole trace."""
    step = text.strip()
    before = state["left"] if "left" in state else task.parse_numbers(state["question"])
    left = task.apply_step(before, step) if before is not None else None
    return {"steps": [*state["steps"], step], "left": left}


def _route(state: State) -> str:
    if len(state["steps"]) >= 3 or state.get("left") is None:
        return "end"
    return "next"


def _answer(state: State) -> str | None:
    steps = state["steps"]
    return "\n".join(steps) if steps else None


def _check(state: State, answer: str | None) -> bool:
    return answer is not None and task.check_answer(state["question"], answer.split("\n"))


def build_game24_graph(*, temperature: float = 0.8) -> ThoughtGraph:
    graph = ThoughtGraph()
    graph.add_thought(
        "propose",
        _prompt,
        sampling=SamplingParams(temperature=temperature, max_tokens=40, stop=("\n",)),
        parse=_parse,
    )
    graph.add_reward("prm")
    graph.add_edge(START, "propose")
    graph.add_edge("propose", "prm")
    graph.add_conditional_edges("prm", _route, {"next": "propose", "end": END})
    return graph


def compile_game24(
    *,
    search: Any = "rebase",
    search_params: dict[str, Any] | None = None,
    temperature: float = 0.8,
    **compile_args: Any,
) -> ToTApp:
    """The Game-of-24 app; with no ``search_params`` a named policy gets its defaults above."""
    params = search_params or (
        DEFAULT_SEARCH_PARAMS.get(search, {}) if isinstance(search, str) else {}
    )
    return build_game24_graph(temperature=temperature).compile(
        search=search, search_params=params, answer=_answer, check=_check, **compile_args
    )


def game24_inputs(n: int, first_rank: int = task.TEST_RANKS[0]) -> list[dict[str, Any]]:
    """The first ``n`` puzzles of the test range (ranks 901-1000) as inputs."""
    last = first_rank + n - 1
    if n < 1 or last > task.TEST_RANKS[1]:
        raise ConfigError("queries", f"the test range holds 100 puzzles; asked for {n}")
    return [
        {"question": p.text, "steps": [], "rank": p.rank, "query_id": f"r{p.rank}"}
        for p in task.load_puzzles(first_rank, last)
    ]


class Game24Drafter(Drafter):
    """Proposes the forced rest of a step (``task.forced_suffix``) and the newline after it,
    for a tokenizer that writes each character as one token (the shipped policy's)."""

    name = "game24"

    def __init__(self, tokenizer: Any) -> None:
        vocab = len(tokenizer)
        special = set(getattr(tokenizer, "all_special_ids", ()))
        self._text = ["" if i in special else str(tokenizer.decode([i])) for i in range(vocab)]
        self._ids = {t: i for i, t in enumerate(self._text) if len(t) == 1}
        self._eq = self._ids.get("=")
        self._newline = self._ids.get("\n")
        # keyed by the prompt's hash, not its tokens (hundreds each): a collision costs one
        # wrong draft, which verification rejects
        self._numbers: OrderedDict[int, Any] = OrderedDict()
        self._drafts: OrderedDict[tuple[Any, tuple[int, ...]], list[int]] = OrderedDict()

    def _numbers_before(self, prompt: tuple[int, ...]) -> Any:
        """Numbers left after the prompt's puzzle line and steps (None: not a Game-of-24
        prompt, or an illegal step in it); cached per prompt."""
        key = hash(prompt)
        if key in self._numbers:
            self._numbers.move_to_end(key)
            return self._numbers[key]
        lines = "".join(self._text[t] for t in prompt).strip("\n").split("\n")
        try:
            numbers = task.remaining_numbers(lines[0], lines[1:])
        except ConfigError:
            numbers = None
        self._numbers[key] = numbers
        if len(self._numbers) > 4096:
            self._numbers.popitem(last=False)
        return numbers

    def propose(self, context: DraftContext) -> Sequence[int]:
        tokens, start = context.token_ids, context.num_prompt_tokens
        line = tokens[start:]
        if self._eq is None or self._newline is None or self._eq not in line:
            return ()
        if self._newline in line:  # a second line: not a step of this prompt's
            return ()
        numbers = self._numbers_before(tuple(tokens[:start]))
        if numbers is None:
            return ()
        key = (numbers, tuple(line))
        ids = self._drafts.get(key)
        if ids is None:  # siblings write the same partial steps: computed once
            rest = task.forced_suffix(numbers, "".join(self._text[t] for t in line))
            chars = [self._ids.get(ch) for ch in rest + "\n"] if rest else []
            ids = self._drafts[key] = [i for i in chars if i is not None]
            if len(ids) < len(chars):
                ids.clear()  # a character the tokenizer cannot write as one token
            if len(self._drafts) > 1 << 12:
                self._drafts.popitem(last=False)
        return ids[: context.limit]


def game24_drafter(tokenizer: Any) -> Game24Drafter:
    """The factory the engine's ``drafter`` option names."""
    return Game24Drafter(tokenizer)


def _backend_options(backend: str) -> dict[str, Any]:
    if backend == "local":
        return {
            "policy_path": str(task.asset_dir("policy")),
            "prm_path": str(task.asset_dir("prm")),
            "drafter": "spec_tot.graphs.game24:game24_drafter",
            "ngram_max": 4,  # with the program's drafter, as measured (token_spec_engine_b*)
        }
    return {}


PROGRAM = Program(
    name="game24",
    description="Game of 24, ranks 901-1000, shipped policy + learned PRM",
    default_backend="local",
    default_search="rebase",
    build=compile_game24,
    inputs=game24_inputs,
    backend_options=_backend_options,
)
