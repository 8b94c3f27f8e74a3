"""How many layers each pipeline stage gets: the joint stage partition.

Step 4 of the search (beyond Galvatron, after Galvatron-BMW's bi-objective idea, TKDE'24): stages
differ in memory (1F1B keeps p - i micro-batches in stage i; embedding and head sit on the ends), so
the layer counts per stage are chosen to minimize the pipeline step time given each stage's
memory-constrained cost -- uneven partitions come out when they are faster. The objective is the
pipeline formula m * max(u) + (sum(u) - max(u)) / v over per-stage micro-batch times u
(:func:`~lightning_galv.planner.cost.pipeline_time`, Narayanan SC'21, Sec. 2.2).
"""

from __future__ import annotations

import math

import numpy as np

from ..plan import even_division


def stage_layer_ranges(L: int, p: int, v: int, uneven: bool) -> tuple[tuple[int, ...] | None, int, int]:
    """Even chunk division (interleaved, no uneven search, pp 1) or the (lo, hi) range of layers per stage.

    The range is the even count give or take max(2, L / 2p) layers: wide enough for the memory and
    end-cost imbalances a pipeline has, narrow enough to keep the partition's tables small.
    """
    if v > 1 or not uneven or p == 1:
        return even_division(L, p * v), 0, 0
    lo = max(1, L // p - max(2, math.ceil(L / (2 * p))))
    hi = min(L - (p - 1), math.ceil(L / p) + max(2, math.ceil(L / (2 * p))))
    return None, lo, hi


def partition(U: list[np.ndarray], L: int, m: int, v: int, lo: int, hi: int) -> tuple[list[int], float] | None:
    """Layer counts per stage minimizing m*max(u) + (sum(u) - max(u))/v (thresholding the bottleneck).

    ``U[i]`` is stage i's cost by layer count, ``[hi + 1]``, or by (first layer, count), ``[L + 1, hi + 1]``,
    when layer types differ along the model (heterogeneous models: a stage's cost depends on where it starts).
    """
    p = len(U)
    W = hi - lo + 1
    Uc = np.full((p, L + 1, W), np.inf)  # [stage, start, count - lo]
    for i in range(p):
        Uc[i] = U[i][..., lo:hi + 1] if U[i].ndim == 2 else U[i][None, lo:hi + 1]
    xs = np.unique(Uc[np.isfinite(Uc)])
    if len(xs) == 0:
        return None

    ns = np.arange(lo, hi + 1)
    # min-plus convolution as one (L+1) x W gather per stage instead of a Python loop over counts
    back = np.arange(L + 1)[:, None] - ns[None, :]
    reach = back >= 0
    back = np.where(reach, back, 0)
    rows = np.arange(L + 1)
    cols = np.arange(W)[None, :]
    Ug = [Uc[i][back, cols] for i in range(p)]  # [end, count]: the stage ending at `end` with `count` layers

    def solve(X: float) -> tuple[float, list[int]] | None:
        best = np.full(L + 1, np.inf)
        best[0] = 0.0
        args = []
        for i in range(p):
            cand = np.where(reach & (Ug[i] <= X), best[back] + Ug[i], np.inf)
            a = cand.argmin(axis=1)  # first minimum = fewest layers on stage i among ties
            best = cand[rows, a]
            args.append(ns[a])
        if not np.isfinite(best[L]):
            return None
        counts, k = [], L
        for i in range(p - 1, -1, -1):
            n = int(args[i][k])
            counts.append(n)
            k -= n
        counts.reverse()
        return float(best[L]), counts

    # first feasible threshold by bisection (feasibility is monotone in X)
    lo_i, hi_i = 0, len(xs) - 1
    if solve(xs[hi_i]) is None:
        return None
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        if solve(xs[mid]) is None:
            lo_i = mid + 1
        else:
            hi_i = mid
    best_t, best_counts = math.inf, None
    for X in xs[lo_i:]:
        if m * X >= best_t:
            break
        r = solve(X)
        if r is None:
            continue
        total, counts = r
        starts = np.cumsum([0] + counts[:-1])
        mx = max(Uc[i, starts[i], n - lo] for i, n in enumerate(counts))
        t = m * mx + (total - mx) / v
        if t < best_t - 1e-15:
            best_t, best_counts = t, counts
    return (best_counts, best_t) if best_counts is not None else None


def place(U: list[np.ndarray], L: int, m: int, v: int, per_stage: list[int] | None, lo: int,
          hi: int) -> tuple[list[int], float] | None:
    """Layer counts per stage and the partition objective: the given even split, or the best uneven one."""
    if per_stage is None:
        return partition(U, L, m, v, lo, hi)
    us = [float(U[i][n]) for i, n in enumerate(per_stage)]
    if not all(math.isfinite(u) for u in us):
        return None
    return list(per_stage), m * max(us) + (sum(us) - max(us)) / v
