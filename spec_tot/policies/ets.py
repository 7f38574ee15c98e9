"""ETS: efficient tree search (Hooper et al. 2025, "ETS: Efficient Tree Search for
Inference-Time Scaling"): REBASE whose kept set is chosen by a small integer program that
trades reward against KV-cache footprint and semantic coverage.

At the end of every round, with ``W = width - C`` (``C`` = terminal SCORED nodes so far) and
candidates ``i = 1..N`` (the round's scored non-terminal nodes below ``max_depth``, ranked):

- ``o_i = softmax(score_i / temperature)``, the REBASE weight (sums to 1);
- ``P`` = the tree nodes on the candidates' paths (root excluded: the prompt's KV is always
  kept); a kept candidate keeps the KV of every node on its path, shared prefixes once;
- ``K`` = the clusters ``cluster_fn(node)`` of the candidates (default: normalised text).

Binary variables ``x_i`` (keep candidate i), ``y_j`` (node j of P stays in the KV cache),
``z_k`` (cluster k is covered)::

    maximise   sum_i o_i x_i  -  lambda_cost * sum_j y_j  +  lambda_cover * sum_k z_k
    subject to x_i <= y_j                  for every j on the path of i
               z_k <= sum_{i in k} x_i     for every cluster k
               sum_i x_i >= 1

solved exactly with ``scipy.optimize.milp`` (HiGHS, ``mip_rel_gap = 0``). A ``1e-7 * rank``
penalty on ``x_i`` makes ties go to the better-ranked candidate, deterministically. The paper
scales the cost term by ``1/(N + |P|)`` and the coverage term by ``1/|K|``; here the lambdas
are per node and per cluster (fold the paper's scaling into them). As in the ETS code, the
budget ``W`` is then re-allocated over the kept nodes by REBASE's rule (softmax over the kept
scores, largest-remainder rounding, nodes with 0 dropped). ``predict`` is REBASE's (no MILP on
a partial round: the kept set can change until all siblings are in). If HiGHS fails, the
round falls back to plain REBASE.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from spec_tot.errors import ConfigError
from spec_tot.policies.base import Expansion
from spec_tot.policies.checks import check_nonnegative
from spec_tot.policies.ranking import allocate, rank, softmax
from spec_tot.policies.rebase import Rebase
from spec_tot.tree import Node, SearchTree

__all__ = ["ETS", "default_cluster", "solve_keep"]

ClusterFn = Callable[[Node], Hashable]


def default_cluster(node: Node) -> Hashable:
    """Nodes whose step text is equal up to case and whitespace share a cluster."""
    return " ".join(node.text.lower().split())


def solve_keep(
    candidates: list[Node],
    weights: list[float],
    lambda_cost: float,
    lambda_cover: float,
    cluster_fn: ClusterFn,
) -> list[bool] | None:
    """The MILP above: which ``candidates`` (ranked best first) to keep. ``None`` on failure."""
    n = len(candidates)
    nodes: dict[str, int] = {}  # path node id -> column offset after the x block
    paths: list[list[int]] = []
    for cand in candidates:
        paths.append([nodes.setdefault(p.id, len(nodes)) for p in cand.path()])
    clusters: dict[Hashable, list[int]] = {}
    for i, cand in enumerate(candidates):
        clusters.setdefault(cluster_fn(cand), []).append(i)
    m, k = len(nodes), len(clusters)
    cost = np.concatenate(
        [
            [-(w - 1e-7 * i) for i, w in enumerate(weights)],
            np.full(m, lambda_cost),
            np.full(k, -lambda_cover),
        ]
    )
    rows: list[np.ndarray] = []
    uppers: list[float] = []
    lowers: list[float] = []
    for i, path in enumerate(paths):
        for j in path:  # x_i - y_j <= 0
            row = np.zeros(n + m + k)
            row[i], row[n + j] = 1.0, -1.0
            rows.append(row)
            lowers.append(-np.inf)
            uppers.append(0.0)
    for c, members in enumerate(clusters.values()):  # z_k - sum x_i <= 0
        row = np.zeros(n + m + k)
        row[n + m + c] = 1.0
        row[members] = -1.0
        rows.append(row)
        lowers.append(-np.inf)
        uppers.append(0.0)
    row = np.zeros(n + m + k)
    row[:n] = 1.0  # keep at least one candidate
    rows.append(row)
    lowers.append(1.0)
    uppers.append(np.inf)
    res = milp(
        cost,
        integrality=np.ones(n + m + k),
        bounds=Bounds(0, 1),
        constraints=LinearConstraint(np.array(rows), lowers, uppers),
        options={"mip_rel_gap": 0.0},
    )
    if res.status != 0 or res.x is None:
        return None
    return [bool(v > 0.5) for v in res.x[:n]]


class ETS(Rebase):
    name = "ets"

    def __init__(
        self,
        width: int = 16,
        temperature: float = 0.2,
        lambda_cost: float = 0.02,
        lambda_cover: float = 0.1,
        max_depth: int = 40,
        aggregation: str = "last",
        vote: str = "weighted",
        cluster_fn: ClusterFn | None = None,
    ) -> None:
        super().__init__(width, temperature, max_depth, aggregation, vote)
        check_nonnegative("lambda_cost", lambda_cost)
        check_nonnegative("lambda_cover", lambda_cover)
        if cluster_fn is not None and not callable(cluster_fn):
            raise ConfigError("cluster_fn", f"must be callable, got {cluster_fn!r}")
        self.lambda_cost = float(lambda_cost)
        self.lambda_cover = float(lambda_cover)
        self.cluster_fn: ClusterFn = cluster_fn or default_cluster

    def kept(self, nodes: list[Node]) -> list[Node]:
        """The candidates the MILP keeps, ranked best first."""
        ranked = rank(nodes, self.score)
        if not ranked:
            return []
        weights = softmax([self.score(n) for n in ranked], self.temperature)
        mask = solve_keep(ranked, weights, self.lambda_cost, self.lambda_cover, self.cluster_fn)
        if mask is None:
            return ranked
        return [n for n, keep in zip(ranked, mask, strict=True) if keep]

    def _select(self, tree: SearchTree, round_nodes: list[Node]) -> list[Expansion]:
        if self.remaining <= 0:
            return []
        keep = self.kept([c for c in round_nodes if self.expandable(c)])
        shares = softmax([self.score(n) for n in keep], self.temperature)
        widths = allocate(shares, self.remaining)
        return [Expansion(n.id, w) for n, w in zip(keep, widths, strict=True) if w > 0]

    def _predict_select(self, tree: SearchTree, nodes: list[Node]) -> list[tuple[Expansion, float]]:
        # No MILP on a partial round (the kept set can change until all siblings are in).
        return Rebase._predict_select(self, tree, nodes)
