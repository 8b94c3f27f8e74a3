"""Dynamic programming over the layers of one pipeline stage under a memory budget.

Step 3 of the search (Galvatron VLDB'23): choose a strategy per layer minimizing the sum of
layer costs plus inter-layer transition costs, subject to the layers' memory fitting what the stage
has left. Vectorized with numpy over (memory, strategy); one run yields the best cost for *every*
layer count, which makes the stage partition (:mod:`.partition`) cheap.

When no transition costs anything (Galvatron's own model prices none), :class:`LayerFronts` solves the
same DP on the Pareto fronts of (memory, cost) instead of the whole memory grid -- same values and
paths, bit for bit, for every capacity at once -- and :class:`FrontsMemo` shares those runs between the
stages, end options and searches that repeat them.

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


# ---------------------------------------------------------------------------------------------------
# the same DP without transition costs, on Pareto fronts
# ---------------------------------------------------------------------------------------------------
def _strict_front(mem: np.ndarray, val: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """The points (memory, value) that no other point beats: within ``limit`` memory, finite, and cheaper
    than every point of less memory. Sorted by memory (values strictly falling); one point per memory."""
    ok = (mem < limit) & (val < np.inf)
    mem, val = mem[ok], val[ok]
    if not len(mem):
        return mem, val
    order = np.argsort(mem, kind="stable")
    mem, val = mem[order], val[order]
    keep = np.empty(len(val), dtype=bool)
    keep[0] = True
    keep[1:] = val[1:] < np.minimum.accumulate(val)[:-1]
    mem, val = mem[keep], val[keep]
    last = np.empty(len(mem), dtype=bool)  # kept values fall, so the last kept point of a memory is its best
    last[-1] = True
    last[:-1] = mem[1:] != mem[:-1]
    return mem[last], val[last]


class LayerFronts:
    """:func:`layer_dp` when every transition costs 0 (``trans`` all zeros), for every capacity below ``limit``.

    The dense DP keeps f[j, mem] = the best value of a prefix of layers whose last layer takes strategy j
    and that uses exactly ``mem`` grid units. Without transitions, only F[mem] = min_j f[j, mem] carries to
    the next layer, and of F only its *strict front* matters: the memories where F is cheaper than at every
    smaller memory. Every point the dense DP's answer or its path goes through lies on those fronts (a
    state off the front has a no-dearer state with less memory, so the path's least-memory tie rule never
    picks it), and a front point's value is the same sum, added in the same order, as the dense table's.
    A front has tens to a few hundred points where the dense table has thousands of memory cells, and it
    does not depend on the capacity: one forward pass answers every capacity below ``limit`` -- every end
    option of a stage and every search context of a Galvatron search (their fixed memory differs) -- and
    rebuilds paths without a second pass.

    ``c`` / ``q`` are ``[n, J]`` as for :func:`layer_dp`; with ``repeat`` they are one row that every layer
    shares (a homogeneous stage: any number of layers, computed as far as asked). Results are bit-identical
    to :func:`layer_dp` with ``trans = 0`` (tests/test_planner_search.py checks it on random problems).
    """

    def __init__(self, c: np.ndarray, q: np.ndarray, cls: np.ndarray, limit: int, repeat: bool = False) -> None:
        self.c, self.q = np.asarray(c, dtype=np.float64), np.asarray(q, dtype=np.int64)
        self.cls, self.limit, self.repeat = np.asarray(cls), limit, repeat
        self.fronts: list[tuple[np.ndarray, np.ndarray]] = []
        self.exhausted = False  # a front came out empty: no more layers fit, whatever the count

    def _row(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        i = 0 if self.repeat else layer
        return self.c[i], self.q[i]

    def _grow(self, n: int) -> None:
        """Fronts for the first ``n`` layers (as many as there are rows, without ``repeat``)."""
        n = n if self.repeat else min(n, len(self.c))
        while len(self.fronts) < n and not self.exhausted:
            c, q = self._row(len(self.fronts))
            if not self.fronts:
                front = _strict_front(q, c, self.limit)
            else:
                pm, pv = self.fronts[-1]
                front = _strict_front((pm[None, :] + q[:, None]).ravel(), (pv[None, :] + c[:, None]).ravel(),
                                      self.limit)
            if len(front[0]):
                self.fronts.append(front)
            else:
                self.exhausted = True

    def best(self, n_max: int, capacity: int) -> np.ndarray:
        """``layer_dp(...)[0]``: the best value for 1..n_max layers within ``capacity`` (index 0 unused, inf)."""
        self._check(capacity)
        best = np.full(n_max + 1, np.inf)
        if capacity < 0:
            return best
        self._grow(n_max)
        for i, (mem, val) in enumerate(self.fronts[:n_max]):
            k = int(np.searchsorted(mem, capacity, side="right"))
            if k == 0:  # n layers do not fit: neither do more (memory never shrinks with a layer)
                break
            best[i + 1] = val[k - 1]
        return best

    def path(self, n: int, capacity: int) -> list[int] | None:
        """``layer_dp(..., want_path=n)[1]``: the strategy index per layer of the best n layers within
        ``capacity``, with the dense DP's tie rules -- the end state of least memory, there the lowest
        strategy index; before it, the predecessor of the lowest layout class, there the lowest index."""
        self._check(capacity)
        if capacity < 0:
            return None
        self._grow(n)
        if len(self.fronts) < n:
            return None
        mem, val = self.fronts[n - 1]
        k = int(np.searchsorted(mem, capacity, side="right"))
        if k == 0:
            return None
        m, v = int(mem[k - 1]), val[k - 1]
        j = int(np.flatnonzero(self._reaches(n - 1, m, v))[0])
        path = [j]
        for layer in range(n - 1, 0, -1):
            m -= int(self._row(layer)[1][j])
            pm, pv = self.fronts[layer - 1]
            at = int(np.searchsorted(pm, m))
            assert at < len(pm) and pm[at] == m, "a path state off the front"
            v = pv[at]
            hits = np.flatnonzero(self._reaches(layer - 1, m, v))
            j = int(hits[np.lexsort((hits, self.cls[hits]))[0]])  # lowest class, then lowest index
            path.append(j)
        path.reverse()
        return path

    def _reaches(self, layer: int, m: int, v: float) -> np.ndarray:
        """Mask over strategies: taking it at ``layer`` ends at memory ``m`` with value ``v`` exactly (from a
        point of the previous front; a predecessor off the front cannot reach a front point)."""
        c, q = self._row(layer)
        if layer == 0:
            return (q == m) & (c == v)
        pm, pv = self.fronts[layer - 1]
        prev = m - q
        at = np.minimum(np.searchsorted(pm, prev), len(pm) - 1)
        return (pm[at] == prev) & (pv[at] + c == v)

    def _check(self, capacity: int) -> None:
        if capacity >= self.limit:
            raise ValueError(f"capacity {capacity}: the fronts were built for capacities below {self.limit}")


class FrontsMemo:
    """:class:`LayerFronts` by content: the same layer costs, memories and layout classes give the same fronts,
    whichever stage, end option or search asks. One memo may serve several searches (``search(memo=...)``):
    :func:`~lightning_galv.planner.galvatron_model.galvatron_search` shares one across its search contexts,
    whose stages mostly repeat each other's layer tables (only the allowed tp range and the fixed memory,
    i.e. the capacity, change with the context). An entry holds a few hundred points per layer (a few MB for
    a whole Galvatron search); past ``max_entries`` the memo starts over, which costs time only."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._by: dict[tuple, LayerFronts] = {}
        self.max_entries = max_entries
        self.built = 0  # fronts computed (the rest were found here)

    def get(self, c: np.ndarray, q: np.ndarray, cls: np.ndarray, limit: int) -> LayerFronts:
        """The fronts of the layer DP on ``c`` / ``q`` ``[n, J]`` below memory ``limit``."""
        c, q, cls = np.asarray(c, dtype=np.float64), np.asarray(q, dtype=np.int64), np.asarray(cls, dtype=np.int64)
        repeat = len(c) > 0 and bool((c == c[0]).all() and (q == q[0]).all())
        rows = (c[:1], q[:1]) if repeat else (c, q)
        key = (limit, repeat, rows[0].shape, rows[0].tobytes(), rows[1].tobytes(), cls.tobytes())
        hit = self._by.get(key)
        if hit is None:
            if len(self._by) >= self.max_entries:
                self._by.clear()
            hit = self._by[key] = LayerFronts(rows[0], rows[1], cls, limit, repeat)
            self.built += 1
        return hit
