"""The one Pareto filter of the search: keep the options no other option beats on every cost.

The search prunes by dominance in three places -- per-layer strategies before the layer DP, and the
embedding/head strategies before and after pairing them on a stage. An option that is no better than
another in *every* column (time, per-step extra, memory, ...) and worse in one can be dropped without
losing an optimum, because every later step of the search only adds to or compares those columns.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import bad_value


def pareto_keep(columns: Sequence[np.ndarray], groups: np.ndarray | None = None) -> np.ndarray:
    """Mask over ``n`` options with one cost array ``[n]`` per column: True where no other option dominates.

    Option ``j`` dominates option ``i`` when it is ``<=`` in every column and ``<`` in one, or equal in all
    columns and earlier (of identical options the first is kept, so ties resolve to the lowest index,
    deterministically). With ``groups`` ``[n]``, options only compete within their group -- strategies with
    different activation layouts are not interchangeable, since their transitions to the neighbouring
    layers differ. Column by column, so the search's hot path (before every layer DP) builds [n, n] masks only.
    """
    if not len(columns):
        raise bad_value("no cost columns", "an option needs at least one cost to be compared on",
                        "pass e.g. (time, memory) arrays, one entry per option.")
    n = len(columns[0])
    no_worse = np.ones((n, n), dtype=bool)  # [i, j]: option j <= option i in every column so far
    better = np.zeros((n, n), dtype=bool)  # [i, j]: option j < option i in some column
    for col in columns:
        col = np.asarray(col)
        if col.shape != (n,):
            raise bad_value(f"cost column of shape {col.shape}", f"every column needs one entry per option ({n})",
                            "pass one 1-D array per cost, all of the same length.")
        no_worse &= col[None, :] <= col[:, None]
        better |= col[None, :] < col[:, None]
    idx = np.arange(n)
    beats = no_worse & (better | (idx[None, :] < idx[:, None]))
    if groups is not None:
        groups = np.asarray(groups)
        beats &= groups[None, :] == groups[:, None]
    return ~beats.any(axis=1)
