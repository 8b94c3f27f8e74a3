"""Search for the fastest hybrid-parallel plan that fits in memory.

Structure (Galvatron VLDB'23, Galvatron-BMW TKDE'24), outermost first:

1. **Outer loop** over global batch (fixed or a range), pipeline degree (any divisor of the world
   size), schedule (GPipe / 1F1B / interleaved 1F1B) and micro-batch count. Configurations are
   visited in order of an optimistic lower bound on step time and skipped once the bound cannot
   beat the k-th best plan found so far. In the uniform ("3-D") space the unit is a (configuration,
   strategy) pair with its own bound, and a stage's cost is closed-form (n identical layers), so
   that space needs no layer DP at all.
2. **Decision tree** per stage size: the per-layer strategy space (tp x dp factorizations, Megatron
   or Ulysses sequence parallelism, ZeRO stage, checkpointing, tp rank order) is enumerated and pruned:
   Galvatron's guideline rules (tp inside a node, consecutive tp groups; ``heuristic_pruning``) plus
   an exact dominance rule (a strategy slower *and* larger than another with the same activation
   layout can never be part of an optimum).
3. **Dynamic programming over layers** per stage under the memory budget with inter-layer transition
   costs, vectorized with numpy over (memory, strategy). One run yields the best cost for *every*
   layer count, which makes step 4 cheap.
4. **Joint stage partition** (beyond Galvatron, after BMW's bi-objective idea): stages differ in
   memory (1F1B keeps p - i micro-batches in stage i; embedding and head sit on the ends), so the
   layer counts per stage are chosen to minimize the pipeline step time given each stage's
   memory-constrained cost -- uneven partitions come out when they are faster.

Memory is accounted on a grid of ``budget / memory_bins`` bytes, rounding every layer *up*: the
search is conservative (a plan it returns fits) and exact with respect to that grid.

The budget the plans must fit is ``memory_budget_bytes * (1 - memory_margin)``, 2 % below the given
budget by default (:data:`DEFAULT_MEMORY_MARGIN`): the cost model counts the tensors it knows (model
states, saved activations, recomputation buffers, gathered ZeRO-3 parameters, the profile's fixed
bytes), but a real step also allocates small temporaries (norm statistics, softmax scratch, the loss'
intermediates) that no profile itemizes. Measured per-rank peaks on CPU came out up to ~0.3 % above the
predictions for that reason (benchmarks/RESULTS.md); the margin keeps a plan predicted to fit inside
the budget without pricing those temporaries one by one. ``memory_margin=0`` searches the exact budget.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

import numpy as np

from ..errors import bad_value
from ..plan import (SCHEDULES, SP_MODES, LayerStrategy, ModelShape, ParallelPlan, Prediction, divisors,
                    even_division)
from .cost import CostModel, GalvatronCostModel, LayerCost, PlanCost, StageContext
from .profiles import HardwareProfile, ModelProfile

GiB = float(2**30)
DEFAULT_MEMORY_MARGIN = 0.02  # fraction of the budget kept free for what the cost model does not itemize
Edge = tuple[LayerStrategy, LayerStrategy]  # (embedding, head) strategies as one stage sees them


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose from. Defaults: the full space."""

    max_tp: int | None = None  # None: up to the stage size
    max_pp: int | None = None
    pp_degrees: tuple[int, ...] | None = None  # None: every divisor of the world size
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b")
    virtual_stages: tuple[int, ...] = (2,)
    micro_batches: tuple[int, ...] | None = None  # None: every divisor of the global batch
    max_micro_batches: int | None = None
    sp_modes: tuple[str, ...] = SP_MODES
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    checkpoint: tuple[bool, ...] = (False, True)
    tp_consecutive: tuple[bool, ...] = (True, False)
    uniform: bool = False  # one strategy for every layer (the "3-D" space)
    uneven_partition: bool = True
    heuristic_pruning: bool = True
    memory_bins: int = 2048
    embed_tp: int | None = None  # vocabulary-parallel degree of embedding and head; None: searched
    embed_zero: int | None = None  # ZeRO stage of embedding and head; None: searched over zero_stages
    vocab_padding: bool = False  # allow vocab-parallel degrees that do not divide the vocabulary (Megatron pads it)
    vocab_parallel_loss: bool = False  # the loss takes vocab-sharded logits: priced, and set on the emitted plans

    def __post_init__(self) -> None:
        for s in self.schedules:
            if s not in SCHEDULES:
                raise bad_value(f"schedule={s}", f"must be one of {SCHEDULES}", "e.g. schedules=('1f1b',).")
        for s in self.sp_modes:
            if s not in SP_MODES:
                raise bad_value(f"sp_mode={s}", f"must be one of {SP_MODES}", "e.g. sp_modes=('none', 'megatron').")
        for z in self.zero_stages:
            if z not in (0, 1, 2, 3):
                raise bad_value(f"zero={z}", "ZeRO stages are 0..3", "e.g. zero_stages=(0, 2, 3).")
        if not self.zero_stages or not self.schedules or not self.checkpoint or not self.tp_consecutive:
            raise bad_value(self, "zero_stages, schedules, checkpoint and tp_consecutive need >= 1 choice",
                            "leave a field at its default to search it.")
        if self.memory_bins < 16:
            raise bad_value(f"memory_bins={self.memory_bins}", "must be >= 16", "use 2048 (default) or more.")

    @property
    def default_embed_zero(self) -> int:
        if self.embed_zero is not None:
            return self.embed_zero
        return max([z for z in self.zero_stages if z <= 2] or [min(self.zero_stages)])

    @classmethod
    def three_d(cls, zero: int = 2, **kw: object) -> "SearchSpace":
        """Galvatron's "3-D" space: one (pp, tp, dp) for all layers, one ZeRO stage, no SP or recomputation."""
        return cls(sp_modes=("none",), zero_stages=(zero,), checkpoint=(False,), tp_consecutive=(True,),
                   uniform=True, **kw)  # type: ignore[arg-type]


class SearchResult(list):
    """The top-k plans (best first), plus how the search went. A plain ``list[ParallelPlan]`` otherwise."""

    def __init__(self, plans: Iterable[ParallelPlan], explanation: str, stats: dict[str, float]) -> None:
        super().__init__(plans)
        self.explanation = explanation
        self.stats = stats

    @property
    def best(self) -> ParallelPlan:
        return self[0]


# ---------------------------------------------------------------------------------------------------
# decision tree
# ---------------------------------------------------------------------------------------------------
def candidate_strategies(shape: ModelShape, stage_size: int, micro_batch: int, space: SearchSpace,
                         hw: HardwareProfile | None = None) -> list[LayerStrategy]:
    """Every per-layer strategy of a stage that is valid for this model and micro-batch.

    With ``space.heuristic_pruning`` (Galvatron VLDB'23 Sec. 3.2 guidelines): tensor/sequence groups
    stay inside a node, and tp groups are consecutive ranks.
    """
    out: list[LayerStrategy] = []
    max_tp = space.max_tp or stage_size
    for tp in divisors(stage_size):
        dp = stage_size // tp
        if tp > max_tp or micro_batch % dp:
            continue
        for sp in (("none",) if tp == 1 else space.sp_modes):
            need = [shape.num_heads, shape.num_kv_heads]
            if sp != "ulysses":
                need.append(shape.ffn_hidden)
            if sp != "none":
                need.append(shape.seq_len)
            if any(n % tp for n in need):
                continue
            consecs = (True,) if tp == 1 or dp == 1 else space.tp_consecutive
            for consec in consecs:
                if space.heuristic_pruning and tp > 1:
                    if not consec:
                        continue
                    if hw is not None and not hw.is_intra_node(tp, 1) and dp > 1:
                        continue
                d = dp * tp if sp == "ulysses" else dp
                for zero in ((0,) if d == 1 else space.zero_stages):
                    for ck in space.checkpoint:
                        out.append(LayerStrategy(tp, dp, sp, zero, ck, consec))
    return out


@dataclass
class _Table:
    """Per-candidate costs of one (stage size, micro-batch, micro-batch count) context."""

    strategies: list[LayerStrategy]
    fb: np.ndarray  # [type, j] fwd+bwd seconds per micro-batch
    extra: np.ndarray  # [type, j] seconds per step
    states: np.ndarray  # [type, j] bytes
    act: np.ndarray  # [type, j] bytes per in-flight micro-batch
    transient: np.ndarray  # [type, j] bytes
    cls: np.ndarray  # [j] layout class
    trans: np.ndarray  # [K, K] seconds per micro-batch


# ---------------------------------------------------------------------------------------------------
# dynamic programming over layers
# ---------------------------------------------------------------------------------------------------
@dataclass
class _StageDP:
    """Best cost of the first ``n`` layers of one stage for every n, under one memory budget."""

    value: np.ndarray  # [n] best objective (m * per-mb time + per-step extra), inf if infeasible
    tau: np.ndarray  # [n] index of the transient level achieving it

    def __init__(self, n_max: int) -> None:
        self.value = np.full(n_max + 1, np.inf)
        self.tau = np.zeros(n_max + 1, dtype=np.int64)


def _dominance_keep(c: np.ndarray, q: np.ndarray, r: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """Exact pruning: drop j if some j' of the same layout class is no slower, no larger, no more transient."""
    le = (c[None, :] <= c[:, None]) & (q[None, :] <= q[:, None]) & (r[None, :] <= r[:, None]) & (cls[None, :] == cls[:, None])
    strict = (c[None, :] < c[:, None]) | (q[None, :] < q[:, None]) | (r[None, :] < r[:, None])
    idx = np.arange(len(c))
    earlier = idx[None, :] < idx[:, None]
    dominated = (le & (strict | earlier)).any(axis=1)
    return ~dominated


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
# the search
# ---------------------------------------------------------------------------------------------------
@dataclass
class _Config:
    global_batch: int
    pp: int
    schedule: str
    v: int
    m: int
    j: int = -1  # uniform ("3-D") space: index of the one strategy in the table; -1 = per-layer search
    bound: float = 0.0

    @property
    def key(self) -> tuple[int, int, str, int, int]:
        """The pipeline configuration, without the strategy: the top-k holds one plan per configuration."""
        return (self.global_batch, self.pp, self.schedule, self.v, self.m)


class _Searcher:
    def __init__(self, profile: ModelProfile, hw: HardwareProfile, world: int, budget: float,
                 space: SearchSpace, cost: CostModel) -> None:
        self.p, self.hw, self.world, self.budget, self.space, self.cost = profile, hw, world, budget, space, cost
        self.L = profile.num_layers
        self.types = sorted(set(profile.layer_type_of))
        self.grid = budget / space.memory_bins
        self.tables: dict[tuple[int, int], _Table | None] = {}
        self.fixed_cache: dict[tuple, tuple[float, float, float]] = {}
        self.edge_cache: dict[tuple, list[LayerStrategy]] = {}
        self.dp_cache: dict[tuple, tuple[np.ndarray, np.ndarray, list]] = {}
        self.stats = {"configs": 0, "pruned_by_bound": 0, "infeasible": 0, "dp_runs": 0, "shortcuts": 0,
                      "levels_skipped": 0, "edges_skipped": 0}
        self.min_fit: tuple[float, str] = (math.inf, "")

    # -- cost tables ---------------------------------------------------------------------------------
    def table(self, S: int, mb: int) -> _Table | None:
        """Per-strategy layer costs of a stage of ``S`` ranks at micro-batch ``mb``.

        Keyed by (S, mb) only: layer costs and transitions do not depend on the micro-batch count or the
        stage position, so one table serves every (pp, m) of a batch sweep that lands on the same pair.
        """
        key = (S, mb)
        if key in self.tables:
            return self.tables[key]
        strategies = candidate_strategies(self.p.shape, S, mb, self.space, self.hw)
        if not strategies:
            self.tables[key] = None
            return None
        ctx = StageContext(S, mb, 1)
        T, J = len(self.p.layer_types), len(strategies)
        fb, extra, states, act, tr = (np.zeros((T, J)) for _ in range(5))
        first_layer_of_type = {t: self.p.layer_type_of.index(t) for t in self.types}
        for t, li in first_layer_of_type.items():
            for j, s in enumerate(strategies):
                lc: LayerCost = self.cost.layer_cost(li, s, ctx)
                fb[t, j], extra[t, j], states[t, j], act[t, j], tr[t, j] = (
                    lc.fwd + lc.bwd, lc.step_extra, lc.states, lc.act, lc.transient)
        classes: dict[tuple, int] = {}
        reps: list[LayerStrategy] = []
        cls = np.zeros(J, dtype=np.int64)
        for j, s in enumerate(strategies):
            key2 = (s.dp, s.tp_consecutive or s.tp == 1 or s.dp == 1)
            if key2 not in classes:
                classes[key2] = len(classes)
                reps.append(s)
            cls[j] = classes[key2]
        K = len(reps)
        if self.space.uniform:  # one strategy for all layers: activations never change layout
            trans = np.zeros((K, K))
        else:
            trans = np.array([[self.cost.transition_time(a, b, ctx) for b in reps] for a in reps]).reshape(K, K)
        tab = _Table(strategies, fb, extra, states, act, tr, cls, trans)
        self.tables[key] = tab
        return tab

    def edge_options(self, S: int, mb: int) -> list[LayerStrategy]:
        """Strategies the embedding and the head may take on a stage of ``S`` ranks at micro-batch ``mb``.

        What the runtime supports (parallel/tensor.py apply_tp_embedding / apply_tp_head, plan rules):
        vocab-parallel degree tp (no sequence parallelism, consecutive ranks) times data parallel dp
        with any ZeRO stage. A fixed ``embed_tp`` keeps the old behaviour: that degree, raised to the
        next divisor when the micro-batch is too small to split.
        """
        key = ("edges", S, mb)
        hit = self.edge_cache.get(key)
        if hit is not None:
            return hit  # type: ignore[return-value]
        sp, vocab = self.space, self.p.shape.vocab_size
        out: list[LayerStrategy] = []
        for vtp in divisors(S):
            dp = S // vtp
            if mb % dp or (vtp > 1 and vocab % vtp and not sp.vocab_padding):
                continue
            if sp.embed_tp is not None:
                if vtp < sp.embed_tp and S % sp.embed_tp == 0:
                    continue
            elif vtp > (sp.max_tp or S) or (sp.heuristic_pruning and vtp > 1 and not self.hw.is_intra_node(vtp, 1)):
                continue  # vocab-parallel groups stay inside a node, as the layers' tp groups do
            zeros = (0,) if dp == 1 else (sp.default_embed_zero,) if sp.embed_tp is not None or \
                sp.embed_zero is not None else sp.zero_stages
            out += [LayerStrategy(tp=vtp, dp=dp, zero=z) for z in zeros]
            if sp.embed_tp is not None:
                break
        self.edge_cache[key] = out
        return out

    def edge_front(self, S: int, mb: int, first: bool, uniform: LayerStrategy | None) -> list[LayerStrategy]:
        """Options of one end (embedding or head) that no other option beats in time, extra and memory.

        Dominance is checked on the end's own cost (``end_cost``), which is exact whenever embedding
        and head are priced separately (different stages, or different strategies on one stage). In the
        uniform (3-D) space the ends take the layers' tensor-parallel degree, as Galvatron's 3-D plans do.
        """
        opts = self.edge_options(S, mb)
        if uniform is not None:
            same = [e for e in opts if e.tp == uniform.tensor_parallel]
            opts = same or opts
        key = ("front", S, mb, first, uniform.tensor_parallel if uniform is not None else 0)
        hit = self.edge_cache.get(key)
        if hit is not None:
            return hit
        ctx = StageContext(S, mb, 1)
        cs = [self.cost.end_cost(e, ctx, first, not first, self.space.vocab_parallel_loss) for e in opts]
        vec = np.array([[c.fwd + c.bwd, c.step_extra, c.states, c.act] for c in cs]).reshape(len(cs), 4)
        keep = []
        for i in range(len(opts)):
            le = (vec <= vec[i]).all(axis=1)
            lt = (vec < vec[i]).any(axis=1)
            if not (le & (lt | (np.arange(len(opts)) < i))).any():
                keep.append(opts[i])
        self.edge_cache[key] = keep
        return keep

    # -- one stage ----------------------------------------------------------------------------------
    def stage_costs(self, cfg: _Config, tab: _Table, stage: int, edge: tuple[LayerStrategy, LayerStrategy],
                    n_lo: int, n_hi: int, start: int) -> tuple[np.ndarray, dict]:
        """Best objective (seconds per step, m-weighted) for n = 0..n_hi layers on ``stage`` with the
        embedding / head strategies ``edge``."""
        S = self.world // cfg.pp
        ctx = StageContext(S, cfg.global_batch // cfg.m, cfg.m, cfg.pp, stage, cfg.schedule, cfg.v)
        fixed_t, fixed_e, fixed_mem = self.fixed(edge[0], edge[1], ctx)
        k = ctx.inflight
        types = np.array(self.p.layer_type_of[start:start + n_hi]) if not self.p.homogeneous else None
        freed = self.cost.backward_freed(edge[1], ctx, self.space.vocab_parallel_loss)
        key = (S, ctx.micro_batch, cfg.m, k, round(fixed_mem), round(freed), n_lo, n_hi,
               start if types is not None else -1, cfg.v)
        base = fixed_t * cfg.m + fixed_e
        info = {"fixed_t": fixed_t, "fixed_e": fixed_e, "fixed_mem": fixed_mem, "ctx": ctx, "freed": freed}
        hit = self.dp_cache.get(key)
        if hit is not None:
            vals = hit[0]
            info.update(hit[2][0])
            return vals + base, info
        vals = np.full(n_hi + 1, np.inf)
        vals[0] = 0.0
        t0 = 0 if types is None else None
        c_all = cfg.m * tab.fb + tab.extra  # [type, J]
        mem_all = tab.states + k * tab.act
        q_all = np.ceil(mem_all / self.grid - 1e-9).astype(np.int64)
        r_all = tab.transient
        trans = cfg.m * tab.trans
        layer_types = np.full(n_hi, self.p.layer_type_of[0]) if types is None else types
        avail = self.budget - fixed_mem
        # transient levels: the largest recomputation buffer any chosen layer may need
        levels = sorted({0.0} | {float(x) for x in np.unique(r_all[layer_types].ravel()) if x > 0})
        choice: dict = {"levels": levels, "by_n": {}}
        for li, tau in enumerate(levels):
            capacity = int(math.floor((avail - max(0.0, tau - freed)) / self.grid + 1e-9))
            if capacity < 0:
                continue
            allowed = np.flatnonzero((r_all[layer_types] <= tau + 1e-6).all(axis=0))
            if len(allowed) == 0:
                continue
            c = c_all[layer_types][:, allowed]
            # every layer at its fastest allowed strategy, memory and transitions ignored: if even that
            # cannot beat what lower transient levels already reach for n_lo..n_hi, skip this level's DP
            lb = np.concatenate(([0.0], np.cumsum(c.min(axis=1))))
            if np.all(lb[n_lo:] >= vals[n_lo:]):
                self.stats["levels_skipped"] += 1
                continue
            q = q_all[layer_types][:, allowed]
            cl = tab.cls[allowed]
            if types is None:  # drop dominated strategies (exact: same class, no better anywhere)
                keep = _dominance_keep(c[0], q[0], r_all[layer_types[0], allowed], cl)
                allowed, c, q, cl = allowed[keep], c[:, keep], q[:, keep], cl[keep]
                j0 = int(np.argmin(c[0]))
                n_fit = capacity // max(1, q[0, j0])
                if n_fit >= n_hi:  # uniform fastest strategy fits every n: optimal without a DP
                    self.stats["shortcuts"] += 1
                    cand = c[0, j0] * np.arange(n_hi + 1)
                    better = cand < vals
                    vals = np.where(better, cand, vals)
                    for n in np.flatnonzero(better):
                        choice["by_n"][int(n)] = ("uniform", int(allowed[j0]), tau)
                    continue
            self.stats["dp_runs"] += 1
            best, _ = layer_dp(c, q, cl, trans, n_hi, capacity)
            better = best < vals
            better[0] = False
            vals = np.where(better, best, vals)
            for n in np.flatnonzero(better):
                choice["by_n"][int(n)] = ("dp", li, tau)
        self.dp_cache[key] = (vals, None, [info | {}])
        info["choice"] = choice
        self.dp_cache[key][2][0].update({"choice": choice})
        return vals + base, info

    def stage_path(self, cfg: _Config, tab: _Table, info: dict, n: int, start: int) -> list[LayerStrategy]:
        """Reconstruct the strategies of the n layers chosen for a stage."""
        how, a, tau = info["choice"]["by_n"][n]
        if how == "uniform":
            return [tab.strategies[a]] * n
        k = info["ctx"].inflight
        layer_types = np.array(self.p.layer_type_of[start:start + n])
        c_all = cfg.m * tab.fb + tab.extra
        q_all = np.ceil((tab.states + k * tab.act) / self.grid - 1e-9).astype(np.int64)
        allowed = np.flatnonzero((tab.transient[layer_types] <= tau + 1e-6).all(axis=0))
        capacity = int(math.floor((self.budget - info["fixed_mem"] - max(0.0, tau - info["freed"])) / self.grid + 1e-9))
        _, path = layer_dp(c_all[layer_types][:, allowed], q_all[layer_types][:, allowed], tab.cls[allowed],
                           cfg.m * tab.trans, n, capacity, want_path=n)
        assert path is not None
        return [tab.strategies[allowed[j]] for j in path]

    # -- partition ------------------------------------------------------------------------------------
    def partition(self, U: list[np.ndarray], m: int, v: int, lo: int, hi: int) -> tuple[list[int], float] | None:
        """Layer counts per stage minimizing m*max(u) + (sum(u) - max(u))/v (thresholding the bottleneck).

        ``U[i]`` is stage i's cost by layer count, ``[hi + 1]``, or by (first layer, count), ``[L + 1, hi + 1]``,
        when layer types differ along the model (heterogeneous models: a stage's cost depends on where it starts).
        """
        p, L = len(U), self.L
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

    # -- one configuration ------------------------------------------------------------------------------
    def fixed(self, emb: LayerStrategy, head: LayerStrategy, ctx: StageContext) -> tuple[float, float, float]:
        """``stage_fixed`` memoized: the same (stage, micro-batch) recurs for every strategy of the 3-D space."""
        key = (emb, head, ctx)
        hit = self.fixed_cache.get(key)
        if hit is None:
            hit = self.fixed_cache[key] = self.cost.stage_fixed(emb, head, ctx, self.space.vocab_parallel_loss)
        return hit

    def solve(self, cfg: _Config) -> ParallelPlan | None:
        S = self.world // cfg.pp
        mb = cfg.global_batch // cfg.m
        tab = self.table(S, mb)
        if tab is None:
            return None
        uni = tab.strategies[cfg.j] if cfg.j >= 0 else None
        groups = self.stage_edges(cfg, S, mb, uni)
        if not groups:
            return None
        if cfg.j >= 0 and self.p.homogeneous:
            return self._solve_uniform(cfg, tab, groups)
        if cfg.j >= 0:
            j = cfg.j
            sub = _Table([tab.strategies[j]], tab.fb[:, [j]], tab.extra[:, [j]], tab.states[:, [j]],
                         tab.act[:, [j]], tab.transient[:, [j]], np.zeros(1, dtype=np.int64), np.zeros((1, 1)))
            return self._solve_with(cfg, sub, groups, uniform_key=j)
        return self._solve_with(cfg, tab, groups)

    def stage_edges(self, cfg: _Config, S: int, mb: int, uni: LayerStrategy | None) -> list[list[list[Edge]]]:
        """Candidate (embedding, head) strategies per stage, in groups that are solved one by one.

        The embedding only costs on stage 0 and the head only on the last stage, so each stage picks
        its own end independently -- except that the cost model sizes the stage-boundary sends of the
        middle stages by the embedding's dp: with pp >= 3 the embedding options are grouped by dp and
        each group is solved separately. With pp = 1 both ends share the stage: pairs are priced jointly.
        """
        p = cfg.pp
        emb = self.edge_front(S, mb, True, uni)
        head = self.edge_front(S, mb, False, uni)
        if not emb or not head:
            return []
        if p == 1:
            ctx = StageContext(S, mb, cfg.m, 1, 0, cfg.schedule, cfg.v)
            pairs = [(e, h) for e in emb for h in head]
            return [[self._front(pairs, ctx)]]
        ctxs = [StageContext(S, mb, cfg.m, p, i, cfg.schedule, cfg.v) for i in (0, p - 1)]
        last = self._front([(h, h) for h in head], ctxs[1])
        if p == 2:
            return [[self._front([(e, e) for e in emb], ctxs[0]), last]]
        out = []
        for dp in sorted({e.dp for e in emb}, reverse=True):
            first = self._front([(e, e) for e in emb if e.dp == dp], ctxs[0])
            out.append([first] + [first[:1]] * (p - 2) + [last])
        return out

    def _front(self, edges: list[Edge], ctx: StageContext) -> list[Edge]:
        """Edges of one stage not beaten by another in mb time, step extra and memory (all of stage_fixed)."""
        vec = np.array([self.fixed(e, h, ctx) for e, h in edges]).reshape(len(edges), 3)
        idx = np.arange(len(edges))
        keep = []
        for i in range(len(edges)):
            le = (vec <= vec[i]).all(axis=1)
            lt = (vec < vec[i]).any(axis=1)
            if not (le & (lt | (idx < i))).any():
                keep.append(edges[i])
        return keep

    def lower_bounds(self, cfg: _Config, tab: _Table, per_strategy: bool) -> np.ndarray:
        """Optimistic step time of each strategy used for every layer (``per_strategy``), else one
        bound for the configuration with every layer free to take its own fastest strategy.

        Every layer at its fastest time and smallest per-step extra, stages perfectly balanced: the
        pipeline time m*max + (sum - max)/v is at least (m - 1/v)*max(ceil(L/p) t, sum/p) + sum/v, and
        the slowest stage's extra is at least ceil(L/p) * the smallest extra (Narayanan SC'21, Sec. 2.2).
        """
        p, v, m, L = cfg.pp, cfg.v, cfg.m, self.L
        fb, ex = tab.fb, tab.extra
        if not per_strategy:
            fb, ex = fb.min(axis=1, keepdims=True), ex.min(axis=1, keepdims=True)
        counts = np.bincount(np.asarray(self.p.layer_type_of), minlength=fb.shape[0])
        present = counts > 0
        per = math.ceil(L / p)
        total = counts @ fb  # [cols]
        slow = per * fb[present].min(axis=0)
        return (m - 1.0 / v) * np.maximum(slow, total / p) + total / v + per * ex[present].min(axis=0)

    def _layout(self, cfg: _Config) -> tuple[tuple[int, ...] | None, int, int]:
        """Even chunk division (interleaved, no uneven search, pp 1) or the (lo, hi) range of layers per stage."""
        p, L, v = cfg.pp, self.L, cfg.v
        if v > 1 or not self.space.uneven_partition or p == 1:
            return even_division(L, p * v), 0, 0
        lo = max(1, L // p - max(2, math.ceil(L / (2 * p))))
        hi = min(L - (p - 1), math.ceil(L / p) + max(2, math.ceil(L / (2 * p))))
        return None, lo, hi

    def _solve_uniform(self, cfg: _Config, tab: _Table, groups: list[list[list[Edge]]]) -> ParallelPlan | None:
        """One strategy for every (identical) layer: a stage's cost is n * c, so no layer DP is needed.

        Same numbers as the general path on a one-strategy table (same memory grid, same transient
        rule), in closed form: n layers fit while n * q <= capacity.
        """
        p, L, v, m = cfg.pp, self.L, cfg.v, cfg.m
        S, mb = self.world // p, cfg.global_batch // m
        t, j = self.p.layer_type_of[0], cfg.j
        c = m * tab.fb[t, j] + tab.extra[t, j]
        r = float(tab.transient[t, j])
        tau = r if r > 1e-6 else 0.0
        division, lo, hi = self._layout(cfg)
        per_stage = None if division is None else [sum(division[ch] for ch in range(i, p * v, p)) for i in range(p)]
        n_hi = hi if per_stage is None else max(per_stage)
        n = np.arange(n_hi + 1, dtype=np.float64)
        best: tuple[float, list[int], list[Edge]] | None = None
        for group in groups:
            U, picks = [], []
            for i in range(p):
                ctx = StageContext(S, mb, m, p, i, cfg.schedule, v)
                q = int(math.ceil((tab.states[t, j] + ctx.inflight * tab.act[t, j]) / self.grid - 1e-9))
                u_best, which = np.full(n_hi + 1, np.inf), np.zeros(n_hi + 1, dtype=np.int64)
                for idx, (e, h) in enumerate(group[i]):
                    ft, fe, fmem = self.fixed(e, h, ctx)
                    freed = self.cost.backward_freed(h, ctx, self.space.vocab_parallel_loss)
                    capacity = int(math.floor((self.budget - fmem - max(0.0, tau - freed)) / self.grid + 1e-9))
                    if capacity < 0:
                        continue
                    n_fit = capacity // q if q > 0 else L
                    u = (n * c + (ft * m + fe)) / m
                    u[min(n_fit, n_hi) + 1:] = np.inf
                    better = u < u_best
                    u_best[better], which[better] = u[better], idx
                U.append(u_best)
                picks.append(which)
            self.stats["shortcuts"] += p
            got = self._place(U, cfg, per_stage, lo, hi)
            if got is not None and (best is None or got[1] < best[0]):
                counts = got[0]
                best = (got[1], counts, [group[i][int(picks[i][counts[i]])] for i in range(p)])
        if best is None:
            return None
        _, counts, edges = best
        div = tuple(counts) if per_stage is None else tuple(division)  # type: ignore[arg-type]
        return self._finish(cfg, (tab.strategies[j],) * L, div, edges[0][0], edges[-1][1])

    def _place(self, U: list[np.ndarray], cfg: _Config, per_stage: list[int] | None, lo: int,
               hi: int) -> tuple[list[int], float] | None:
        """Layer counts per stage and the partition objective: the given even split, or the best uneven one."""
        if per_stage is None:
            return self.partition(U, cfg.m, cfg.v, lo, hi)
        us = [float(U[i][n]) for i, n in enumerate(per_stage)]
        if not all(math.isfinite(u) for u in us):
            return None
        return list(per_stage), cfg.m * max(us) + (sum(us) - max(us)) / cfg.v

    def _finish(self, cfg: _Config, layers: tuple[LayerStrategy, ...], division: tuple[int, ...],
                embed: LayerStrategy, head: LayerStrategy) -> ParallelPlan | None:
        """Build the plan and price it with the full cost model (the search's objective is only a proxy)."""
        plan = ParallelPlan(world_size=self.world, layers=layers, pp=cfg.pp, pp_division=division,
                            micro_batches=cfg.m, global_batch=cfg.global_batch, pipeline_schedule=cfg.schedule,
                            virtual_stages=cfg.v, embed=embed, head=head,
                            vocab_parallel_loss=self.space.vocab_parallel_loss)
        pc = self.cost.evaluate(plan)
        if pc.peak_memory_bytes > self.budget * (1 + 1e-9):  # cannot happen with the conservative grid
            return None
        # the plan was built just above and nobody else holds it: attach the prediction without a
        # second round of validation (prediction is not part of the plan's identity, compare=False)
        object.__setattr__(plan, "prediction", Prediction(pc.step_time_s, pc.throughput, pc.stage_memory_bytes))
        return plan

    def stage_values(self, cfg: _Config, tab: _Table, stage: int, edges: list[Edge], n_lo: int, n_hi: int,
                     start: int) -> tuple[np.ndarray, list[dict], np.ndarray]:
        """``stage_costs`` minimized over the stage's embedding/head options, pointwise in n.

        Options are visited leanest first: the layers of that one see the most memory, so its layer
        values bound every later option's from below (less memory never helps); an option whose fixed
        cost plus that bound cannot beat the running minimum anywhere in n_lo..n_hi skips its DP.
        """
        ctx = StageContext(self.world // cfg.pp, cfg.global_batch // cfg.m, cfg.m, cfg.pp, stage, cfg.schedule, cfg.v)
        fixed = [self.fixed(e, h, ctx) for e, h in edges]
        base = [ft * cfg.m + fe for ft, fe, _ in fixed]
        best, which = np.full(n_hi + 1, np.inf), np.zeros(n_hi + 1, dtype=np.int64)
        infos: list[dict] = [{} for _ in edges]
        floor: np.ndarray | None = None
        for idx in sorted(range(len(edges)), key=lambda i: fixed[i][2]):
            if floor is not None and np.all(base[idx] + floor[n_lo:] >= best[n_lo:]):
                self.stats["edges_skipped"] += 1
                continue
            vals, infos[idx] = self.stage_costs(cfg, tab, stage, edges[idx], n_lo, n_hi, start)
            if floor is None:
                floor = vals - base[idx]
            better = vals < best
            best[better], which[better] = vals[better], idx
        return best, infos, which

    def _solve_with(self, cfg: _Config, tab: _Table, groups: list[list[list[Edge]]],
                    uniform_key: int = -1) -> ParallelPlan | None:
        p, v = cfg.pp, cfg.v
        chunks = p * v
        division, lo, hi = self._layout(cfg)
        per_stage = None if division is None else [sum(division[c] for c in range(i, chunks, p)) for i in range(p)]
        starts_even = [sum(per_stage[:i]) if v == 1 else 0 for i in range(p)] if per_stage is not None else None
        saved_cache = self.dp_cache
        if uniform_key >= 0:
            self.dp_cache = {}
        try:
            best: tuple | None = None
            for group in groups:
                U, stage_info = [], []
                for i in range(p):
                    if starts_even is not None:
                        assert per_stage is not None
                        vals, infos, which = self.stage_values(cfg, tab, i, group[i], per_stage[i], per_stage[i],
                                                               starts_even[i])
                    elif self.p.homogeneous:
                        vals, infos, which = self.stage_values(cfg, tab, i, group[i], lo, hi, 0)
                    else:  # layer types vary along the model: a stage's cost depends on its first layer
                        vals = np.full((self.L + 1, hi + 1), np.inf)
                        by_start = {}
                        first = max(i * lo, self.L - (p - i) * hi)
                        for st in range(first, min(i * hi, self.L - (p - i) * lo) + 1):
                            top = min(hi, self.L - st)
                            vs, inf_s, wh = self.stage_values(cfg, tab, i, group[i], lo, top, st)
                            vals[st, :top + 1] = vs
                            by_start[st] = (inf_s, wh)
                        infos, which = by_start, None  # type: ignore[assignment]
                    U.append(vals / cfg.m)
                    stage_info.append((infos, which))
                got = self._place(U, cfg, per_stage, lo, hi)
                if got is not None and (best is None or got[1] < best[0]):
                    best = (got[1], got[0], group, stage_info)
            if best is None:
                return None
            _, counts, group, stage_info = best
            paths, edges = [], []
            starts = [int(x) for x in np.cumsum([0] + list(counts[:-1]))]
            for i, n in enumerate(counts):
                infos, which = stage_info[i]
                if which is None:  # heterogeneous uneven: per-start results
                    infos, which = infos[starts[i]]
                    start = starts[i]
                else:
                    start = starts_even[i] if starts_even is not None else 0
                k = int(which[n])
                edges.append(group[i][k])
                paths.append(self.stage_path(cfg, tab, infos[k], n, start))
        finally:
            self.dp_cache = saved_cache
        strategies: list[LayerStrategy] = []
        if v == 1:
            for path in paths:
                strategies += path
            pp_division = tuple(counts)
        else:  # stage i owns chunks i, i+p, ...; hand out its layers chunk by chunk
            assert division is not None
            cursor = [0] * p
            for c in range(chunks):
                i = c % p
                strategies += paths[i][cursor[i]:cursor[i] + division[c]]
                cursor[i] += division[c]
            pp_division = tuple(division)
        return self._finish(cfg, tuple(strategies), pp_division, edges[0][0], edges[-1][1])

    # -- what would fit ---------------------------------------------------------------------------------
    def smallest_fit(self, cfg: _Config) -> tuple[float, str] | None:
        """Peak memory of the leanest plan of this configuration (uniform leanest strategy, even split)."""
        S = self.world // cfg.pp
        mb = cfg.global_batch // cfg.m
        tab, edges = self.table(S, mb), self.edge_options(S, mb)
        if tab is None or not edges:
            return None
        division = even_division(self.L, cfg.pp * cfg.v)
        peak = 0.0
        for i in range(cfg.pp):
            ctx = StageContext(S, mb, cfg.m, cfg.pp, i, cfg.schedule, cfg.v)
            fixed = min(self.fixed(e, e, ctx)[2] for e in edges)  # the leanest embedding/head
            n = sum(division[c] for c in range(i, cfg.pp * cfg.v, cfg.pp))
            mem = tab.states + ctx.inflight * tab.act
            t = self.p.layer_type_of[0]
            j = int(np.argmin(n * mem[t] + tab.transient[t]))
            peak = max(peak, fixed + n * mem[t, j] + tab.transient[t, j])
        desc = f"pp={cfg.pp} {cfg.schedule} m={cfg.m} batch={cfg.global_batch}"
        return peak, desc


def _as_profile(model: ModelProfile | ModelShape) -> ModelProfile:
    if isinstance(model, ModelProfile):
        return model
    if isinstance(model, ModelShape):
        return ModelProfile.from_shape(model)
    raise TypeError(f"model={type(model).__name__}: expected ModelProfile or ModelShape. HINT: pass "
                    "model.galv_shape() or a profile from ModelProfiler / compat.galvatron.")


def _batches(global_batch: int | Sequence[int] | range) -> list[int]:
    if isinstance(global_batch, bool):
        raise TypeError(f"global_batch={global_batch!r}: must be an int or a sequence of ints. HINT: global_batch=64.")
    values = [global_batch] if isinstance(global_batch, int) else list(global_batch)
    if not values or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values):
        raise bad_value(f"global_batch={global_batch}", "must be a positive int or a non-empty sequence of them",
                        "global_batch=64 or global_batch=range(8, 129, 8).")
    return sorted(set(values))


def search(model: ModelProfile | ModelShape, hw: HardwareProfile, world_size: int | None = None,
           memory_budget_bytes: float | None = None, *, global_batch: int | Sequence[int] = 8,
           top_k: int = 5, space: SearchSpace | None = None, cost_model: CostModel | None = None,
           memory_margin: float = DEFAULT_MEMORY_MARGIN) -> SearchResult:
    """The ``top_k`` fastest plans (by throughput) that fit ``memory_budget_bytes`` per device.

    ``model`` is a measured/imported :class:`ModelProfile`, or a :class:`ModelShape` (then an analytic
    profile is used). ``world_size`` defaults to the hardware profile's; the budget to its device
    memory. ``global_batch`` is one value or a range to sweep: plans are ranked by samples/second, ties
    going to the larger batch (fewer optimizer steps for the same samples). Raises ``ValueError`` with
    the smallest budget that would fit when nothing does. Plans must fit ``memory_budget_bytes x
    (1 - memory_margin)`` (see the module docstring for why the margin exists).
    """
    t_start = time.perf_counter()
    profile = _as_profile(model)
    if not isinstance(hw, HardwareProfile):
        raise TypeError(f"hw={type(hw).__name__}: expected HardwareProfile. HINT: HardwareProfile.uniform(...).")
    world = hw.world_size if world_size is None else world_size
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise bad_value(f"world_size={world_size}", "must be a positive int", "e.g. world_size=8.")
    budget = hw.device_memory_bytes if memory_budget_bytes is None else float(memory_budget_bytes)
    if not budget > 0:
        raise bad_value(f"memory_budget_bytes={memory_budget_bytes}", "must be > 0", "e.g. 40 * 2**30 for 40 GiB.")
    if isinstance(memory_margin, bool) or not isinstance(memory_margin, (int, float)) or not 0 <= memory_margin < 1:
        raise bad_value(f"memory_margin={memory_margin}", "must be a fraction in [0, 1)",
                        f"e.g. memory_margin={DEFAULT_MEMORY_MARGIN} keeps 2 % of the budget free; 0 uses all of it.")
    given = budget
    budget = given * (1.0 - memory_margin)  # what plans may use
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise bad_value(f"top_k={top_k}", "must be a positive int", "top_k=5.")
    space = space or SearchSpace()
    cost = cost_model or GalvatronCostModel(profile, hw, space.default_embed_zero)
    batches = _batches(global_batch)
    s = _Searcher(profile, hw, world, budget, space, cost)
    L = profile.num_layers

    configs: list[_Config] = []
    pps = space.pp_degrees or tuple(divisors(world))
    for G in batches:
        for pp in pps:
            if world % pp or pp > L or (space.max_pp and pp > space.max_pp):
                continue
            ms = space.micro_batches or tuple(divisors(G))
            for m in ms:
                if G % m or (space.max_micro_batches and m > space.max_micro_batches):
                    continue
                for sched in (space.schedules if pp > 1 else ("1f1b",)):
                    for v in ((1,) if sched != "interleaved_1f1b" else space.virtual_stages):
                        if pp > 1 and sched != "gpipe" and m < pp:
                            continue
                        if sched == "interleaved_1f1b" and (v < 2 or m % pp or L < pp * v):
                            continue
                        configs.append(_Config(G, pp, sched, v, m))
    if not configs:
        raise bad_value(f"world_size={world}, global_batch={batches}", "no pipeline configuration is possible",
                        "check that the global batch is divisible by the micro-batch counts and pp <= layers.")

    # optimistic bound per unit of work: a configuration, or in the uniform space a (configuration,
    # strategy) pair -- the 3-D space then prunes strategies, not just pipeline shapes
    units: list[_Config] = []
    for cfg in configs:
        S, mb = world // cfg.pp, cfg.global_batch // cfg.m
        tab = s.table(S, mb)
        if tab is None or not s.edge_options(S, mb):
            cfg.bound = math.inf
            continue
        if space.uniform:
            bounds = s.lower_bounds(cfg, tab, per_strategy=True)
            units += [replace(cfg, j=j, bound=float(bd)) for j, bd in enumerate(bounds)]
        else:
            cfg.bound = float(s.lower_bounds(cfg, tab, per_strategy=False)[0])
            units.append(cfg)
    units.sort(key=lambda c: c.bound / c.global_batch)

    best_of: dict[tuple, tuple[ParallelPlan, int]] = {}  # configuration -> (its best plan, strategy index)
    found: list[ParallelPlan] = []
    for n_done, unit in enumerate(units):
        # units come in order of their throughput bound: once one cannot reach the k-th best (compared
        # as the ranking rounds it), none of the rest can
        if len(found) >= top_k and unit.bound > 0 and _tput_key(unit.global_batch / unit.bound) < _tput_key(
                found[-1].prediction.throughput):  # type: ignore[union-attr]
            s.stats["pruned_by_bound"] += len(units) - n_done
            break
        s.stats["configs"] += 1
        plan = s.solve(unit)
        if plan is None:
            s.stats["infeasible"] += 1
            continue
        assert plan.prediction is not None
        prev = best_of.get(unit.key)
        if prev is not None:  # uniform space: keep the configuration's fastest strategy (lower index on ties)
            old, old_j = prev
            assert old.prediction is not None
            if (plan.prediction.step_time_s, unit.j) >= (old.prediction.step_time_s, old_j):
                continue
            found = [f for f in found if f is not old]
        best_of[unit.key] = (plan, unit.j)
        found.append(plan)
        found.sort(key=_rank_key)
        del found[top_k:]
    wall = time.perf_counter() - t_start
    s.stats["wall_s"] = wall
    if not found:
        fits = [r for r in (s.smallest_fit(c) for c in configs if math.isfinite(c.bound)) if r is not None]
        need, how = min(fits) if fits else (math.inf, "none")
        need /= 1.0 - memory_margin  # the budget to ask for, margin included
        raise ValueError(
            f"memory_budget_bytes={given:.0f} ({given / GiB:.2f} GiB, {budget / GiB:.2f} GiB usable after the "
            f"{memory_margin:.0%} margin): no plan fits on {world} devices for "
            f"global batch {batches}; the smallest memory that would fit is {need / GiB:.2f} GiB "
            f"({need:.0f} bytes, {how}). HINT: raise the budget to at least {need / GiB:.2f} GiB, lower the "
            f"global batch, or allow more ZeRO stages / checkpointing / pipeline stages in the SearchSpace.")
    s.stats["usable_budget_bytes"] = budget
    return SearchResult(found, explain(found, profile, s.stats, budget, batches, given), s.stats)


def _tput_key(throughput: float) -> float:
    """Throughput rounded to 5 significant digits: closer plans count as tied in the ranking."""
    return round(throughput, 4 - int(math.floor(math.log10(throughput))))


def _rank_key(plan: ParallelPlan) -> tuple:
    assert plan.prediction is not None
    # throughput first; near-ties (0.01 %) go to the larger batch, then to fewer micro-batches and 1F1B
    return (-_tput_key(plan.prediction.throughput),
            -(plan.global_batch or 0), plan.micro_batches, SCHEDULES.index(plan.pipeline_schedule) != 1)


def explain(plans: Sequence[ParallelPlan], profile: ModelProfile, stats: dict[str, float], budget: float,
            batches: list[int], given: float | None = None) -> str:
    """Why the winner won, in a few lines: what was searched, the winner, and the runners-up."""
    best = plans[0]
    assert best.prediction is not None
    lines = [f"searched {int(stats['configs'])} pipeline configurations ({int(stats['pruned_by_bound'])} skipped by "
             f"bound, {int(stats['infeasible'])} without a fitting plan; {int(stats['dp_runs'])} layer DPs, "
             f"{int(stats['shortcuts'])} closed-form) in {stats.get('wall_s', 0.0):.3f} s under "
             f"{budget / GiB:.2f} GiB per device"
             + (f" ({given / GiB:.2f} GiB less the safety margin)" if given is not None and given != budget else ""),
             best.describe()]
    counts = list(best.pp_division or ())
    if best.pp > 1 and len(set(counts)) > 1:
        lines.append(f"  uneven stages {counts}: stages differ in memory (in-flight micro-batches, embedding/head), "
                     "so balancing the step time moved layers between them")
    ck = sum(s.checkpoint for s in best.layers)
    if ck:
        lines.append(f"  {ck} layers recompute activations: without it the stage would not fit {budget / GiB:.2f} GiB")
    if len(batches) > 1:
        lines.append(f"  batch sweep {batches[0]}..{batches[-1]}: best throughput at global batch {best.global_batch}")
        if profile.per_sample_only:
            lines.append("  note: the time profile is per-sample (no per-call constant), so batch sizes differ only "
                         "by per-step costs (gradient sync, optimizer step, bubble); profile >= 2 batch sizes for "
                         "micro-batch efficiency")
    for rank, p in enumerate(plans[1:], start=2):
        assert p.prediction is not None
        lines.append(f"  #{rank}: pp{p.pp} {p.pipeline_schedule} m={p.micro_batches} batch={p.global_batch} "
                     f"{_summary(p)}: {p.prediction.step_time_s * 1e3:.1f} ms, {p.prediction.throughput:.2f} samples/s "
                     f"({p.prediction.throughput / best.prediction.throughput:.3f}x)")
    return "\n".join(lines)


def _summary(plan: ParallelPlan) -> str:
    kinds = sorted({s.short() for s in plan.layers})
    return ",".join(kinds[:3]) + ("..." if len(kinds) > 3 else "")
