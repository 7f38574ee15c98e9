"""The math program: answer extraction and normalisation (GSM8K and MATH, tricky cases),
step splitting, the data loader's errors, and the graph end to end on a scripted chat model
with each kind of reward: the self-judge, the backend's PRM, a verifier function."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spec_tot.backends import GenerationBackend, RewardBackend
from spec_tot.errors import ConfigError, GraphValidationError
from spec_tot.graphs import math_task as task
from spec_tot.graphs.math import (
    PROGRAM,
    SelfJudge,
    build_math_graph,
    chat_for,
    compile_math,
    math_inputs,
    plain_chat,
    yes_no_ids,
)
from spec_tot.requests import (
    Capabilities,
    Completion,
    GenerateRequest,
    GenerateResult,
    RewardItem,
    SamplingParams,
    TokenLogprob,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She makes 9 * 2 = $18.\n#### 18", "18"),
        ("#### 1,000", "1000"),
        ("#### $1,234.50", "2469/2"),
        ("#### -7", "-7"),
        ("so the total is \\boxed{\\frac{1}{2}}.", "1/2"),
        ("\\boxed{\\dfrac{3}{4}}", "3/4"),
        ("\\boxed{\\frac12}", "1/2"),
        ("\\boxed{0.5}", "1/2"),
        ("\\boxed{x^{2}+1}", "x^{2}+1"),
        ("The answer is 42.", "42"),
        ("The answer is: -3.25", "-13/4"),
        ("first 3 apples, then 5 more, so 8", "8"),
        ("no numbers here", None),
        ("#### 10%", "10"),
        ("\\boxed{\\text{(A)}}", None),
        ("\\boxed{\\left( 3, 4 \\right)}", "(3,4)"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{12 \\text{ cm}}", "12"),
    ],
)
def test_extract_answer_reads_gsm8k_and_math_formats(text: str, expected: str | None) -> None:
    assert task.extract_answer(text) == expected


def test_answers_match_across_forms() -> None:
    assert task.answers_match("1,000", "1000") and task.answers_match("$5", "5.00")
    assert task.answers_match("\\frac{1}{2}", "0.5") and task.answers_match("-1/2", "-0.5")
    assert not task.answers_match("12", "-12") and not task.answers_match(None, "1")
    assert not task.answers_match("1", None)


def test_extract_boxed_balances_braces_and_takes_the_last() -> None:
    assert task.extract_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert task.extract_boxed("\\boxed{unclosed") is None and task.extract_boxed("none") is None


def test_split_steps_by_line_or_paragraph() -> None:
    text = "a = 1\nb = 2\n\nc = 3\n"
    assert task.split_steps(text) == ["a = 1", "b = 2", "c = 3"]
    assert task.split_steps(text, "paragraph") == ["a = 1\nb = 2", "c = 3"]
    with pytest.raises(ConfigError, match="step"):
        task.split_steps(text, "sentence")


def test_load_problems_reads_both_formats_and_names_the_bad_line(tmp_path: Path) -> None:
    good = tmp_path / "mixed.jsonl"
    rows = [{"question": "1+1?", "answer": "1+1=2\n#### 2"},
            {"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}]  # fmt: skip
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    problems = task.load_problems(good)
    assert [(p.question, p.answer) for p in problems] == [("1+1?", "2"), ("Half of 1?", "1/2")]
    assert problems[1].source == "dataset mixed.jsonl:2"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{nope\n")
    with pytest.raises(ConfigError, match=r"dataset bad.jsonl:2: not JSON"):
        task.load_problems(bad)
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ConfigError, match="'#### <answer>'"):
        task.load_problems(bad)
    with pytest.raises(ConfigError, match="holds 2 problems; asked for 3"):
        task.load_problems(good, 3)
    with pytest.raises(ConfigError, match="not a regular file"):
        task.load_problems(tmp_path)


def test_the_bundled_gsm8k_problems_load() -> None:
    inputs = math_inputs(100)
    assert len(inputs) == 100 and inputs[0]["reference"] == "18"
    assert inputs[0]["question"].startswith("Janet") and inputs[0]["steps"] == []


class ChatScript(GenerationBackend):
    """A chat model in miniature: solves ``a + b`` in steps, one line per request (the
    number of steps already in the prompt says which); judges say Yes to a correct step."""

    def __init__(self, wrong: bool = False) -> None:
        self.wrong = wrong
        self.requests: list[GenerateRequest] = []

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="chat-script")

    @property
    def num_inflight(self) -> int:
        return 0

    async def abort(self, prefix: str) -> int:
        return 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        prompt = request.prompt or ""
        if "Answer Yes or No" in prompt:
            good = "= 5" in prompt and "= 6" not in prompt
            given = ()
            if request.sampling.logprob_token_ids:  # (yes, no): 0.6 / 0.2, or the reverse
                yes, no = request.sampling.logprob_token_ids
                p_yes, p_no = (0.6, 0.2) if good else (0.2, 0.6)
                given = ((yes, math.log(p_yes)), (no, math.log(p_no)))
            said = Completion("Yes" if good else "No", (1,), 1,
                              logprobs=(TokenLogprob(1, math.log(0.9), given=given),))  # fmt: skip
            return GenerateResult(request.request_id, (said,))
        done = prompt.split("Assistant:")[-1].count("\n")
        lines = ["We add 2 and 3.", "2 + 3 = 6" if self.wrong else "2 + 3 = 5",
                 "#### 6" if self.wrong else "#### 5"]  # fmt: skip
        text = lines[done] if done < len(lines) else ""
        completions = tuple(Completion(text, (1,), 1) for _ in range(request.n))
        return GenerateResult(request.request_id, completions)


def _inputs() -> list[dict[str, Any]]:
    return [{"question": "What is 2 + 3?", "steps": [], "reference": "5", "query_id": "q0"}]


@pytest.mark.parametrize("search", ["best_of_n", "beam", "rebase"])
def test_the_graph_solves_with_the_self_judge(search: str) -> None:
    backend = ChatScript()
    params = {"best_of_n": {"n": 2, "max_depth": 6}, "beam": {"n": 2, "width": 2, "max_depth": 6},
              "rebase": {"width": 2, "max_depth": 6}}[search]  # fmt: skip
    app = compile_math(backend=backend, search=search, chat=plain_chat, search_params=params)
    result = app.run_batch(_inputs()).results[0]
    assert result.status == "ok" and result.answer == "5" and result.solved
    judged = [r for r in backend.requests if r.request_id.rsplit("/", 1)[-1].startswith("judge")]
    assert judged and all(r.sampling.temperature == 0 and r.sampling.max_tokens == 1
                          for r in judged)  # fmt: skip


def test_the_self_judge_scores_p_yes_for_every_step() -> None:
    judge = SelfJudge(ChatScript(), plain_chat)
    good = RewardItem("q0/a", "What is 2 + 3?", ("We add 2 and 3.", "2 + 3 = 5"))
    bad = RewardItem("q0/b", "What is 2 + 3?", ("We add 2 and 3.", "2 + 3 = 6"))
    scores = asyncio.run(judge.score([good, bad]))
    assert scores[0] == pytest.approx((0.9, 0.9)) and scores[1] == pytest.approx((0.1, 0.1))
    with pytest.raises(ConfigError, match="judge_prompt"):
        SelfJudge(ChatScript(), plain_chat, prompt="no fields")


class Verifier(RewardBackend):
    score_range = (0.0, 1.0)

    async def score(self, items: Sequence[RewardItem]) -> list[tuple[float, ...]]:
        return [tuple(0.0 if "6" in s else 1.0 for s in item.steps) for item in items]


def test_the_graph_takes_a_prm_or_a_verifier() -> None:
    wrong = compile_math(backend=ChatScript(wrong=True), search="best_of_n", reward=Verifier(),
                         search_params={"n": 1, "max_depth": 6})  # fmt: skip
    result = wrong.run_batch(_inputs()).results[0]
    assert result.answer == "6" and not result.solved

    class WithPrm(ChatScript, Verifier):  # a backend that also scores (SGLang, vLLM, local)
        pass

    prm = compile_math(backend=WithPrm(), search="best_of_n", reward="prm",
                       search_params={"n": 1, "max_depth": 6})  # fmt: skip
    result = prm.run_batch(_inputs()).results[0]
    assert result.answer == "5" and result.solved
    with pytest.raises(GraphValidationError, match=r"'score'.*no reward backend"):
        compile_math(backend=ChatScript(), reward="prm")  # a backend without a PRM


def test_bad_options_name_the_field() -> None:
    with pytest.raises(ConfigError, match="reward"):
        compile_math(backend=ChatScript(), reward="oracle")
    with pytest.raises(ConfigError, match="step"):
        build_math_graph(step="sentence")
    with pytest.raises(ConfigError, match="max_steps"):
        build_math_graph(max_steps=0)
    with pytest.raises(ConfigError, match="solve_prompt"):
        build_math_graph(solve_prompt="no question")


def test_the_chat_template_comes_from_the_backend_when_it_has_one() -> None:
    class Templated(ChatScript):
        def render_chat(self, messages: Sequence[Any]) -> str:
            return "<|user|>" + messages[0]["content"] + "<|assistant|>"

    assert chat_for(Templated())([{"role": "user", "content": "x"}]) == "<|user|>x<|assistant|>"
    assert chat_for(ChatScript()) is plain_chat
    assert PROGRAM.name == "math" and PROGRAM.backend_options("scripted") == {}


def test_steps_extend_the_assistant_reply_and_stop_per_line() -> None:
    graph = build_math_graph(chat=plain_chat, step="paragraph")
    node = graph.nodes["step"]
    assert node.sampling == SamplingParams(temperature=0.7, max_tokens=96, stop=("\n\n",))
    text = node.prompt({"question": "Q?", "steps": ["one", "two"]})
    assert text.endswith("Assistant:one\n\ntwo\n\n") and "Q?" in text


def test_the_self_judge_reads_yes_and_no_where_the_tokenizer_has_them() -> None:
    class Tokenizer:
        def encode(self, word: str, add_special_tokens: bool = True) -> list[int]:
            return {"Yes": [7], "No": [9]}.get(word, [1, 2])

    class WithTokenizer(ChatScript):
        tokenizer = Tokenizer()

    backend = WithTokenizer()
    assert yes_no_ids(backend) == (7, 9) and yes_no_ids(ChatScript()) is None
    judge = SelfJudge(backend, plain_chat, yes_no=yes_no_ids(backend))
    good = RewardItem("q0/a", "What is 2 + 3?", ("2 + 3 = 5",))
    bad = RewardItem("q0/b", "What is 2 + 3?", ("2 + 3 = 6",))
    scores = asyncio.run(judge.score([good, bad]))
    assert scores == [pytest.approx((0.75,)), pytest.approx((0.25,))]  # renormalised
    assert backend.requests[0].sampling.logprob_token_ids == (7, 9)


def test_compile_math_needs_no_started_backend() -> None:
    """The embedded engine knows its tokenizer only once started: compiling the math
    program read it at once and failed ("not started") before any run (issue 48)."""

    class Tokenizer:
        def encode(self, word: str, add_special_tokens: bool = True) -> list[int]:
            return {"Yes": [7], "No": [9]}.get(word, [1, 2])

    class StartsLate(ChatScript):
        started = False

        async def start(self) -> None:
            self.started = True

        @property
        def tokenizer(self) -> Tokenizer:
            if not self.started:
                raise RuntimeError("local: not started: `await backend.start()` first")
            return Tokenizer()

    backend = StartsLate()
    app = compile_math(backend=backend, search="best_of_n", chat=plain_chat,
                       search_params={"n": 2, "max_depth": 6})  # fmt: skip
    result = app.run_batch(_inputs()).results[0]
    assert result.status == "ok" and result.solved
    judged = [r for r in backend.requests if r.request_id.rsplit("/", 1)[-1].startswith("judge")]
    assert judged and all(r.sampling.logprob_token_ids == (7, 9) for r in judged)


def test_the_cli_runs_the_math_program_on_a_dataset_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from spec_tot import cli

    data = tmp_path / "two.jsonl"
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out_json = tmp_path / "run.json"
    code = cli.run_cli(["run", "--program", "math", "--backend", "scripted", "--dataset",
                        str(data), "--queries", "2", "--search", "best_of_n", "--param", "n=2",
                        "--json", str(out_json)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert json.loads(out_json.read_text())[0]["metrics"]["queries"] == 2
    code = cli.run_cli(["run", "--program", "math", "--backend", "scripted", "--dataset",
                        str(data), "--queries", "3"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--dataset" in err and "holds 2 problems; asked for 3" in err
    code = cli.run_cli(["run", "--program", "toy", "--backend", "scripted", "--dataset", "x"])
    assert code == 2 and "program 'toy' reads no dataset" in capsys.readouterr().err


def test_each_judge_call_has_its_own_request_id() -> None:
    """Issue 53: one trace scored twice at once (speculatively, then committed) must not
    reach the backend under one id: a backend refuses an id that is still open."""
    from spec_tot.graphs.math import SelfJudge
    from spec_tot.requests import RewardItem

    seen: list[str] = []

    class Backend:
        tokenizer = None

        async def start(self) -> None:
            return None

        async def generate(self, request: Any) -> Any:
            seen.append(request.request_id)
            await asyncio.sleep(0.01)  # both calls are open together
            completion = SimpleNamespace(text="Yes", logprobs=())
            return SimpleNamespace(completions=[completion])

    judge = SelfJudge(Backend(), lambda messages: messages[0]["content"], yes_no=None)  # type: ignore[arg-type]
    item = RewardItem("q0/3/1", "What is 2 + 3?", ("2 + 3 = 5",))
    asyncio.run(judge.score([item, item]))
    assert len(seen) == 2 and len(set(seen)) == 2
    assert all(rid.startswith("q0/3/1/judge") for rid in seen)
