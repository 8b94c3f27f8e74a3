"""Dynamic programming over the layers of one pipeline stage under a memory budget.

Step 3 of the search (Galvatron VLDB'23): choose a strategy per layer minimizing the sum of
layer costs plus inter-layer transition costs, subject to the layers' memory fitting what the stage
has left. Vectorized with numpy over (memory, strategy); one run yields the best cost for *every*
layer count, which makes the stage partition (:mod:`.partition`) cheap.

Memory is accounted on a grid of ``budget / memory_bins`` bytes, rounding every layer *up*: the
search is conservative (a plan it returns fits) and exact with respect to that grid.
"""

from __future__ import annotations

import numpy as np


def layer_dp(c: np.ndarray, q: np.ndarray, cls: np.ndarray, trans: np.ndarray, n_max: int, capacity: int,
             want_path: int | None = None) -> tuple[np.ndarray, list[int] | None]:
    """min over strategy sequences s_1..s_n of sum c[s_i] + sum trans[cls s_{i-1}, cls s_i] s.t. sum q <= capacity.

    ``c``/``q`` are [n, J] (per layer position) so heterogeneous layers work. Returns the best value for
    every prefix length 1..n_max (index 0 unused) and, if ``want_path``, the argmin sequence for that
    length. Vectorized over (memory, strategy): O(n * M * (J + K^2)). The table is kept as
    [strategy, memory] so that every reduction runs over whole contiguous memory rows.
    """
    n_layers, J = c.shape
    K = trans.shape[0]
    M = capacity + 1
    best = np.full(n_max + 1, np.inf)
    if capacity < 0 or J == 0:
        return best, None
    f = np.full((J, M), np.inf)
    for j in range(J):
        if q[0, j] < M:
            f[j, q[0, j]] = min(f[j, q[0, j]], c[0, j])
    members = [np.flatnonzero(cls == k) for k in range(K)]
    parents: list[tuple[np.ndarray, np.ndarray]] = []
    best[1] = f.min()
    for layer in range(1, n_max):
        g = np.full((K, M), np.inf)
        garg = np.zeros((K, M), dtype=np.int64)
        for k, mem in enumerate(members):
            if not len(mem):
                continue
            sub = f[mem]
            g[k] = sub.min(axis=0)
            if want_path is not None:
                garg[k] = mem[sub.argmin(axis=0)]  # first minimum: lowest strategy index of the class
        h3 = g[:, None, :] + trans[:, :, None]  # [K_prev, K_next, M]
        h = h3.min(axis=0)
        if want_path is not None:
            harg = h3.argmin(axis=0)
        nf = np.full((J, M), np.inf)
        for j in range(J):
            qj = q[layer, j]
            if qj < M:
                nf[j, qj:] = h[cls[j], : M - qj] + c[layer, j]
        f = nf
        if want_path is not None:
            parents.append((harg, garg))
        best[layer + 1] = f.min()
        if not np.isfinite(best[layer + 1]):
            break
    path = None
    if want_path is not None and np.isfinite(best[want_path]):
        if want_path != n_max:  # the parents above are for n_max layers: rerun to the wanted length
            return layer_dp(c, q, cls, trans, want_path, capacity, want_path)
        mem, j = np.unravel_index(np.argmin(f.T), (M, J))  # ties: least memory, then lowest index
        path = [int(j)]
        for layer in range(n_max - 1, 0, -1):
            harg, garg = parents[layer - 1]
            mem = mem - q[layer, j]
            k_prev = harg[cls[j], mem]
            j = garg[k_prev, mem]
            path.append(int(j))
        path.reverse()
    return best, path
