"""Load-adaptive expert re-layout (after LAER-MoE): which experts each rank materializes this step.

Why: with plain expert parallelism rank ``r`` always computes experts ``[r E/k, (r+1) E/k)``, so the rank
holding a popular expert is the step's straggler (routing is skewed, and the skew moves from step to step).
LAER-MoE keeps expert parameters and optimizer state *fully sharded* over the expert group, so any rank can
materialize any expert for a step (all-gather its shards, return gradients by reduce-scatter); a fast
planner then picks, from the step's routing counts, how many replicas each expert gets, where they go, and
which fraction of the expert's tokens each replica takes.

The planner (our greedy, following the issue's recipe; the paper's own planner is not reproduced here):

1. **replicas in proportion to load**: every expert gets one replica, the remaining ``ranks * slots_per_rank
   - E`` slots go one at a time to the expert with the largest load per replica (a D'Hondt apportionment:
   it minimizes the largest ``load_e / replicas_e``), at most one replica per rank;
2. **least-loaded placement**: replicas in descending share ``load_e / replicas_e`` (ties: expert id) each
   go to the least-loaded rank (ties: rank id) that has a free slot and does not hold that expert yet (LPT
   scheduling; a swap repairs the rare dead end where only ranks already holding the expert have room);
3. **balancing shares**: two passes over the replicated experts, each re-splitting its tokens over its
   replicas by water-filling against the other load on those ranks (coordinate descent on the max load);
4. **swap search**, only while max/mean > ``SWAP_TARGET`` (1.05): LPT can put two hot experts' replicas on
   the *same* few ranks (they are the least loaded when the second one comes), a closed group no share can
   relieve; exchanging a replica of the most loaded rank with one of a least-loaded rank joins the groups,
   and the swap is kept when the max load drops after re-filling the experts involved.

With no more experts than ranks and two slots or more per rank, an exact construction replaces 1-4:
**Walker's alias method** (Walker 1977; Vose 1991, "A linear algorithm for generating random numbers with a
given distribution") splits ``k`` loads into ``k`` bins of exactly the mean with at most two items per bin:
each bin takes one expert below the mean whole (its *own*; bins without one take nothing) and tops up with a
piece of one expert above it, which then counts as below the mean once it has given enough. The bin of
expert ``e`` is its home rank under plain EP, so every rank keeps its own expert and materializes at most one
other; max/mean is 1 up to float rounding, where 1-4 left up to 1.26 on skewed 64-rank steps (two slots).

Every rank computes the same layout from the same (globally reduced) counts: the planner is deterministic.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import bad_value

__all__ = ["ExpertLayout", "plan_relayout", "split_counts", "new_materializations"]

_SUM_TOL = 1e-9
# The swap search runs until max/mean <= this: it is the planner's costly step, and the goal it serves is 1.10.
SWAP_TARGET = 1.05


@dataclass(frozen=True)
class ExpertLayout:
    """Per rank the experts it materializes, per expert how its tokens split over its replicas.

    ``slots[r]``: global expert ids rank ``r`` computes (sorted). ``shares[e]``: ``((rank, fraction), ...)``
    in ascending rank order, fractions summing to 1, one entry per rank whose slots hold ``e``.
    ``rank_load[r]``: expected tokens rank ``r`` computes under the load the layout was planned for (zeros
    for :meth:`static`, which knows no load; see :meth:`loads_for`).
    """

    slots: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[tuple[int, float], ...], ...]
    rank_load: tuple[float, ...]

    def __post_init__(self) -> None:
        # written for speed (the planner builds one layout per MoE layer and step: at 64 ranks validation was
        # most of its time), checking the same rules
        slots = tuple(tuple(map(int, s)) for s in self.slots)
        shares = tuple(tuple([(int(r), float(f)) for r, f in sh]) for sh in self.shares)
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "shares", shares)
        object.__setattr__(self, "rank_load", tuple(map(float, self.rank_load)))
        k, e = len(slots), len(shares)
        if k < 1 or e < 1:
            raise bad_value(f"{k} ranks, {e} experts", "a layout needs at least one rank and one expert",
                            "build it with plan_relayout(...) or ExpertLayout.static(...).")
        if len(self.rank_load) != k:
            raise bad_value(f"rank_load of length {len(self.rank_load)}", f"must have one entry per rank ({k})",
                            "give the expected tokens of every rank.")
        holders: list[list[int]] = [[] for _ in range(e)]
        for r, s in enumerate(slots):
            if s and (s[0] < 0 or s[-1] >= e or any(a >= b for a, b in zip(s, s[1:]))):  # strictly increasing
                raise bad_value(f"slots[{r}]={s}", f"must be sorted, distinct expert ids in 0..{e - 1}",
                                "a rank materializes each expert at most once.")
            for x in s:
                holders[x].append(r)
        for x, sh in enumerate(shares):
            if not sh:
                raise bad_value(f"shares[{x}]=()", "every expert needs at least one replica",
                                "give each expert >= 1 (rank, fraction) entry.")
            if [r for r, _ in sh] != holders[x]:
                raise bad_value(f"shares[{x}] ranks {[r for r, _ in sh]}", f"must be the ranks whose slots hold "
                                f"expert {x}, ascending ({holders[x]})", "keep slots and shares consistent.")
            fr = [f for _, f in sh]
            if not all(0.0 <= f < math.inf for f in fr) or abs(sum(fr) - 1.0) > 1e-6:  # NaN fails 0 <= f
                raise bad_value(f"shares[{x}] fractions {fr}", "must be >= 0 and sum to 1",
                                "normalize each expert's fractions.")

    # -- derived ------------------------------------------------------------------------------------------
    @property
    def ranks(self) -> int:
        return len(self.slots)

    @property
    def num_experts(self) -> int:
        return len(self.shares)

    @property
    def imbalance(self) -> float:
        """Max over mean of ``rank_load`` (1.0 = perfectly balanced; 1.0 also when nothing is loaded)."""
        mean = sum(self.rank_load) / len(self.rank_load)
        return max(self.rank_load) / mean if mean > 0 else 1.0

    def replicas(self, expert: int) -> int:
        return len(self.shares[expert])

    def loads_for(self, load: Sequence[float]) -> tuple[float, ...]:
        """Expected tokens per rank if the experts received ``load`` under this layout."""
        arr = _load_array(load)
        if arr.size != self.num_experts:
            raise bad_value(f"{arr.size} loads", f"must be one per expert ({self.num_experts})",
                            "pass the step's tokens per expert.")
        out = np.zeros(self.ranks)
        for e, sh in enumerate(self.shares):
            for r, f in sh:
                out[r] += f * arr[e]
        return tuple(float(x) for x in out)

    def with_load(self, load: Sequence[float]) -> "ExpertLayout":
        """The same layout, its ``rank_load`` (and so ``imbalance``) under ``load``."""
        return ExpertLayout(self.slots, self.shares, self.loads_for(load))

    # -- constructors -----------------------------------------------------------------------------------
    @staticmethod
    def static(num_experts: int, ranks: int) -> "ExpertLayout":
        """Plain expert parallelism: rank ``r`` holds experts ``[r E/k, (r+1) E/k)``, each with share 1."""
        e, k = _pos_int("num_experts", num_experts), _pos_int("ranks", ranks)
        if e % k:
            raise bad_value(f"num_experts={e}, ranks={k}", "plain expert parallelism needs ranks to divide the "
                            "experts", f"use an ep degree dividing {e}.")
        per = e // k
        slots = tuple(tuple(range(r * per, (r + 1) * per)) for r in range(k))
        shares = tuple(((x // per, 1.0),) for x in range(e))
        return ExpertLayout(slots, shares, (0.0,) * k)


def _pos_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 1:
        raise bad_value(f"{name}={v!r}", "must be a positive int", f"e.g. {name}=8.")
    return int(v)


def _load_array(load: Sequence[float]) -> np.ndarray:
    try:
        arr = np.asarray(load, dtype=np.float64)
    except (TypeError, ValueError):
        raise bad_value(f"load={load!r}", "must be a sequence of numbers", "pass tokens per expert.") from None
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise bad_value(f"load={arr.tolist() if arr.size <= 16 else arr.shape}",
                        "must be a non-empty 1-D sequence of finite, non-negative token counts",
                        "pass the step's (globally reduced) tokens per expert.")
    return arr


def _replica_counts(load: np.ndarray, ranks: int, total: int) -> np.ndarray:
    """D'Hondt: one replica each, then each extra slot to the largest load per replica (<= ranks each)."""
    e = load.size
    n = np.ones(e, np.int64)
    extra = total - e
    if extra <= 0:
        return n
    if np.all(load == 0):  # nothing to balance: spread evenly, low ids first
        n += extra // e
        n[: extra % e] += 1
        return n
    heap = [(-load[x], 1, x) for x in range(e)]  # key: (-load per replica, replicas, id)
    heapq.heapify(heap)
    while extra:
        _, c, x = heapq.heappop(heap)
        if c >= ranks:
            continue  # this expert is on every rank already; it leaves the heap
        n[x] = c + 1
        extra -= 1
        heapq.heappush(heap, (-load[x] / (c + 1), c + 1, x))
    return n


def _place(load: np.ndarray, n: np.ndarray, ranks: int, slots_per_rank: int) -> list[set[int]]:
    """LPT: replicas by descending share onto the least-loaded eligible rank (ties: lowest id)."""
    e = load.size
    order = sorted(((-(load[x] / n[x]), x) for x in range(e) for _ in range(int(n[x]))))
    held: list[set[int]] = [set() for _ in range(ranks)]
    rank_load = np.zeros(ranks)
    heap = [(0.0, r) for r in range(ranks)]  # ranks with a free slot, keyed by load
    for neg_share, x in order:
        share = -neg_share
        skipped = []
        chosen = -1
        while heap:
            lo, r = heapq.heappop(heap)
            if x in held[r]:
                skipped.append((lo, r))
                continue
            chosen = r
            break
        if chosen < 0:  # dead end: every rank with room already holds x -> swap with a rank that has none
            chosen = _swap_in(x, held, [r for _, r in skipped], load, n, rank_load)
        else:
            held[chosen].add(x)
            rank_load[chosen] += share
            if len(held[chosen]) < slots_per_rank:
                heapq.heappush(heap, (float(rank_load[chosen]), chosen))
        for item in skipped:
            if len(held[item[1]]) < slots_per_rank:
                heapq.heappush(heap, (float(rank_load[item[1]]), item[1]))
    return held


def _swap_in(x: int, held: list[set[int]], free: list[int], load: np.ndarray, n: np.ndarray,
             rank_load: np.ndarray) -> int:
    """Place ``x`` when every rank with a free slot already holds it: move some expert ``y`` from a full rank
    ``q`` (without ``x``) to a free rank ``p`` (without ``y``), then put ``x`` on ``q``. Such a pair exists:
    ``x`` has fewer replicas than ranks, so some ``q`` lacks it, and ``p`` holds fewer experts than ``q``,
    so ``q`` holds some ``y`` that ``p`` lacks. Deterministic: lowest ``p``, ``q``, ``y``."""
    for p in sorted(free):
        for q in range(len(held)):
            if x in held[q]:
                continue
            for y in sorted(held[q] - held[p]):
                sy = load[y] / n[y]
                held[q].remove(y)
                held[p].add(y)
                held[q].add(x)
                rank_load[q] += load[x] / n[x] - sy
                rank_load[p] += sy
                return q
    raise AssertionError("no swap found: replicas exceed ranks")  # unreachable by the argument above


class _Shares:
    """Tokens per (expert, rank) for a placement, with the two moves the planner makes on it.

    Plain Python lists and dicts, not numpy: an expert has a handful of replicas, and per-call numpy overhead
    would dominate the latency budget (1 ms at 64 ranks)."""

    def __init__(self, load: np.ndarray, held: list[set[int]]) -> None:
        self.lv = load.tolist()
        self.held = held
        self.k = len(held)
        self.holders: list[list[int]] = [[] for _ in self.lv]
        for r in range(self.k):
            for x in held[r]:
                self.holders[x].append(r)
        self.amount = [dict.fromkeys(h, self.lv[x] / len(h)) for x, h in enumerate(self.holders)]  # tokens
        self.rl = [0.0] * self.k
        for a in self.amount:
            for r, v in a.items():
                self.rl[r] += v
        self.mean = sum(self.lv) / self.k

    def fill(self, x: int) -> None:
        """Re-split expert ``x``'s tokens over its replicas by water-filling against the other load there."""
        a = self.amount[x]
        if len(a) < 2 or self.lv[x] <= 0:
            return
        rl = self.rl
        ranks = list(a)
        other = [rl[r] - a[r] for r in ranks]
        level = _water_level(other, self.lv[x])
        new = [level - o if level > o else 0.0 for o in other]
        scale = self.lv[x] / sum(new)  # exact total despite rounding
        for r, v in zip(ranks, new):
            v *= scale
            rl[r] += v - a[r]
            a[r] = v

    def passes(self, experts: Sequence[int], n: int) -> None:
        """Up to ``n`` water-filling passes over ``experts``; stops once a pass no longer lowers the max."""
        for _ in range(n):
            before = max(self.rl)
            if before <= self.mean * (1 + 1e-4):
                return
            for x in experts:
                self.fill(x)
            if before - max(self.rl) <= 1e-9 * max(1.0, before):
                return

    def move(self, x: int, src: int, dst: int) -> None:
        """Replica of ``x`` from rank ``src`` to rank ``dst`` (its tokens there go along)."""
        v = self.amount[x].pop(src)
        self.amount[x][dst] = v
        self.rl[src] -= v
        self.rl[dst] += v
        self.held[src].remove(x)
        self.held[dst].add(x)

    def improve(self, max_swaps: int, target: float, candidates: int = 3) -> None:
        """Swap-based local search on the most loaded rank ``p``: exchange one of its replicas ``y`` (largest
        first) with a replica ``z`` (smallest first) of one of the ``candidates`` least-loaded ranks ``q``,
        re-fill the experts now on ``p`` and ``q``, keep the swap if the max load drops. This is what joins
        replica groups the first placement left disjoint (two hot experts replicated on the same few ranks
        cannot trade load with anything else, whatever the shares)."""
        for _ in range(max_swaps):
            rl = self.rl
            p = max(range(self.k), key=rl.__getitem__)
            top = rl[p]
            if top <= self.mean * target:
                return
            qs = sorted(range(self.k), key=lambda r: (rl[r], r))[:candidates]
            if self._try_swaps(p, qs, top):
                continue
            return

    def _try_swaps(self, p: int, qs: list[int], top: float) -> bool:
        ys = sorted(self.held[p], key=lambda y: (-self.amount[y][p], y))
        for q in qs:
            if q == p:
                continue
            zs = sorted(self.held[q], key=lambda z: (self.amount[z][q], z))
            for y in ys:
                if y in self.held[q]:
                    continue
                for z in zs:
                    if z in self.held[p]:
                        continue
                    saved_rl = self.rl[:]
                    touched = sorted(self.held[p] | self.held[q] | {y, z})
                    saved = {x: dict(self.amount[x]) for x in touched}
                    self.move(y, p, q)
                    self.move(z, q, p)
                    for x in touched:
                        for r in self.amount[x]:
                            for w in self.held[r]:
                                if w not in saved:
                                    saved[w] = dict(self.amount[w])
                    group = sorted(saved)
                    self.passes(group, 4)
                    if max(self.rl) < top * (1 - 1e-6):
                        return True
                    self.move(y, q, p)  # undo
                    self.move(z, p, q)
                    for x, a in saved.items():
                        self.amount[x] = a
                    self.rl = saved_rl
        return False

    def fractions(self) -> list[dict[int, float]]:
        return [{r: (v / self.lv[x] if self.lv[x] > 0 else 1.0 / len(a)) for r, v in a.items()}
                for x, a in enumerate(self.amount)]


def _water_level(other: list[float], total: float) -> float:
    """Level w with sum(max(0, w - other)) == total."""
    o = sorted(other)
    csum = 0.0
    best = o[0] + total
    for i, v in enumerate(o):  # use the i + 1 lowest bins while the level stays above the highest of them
        csum += v
        w = (total + csum) / (i + 1)
        if w < v:
            break
        best = w
    return best


def _alias(load: np.ndarray, ranks: int) -> list[dict[int, float]]:
    """Walker / Vose alias construction (module docstring), ``load.size <= ranks``: tokens per (rank, expert)
    as one dict per rank -- expert ``e``'s own bin is rank ``e`` (its plain-EP home when experts == ranks),
    ranks ``>= load.size`` start empty. Deterministic: below- and above-mean experts are taken in id order."""
    e = load.size
    mean = float(load.sum()) / ranks
    left = load.astype(np.float64).tolist() + [0.0] * (ranks - e)  # [ranks] tokens still to place, per bin owner
    bins: list[dict[int, float]] = [{} for _ in range(ranks)]
    small = [x for x in range(ranks) if left[x] < mean]
    large = [x for x in range(e) if left[x] >= mean]
    small.reverse()  # pop() takes the lowest id first
    large.reverse()
    while small and large:
        x, y = small.pop(), large[-1]
        if x < e and left[x] > 0:
            bins[x][x] = left[x]
        give = mean - left[x]
        if give > 0:
            bins[x][y] = bins[x].get(y, 0.0) + give
        left[y] -= give
        if left[y] < mean:
            large.pop()
            small.append(y)
    for x in small + large:  # within float rounding of the mean (or nothing left to give): the bin keeps it
        if x < e and left[x] > 0:
            bins[x][x] = bins[x].get(x, 0.0) + left[x]
    return bins


def _alias_layout(arr: np.ndarray, k: int) -> ExpertLayout:
    bins = _alias(arr, k)
    e = arr.size
    placed = {x for b in bins for x in b}
    for x in range(e):  # an expert with no tokens still needs a replica: its home bin (no own piece, so room)
        if x not in placed:
            bins[x][x] = 0.0
    shares: list[list[tuple[int, float]]] = [[] for _ in range(e)]
    for r, b in enumerate(bins):
        for x, v in b.items():
            shares[x].append((r, v))
    frac = tuple(tuple((r, (v / arr[x]) if arr[x] > 0 else 1.0 / len(sh)) for r, v in sh)
                 for x, sh in enumerate(shares))
    loads = tuple(float(sum(b.values())) for b in bins)
    return ExpertLayout(tuple(tuple(sorted(b)) for b in bins), frac, loads)


def plan_relayout(load: Sequence[int], ranks: int, slots_per_rank: int) -> ExpertLayout:
    """The re-layout for one step: ``load[e]`` tokens routed to expert ``e`` (summed over the expert group),
    ``ranks`` ranks each materializing at most ``slots_per_rank`` experts. See the module docstring: the alias
    construction where it applies (``experts <= ranks``, two slots or more), else the greedy, which fills
    every slot."""
    arr = _load_array(load)
    k, spr = _pos_int("ranks", ranks), _pos_int("slots_per_rank", slots_per_rank)
    e = arr.size
    if spr < math.ceil(e / k):
        raise bad_value(f"slots_per_rank={spr}", f"must be >= ceil(experts / ranks) = {math.ceil(e / k)} so every "
                        f"one of the {e} experts has a slot", f"use slots_per_rank >= {math.ceil(e / k)} (one more "
                        "gives room for replicas of hot experts).")
    if spr > e:
        raise bad_value(f"slots_per_rank={spr}", f"must be <= the number of experts ({e}): a rank holds an expert "
                        "at most once", f"use slots_per_rank <= {e}.")
    if arr.sum() > 0 and spr >= 2 and e <= k:
        return _alias_layout(arr, k)
    return _greedy_layout(arr, k, spr)


def _greedy_layout(arr: np.ndarray, k: int, spr: int) -> ExpertLayout:
    """Steps 1-4 of the module docstring."""
    e = arr.size
    n = _replica_counts(arr, k, k * spr)
    held = _place(arr, n, k, spr)
    state = _Shares(arr, held)
    multi = sorted((x for x in range(e) if n[x] > 1 and arr[x] > 0), key=lambda x: (-arr[x], x))
    state.passes(multi, 2)
    if state.rl and max(state.rl) > state.mean * SWAP_TARGET:  # worth it: join replica groups
        state.improve(max_swaps=min(2 * k, 64), target=SWAP_TARGET)
    frac = state.fractions()
    slots = tuple(tuple(sorted(h)) for h in held)
    shares = tuple(tuple(sorted(frac[x].items())) for x in range(e))
    loads = np.zeros(k)
    for x, sh in enumerate(shares):
        for r, f in sh:
            loads[r] += f * arr[x]
    return ExpertLayout(slots, shares, tuple(float(v) for v in loads))


def split_counts(layout: ExpertLayout, expert: int, total: int) -> list[int]:
    """``total`` tokens of ``expert`` as integer counts per replica (``layout.shares[expert]`` order), by
    largest remainder: floors first, the leftover tokens to the largest fractional parts (ties: lower
    index). Deterministic and sums to ``total``."""
    if isinstance(expert, bool) or not isinstance(expert, (int, np.integer)) or not 0 <= expert < layout.num_experts:
        raise bad_value(f"expert={expert!r}", f"must be an int in 0..{layout.num_experts - 1}",
                        "pass a global expert id.")
    if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total < 0:
        raise bad_value(f"total={total!r}", "must be an int >= 0", "pass the expert's token count.")
    fr = [f for _, f in layout.shares[expert]]
    s = sum(fr)
    exact = [total * f / s for f in fr]
    base = [int(math.floor(v)) for v in exact]
    left = int(total) - sum(base)
    order = sorted(range(len(fr)), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return base


def new_materializations(old: ExpertLayout, new: ExpertLayout) -> list[tuple[int, int]]:
    """``(rank, expert)`` pairs ``new`` materializes that ``old`` did not: what a re-layout must all-gather
    (times the expert's parameter bytes) beyond keeping what is already there."""
    if old.ranks != new.ranks or old.num_experts != new.num_experts:
        raise bad_value(f"layouts of ({old.ranks}, {old.num_experts}) and ({new.ranks}, {new.num_experts}) "
                        "(ranks, experts)", "must have the same ranks and experts", "compare layouts of one group.")
    return [(r, x) for r in range(new.ranks) for x in new.slots[r] if x not in set(old.slots[r])]
