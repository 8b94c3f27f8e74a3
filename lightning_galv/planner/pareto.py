"""The one Pareto filter of the search: keep the options no other option beats on every cost.

The search prunes by dominance in three places -- per-layer strategies before the layer DP, and the
embedding/head strategies before and after pairing them on a stage. An option that is no better than
another in *every* column (time, per-step extra, memory, ...) and worse in one can be dropped without
losing an optimum, because every later step of the search only adds to or compares those columns.
"""

from __future__ import annotations

import numpy as np

from ..errors import bad_value


def pareto_keep(costs: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask over the rows of ``costs`` ``[n, d]``: True where no other row dominates.

    Row ``j`` dominates row ``i`` when it is ``<=`` in every column and ``<`` in one, or equal in all
    columns and earlier (of identical options the first is kept, so ties resolve to the lowest index,
    deterministically). With ``groups`` ``[n]``, rows only compete within their group -- strategies with
    different activation layouts are not interchangeable, since their transitions to the neighbouring
    layers differ.
    """
    costs = np.asarray(costs, dtype=float)
    if costs.ndim != 2:
        raise bad_value(f"costs of shape {costs.shape}", "must be 2-D: [options, columns]", "stack one row per option.")
    n = len(costs)
    no_worse = (costs[None, :, :] <= costs[:, None, :]).all(axis=2)  # [i, j]: row j <= row i everywhere
    better = (costs[None, :, :] < costs[:, None, :]).any(axis=2)  # [i, j]: row j < row i somewhere
    idx = np.arange(n)
    beats = no_worse & (better | (idx[None, :] < idx[:, None]))
    if groups is not None:
        groups = np.asarray(groups)
        beats &= groups[None, :] == groups[:, None]
    return ~beats.any(axis=1)
