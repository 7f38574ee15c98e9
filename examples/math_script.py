"""A scripted stand-in for a chat model on math word problems, so the math notebook runs
anywhere (CI, no model): deterministic steps that restate the question's numbers, add them,
and give the sum as the answer; as a judge it says Yes to a step with an '=' in it.

Not a model: it solves nothing but sums. ``examples/notebooks/math.ipynb`` uses the real
SmolLM2-135M-Instruct when ``scripts/fetch_smollm2.py`` has fetched it.
"""

from __future__ import annotations

import math
import re

from spec_tot.backends import GenerationBackend
from spec_tot.requests import (
    Capabilities,
    Completion,
    GenerateRequest,
    GenerateResult,
    TokenLogprob,
)

__all__ = ["ScriptedChat"]


class ScriptedChat(GenerationBackend):
    """Steps: "The numbers are a, b, ...", "a + b + ... = s", "#### s" (one per request, by
    how many steps the prompt holds); a sample index varies the first step's wording."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="scripted-chat")

    @property
    def num_inflight(self) -> int:
        return 0

    async def abort(self, prefix: str) -> int:
        return 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        prompt = request.prompt or ""
        if "Answer Yes or No" in prompt:
            last = prompt.split("Solution so far:")[-1].strip().splitlines()[-2:]
            good = any("=" in line or "####" in line for line in last)
            said = "Yes" if good else "No"
            done = Completion(said, (1,), 1, logprobs=(TokenLogprob(1, math.log(0.8)),))
            return GenerateResult(request.request_id, (done,))
        question, _, reply = prompt.rpartition("Assistant:")
        numbers = re.findall(r"\d+", question.split("\n\n", 1)[-1])[:3] or ["0"]
        total = sum(int(n) for n in numbers)
        steps = [", ".join(numbers), f"{' + '.join(numbers)} = {total}", f"#### {total}"]
        depth = reply.count("\n")
        out = []
        for i in range(request.n):
            text = steps[depth] if depth < len(steps) else ""
            if depth == 0:
                text = ("The numbers are " if i % 2 else "We use ") + text + "."
            out.append(Completion(text, (1,), 1))
        return GenerateResult(request.request_id, tuple(out))
