"""Critical-path bounds: how fast a search *could* run on an engine, from the baseline's own
trees and the engine's measured costs.

For one query's committed tree (what the baseline generated and scored), with ``t(b)`` the
engine's full step time at decode batch ``b`` (scheduling, forward, sampling: measured by
``step_cost_curve``), ``r1`` one reward call's latency and ``r_item`` the reward cost per item
in a full batch:

- chain: the longest root-to-node path, in engine steps (a node costs its tokens plus one
  prefill step): even with perfect speculation (every continuation started the moment its
  parent's text is known, no reward ever waited for) the steps along it run one after
  another, each at least ``t(1)``;
- work: every committed token must be generated, at best at the engine's best throughput
  ``min_b t(b) / b``, and every committed step scored, at ``r_item`` each;
- ``bound_s = max(chain_steps * t(1), tokens * min_b t(b)/b + items * r_item) + r1`` (the
  last reward is always on the path).

A mode's *achieved / bound* is ``bound_s / its wall time`` on the same queries (1.0 = the
bound reached). The bound ignores the CPU that the executor and the reward model take from
the engine on a small machine, so it is optimistic: ratios below 1 are expected.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from spec_tot.requests import GenerateRequest, RewardItem, SamplingParams
from spec_tot.tree import NodeStatus, SearchTree

__all__ = ["Costs", "measure_costs", "tree_bound"]


@dataclass(frozen=True)
class Costs:
    step_s: dict[int, float]  # decode batch -> full engine step seconds
    reward_call_s: float  # one reward call with one item
    reward_item_s: float  # per item, in a batch of 16

    @property
    def best_token_s(self) -> float:
        return min(t / b for b, t in self.step_s.items())

    def nearly_free_batch(self, factor: float = 1.25) -> int:
        """The largest measured batch whose step costs at most ``factor`` x batch 1's."""
        one = self.step_s[min(self.step_s)]
        return max(b for b, t in self.step_s.items() if t <= factor * one)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_s": {str(b): t for b, t in self.step_s.items()},
            "reward_call_s": self.reward_call_s,
            "reward_item_s": self.reward_item_s,
            "best_token_s": self.best_token_s,
        }


async def measure_costs(
    backend: Any,
    batches: Iterable[int] = (1, 2, 4, 8, 16, 32, 64),
    *,
    tokens: int = 24,
    reps: int = 3,
    prompt: str = "4 4 6 8\n",
) -> Costs:
    """The engine's full step time per decode batch (median of ``reps`` runs of ``b``
    requests generating ``tokens`` tokens each, from the engine's own step counters), and the
    reward model's latency (median of ``reps`` calls)."""
    step_s: dict[int, float] = {}
    sampling = SamplingParams(temperature=1.0, max_tokens=tokens, seed=0)
    for b in batches:
        samples = []
        for rep in range(reps):
            before = backend.stats()
            requests = [
                GenerateRequest(f"curve{b}-{rep}/{i}", sampling, prompt=prompt, dedup=False)
                for i in range(b)
            ]
            await asyncio.gather(*(backend.generate(r) for r in requests))
            after = backend.stats()
            steps = after["num_steps"] - before["num_steps"]
            samples.append((after["step_seconds"] - before["step_seconds"]) / max(steps, 1))
        step_s[b] = statistics.median(samples)
    item = RewardItem("probe", "4 4 6 8", ("4*4=16 (left: 6 8 16)", "8-6=2 (left: 2 16)"))

    async def timed(n: int) -> float:
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            await backend.score([item] * n)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    await timed(1)  # warm-up
    return Costs(step_s, await timed(1), await timed(16) / 16)


def tree_bound(tree: SearchTree, costs: Costs) -> dict[str, float]:
    """The bound of one query's committed tree (see the module docstring)."""
    chain: dict[str, int] = {tree.root.id: 0}
    tokens = items = longest = 0
    for node in tree.nodes():  # parents before children
        if node.parent is None or node.speculative or node.parent.id not in chain:
            continue
        if node.status is NodeStatus.CANCELLED and not node.num_tokens:
            continue
        chain[node.id] = chain[node.parent.id] + node.num_tokens + 1
        longest = max(longest, chain[node.id])
        tokens += node.num_tokens
        items += 1
    chain_s = longest * costs.step_s[min(costs.step_s)]
    work_s = tokens * costs.best_token_s + items * costs.reward_item_s
    return {
        "chain_steps": float(longest),
        "tokens": float(tokens),
        "items": float(items),
        "chain_s": chain_s,
        "work_s": work_s,
        "bound_s": max(chain_s, work_s) + costs.reward_call_s,
    }


def add_bounds(bounds: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The bounds of queries run one after another (concurrency 1): they add up."""
    total: dict[str, float] = {}
    for bound in bounds:
        for key, value in bound.items():
            total[key] = total.get(key, 0.0) + value
    return total
