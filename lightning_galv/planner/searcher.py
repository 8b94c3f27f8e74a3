"""Solving one pipeline configuration: cost tables, end strategies, per-stage layer DPs, the partition.

The outer loop (:func:`lightning_galv.planner.search.search`) hands the :class:`Searcher` one
:class:`Config` at a time -- global batch, pipeline degree, schedule, virtual stages, micro-batch
count -- and gets back the best plan of that configuration, or None when nothing fits. The searcher
only talks to the cost model through :class:`~lightning_galv.planner.cost.CostModel`: it tabulates
layer costs per (stage size, micro-batch) (:class:`CostTable`), drops dominated embedding/head
options, runs the layer DP (:mod:`.layer_dp`) per stage and end option, places layers on stages
(:mod:`.partition`) and prices the result with ``CostModel.evaluate``.

Everything it computes is memoized across configurations: tables by (stage size, micro-batch), stage
DPs by what they depend on, the ends' fixed costs by (embedding, head, stage context) -- one table
serves every pipeline degree and micro-batch count of a batch sweep that lands on the same pair.
Layer DPs without transition costs run on Pareto fronts (:class:`~.layer_dp.LayerFronts`), memoized by
content for every capacity at once: stages that differ only in their ends' memory share one run.

In the uniform ("3-D") space a unit is a (configuration, strategy) pair and a stage's cost is
closed-form (n identical layers), so that space needs no layer DP at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..plan import LayerStrategy, ParallelPlan, Prediction, even_division
from .cost import CostModel, LayerCost, StageContext, batch_layout, chunk_ends, data_strategy
from .layer_dp import FrontsMemo, LayerFronts, layer_dp
from .pareto import pareto_keep
from .partition import place, stage_layer_ranges
from .profiles import HardwareProfile, ModelProfile
from .space import SearchSpace, SequenceSplitEnd, applies, candidate_strategies, end_strategies

Edge = tuple[LayerStrategy, LayerStrategy]  # (embedding, head) strategies as one stage sees them
# memory, in budgets, of a (layer type, strategy) pair that cannot be applied: finite, so the memory grid's
# integer conversion stays exact, and larger than any budget, so the pair never fits
NEVER_FITS = 4.0


@dataclass(frozen=True)
class CostTable:
    """Per-candidate layer costs of one (stage size, micro-batch) context, as arrays for the layer DP.

    One row per layer type: the search prices the first layer of each type and reuses it (the cost
    model contract: ``layer_cost`` depends on the layer only through its type). Transitions are priced
    once per pair of activation layouts (``cls``), not per pair of strategies. A strategy that does not
    apply to a layer type (ep > 1 on a dense layer) is not priced: its time is infinite and its memory
    :data:`NEVER_FITS` budgets, so no layer DP ever places it there.
    """

    strategies: list[LayerStrategy]
    fb: np.ndarray  # [type, j] fwd+bwd seconds per micro-batch
    extra: np.ndarray  # [type, j] seconds per step
    states: np.ndarray  # [type, j] bytes
    act: np.ndarray  # [type, j] bytes per in-flight micro-batch
    transient: np.ndarray  # [type, j] bytes
    cls: np.ndarray  # [j] layout class
    trans: np.ndarray  # [K, K] seconds per micro-batch
    partial: bool = False  # some strategy does not apply to some layer type (ep on a model with dense layers)


@dataclass(frozen=True)
class Config:
    """One unit of the outer loop: a pipeline configuration, in the uniform space also one strategy."""

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


def level_costs(c_all: np.ndarray, r_all: np.ndarray, layer_types: np.ndarray,
                tau: float) -> tuple[np.ndarray, np.ndarray]:
    """(strategies usable at transient level ``tau``, their costs per layer position [n, allowed]).

    A (layer, strategy) pair whose recompute transient exceeds ``tau`` is out of this level: infinite cost
    at that position only. The same strategy may stay in for a layer of another type whose transient is
    smaller -- excluding it for every layer would lose optima of heterogeneous models (a checkpointed
    dense block beside an MoE block whose recompute peak is larger).
    """
    ok = r_all[layer_types] <= tau + 1e-6  # [n, J]
    some, every = ok.any(axis=0), ok.all(axis=0)
    allowed = np.flatnonzero(some)
    c = c_all[layer_types][:, allowed]
    if not np.array_equal(some, every):  # only heterogeneous windows can differ by position
        c = np.where(ok[:, allowed], c, np.inf)
    return allowed, c


class Searcher:
    """The best plan of each pipeline configuration, for one (profile, hardware, world, budget, space, cost model).

    ``stats`` counts what happened (configurations solved, DPs run, closed-form shortcuts, options
    skipped by bounds); the search reports it in its explanation.
    """

    def __init__(self, profile: ModelProfile, hw: HardwareProfile, world: int, budget: float,
                 space: SearchSpace, cost: CostModel, memo: FrontsMemo | None = None) -> None:
        self.p, self.hw, self.world, self.budget, self.space, self.cost = profile, hw, world, budget, space, cost
        self.L = profile.num_layers
        self.types = sorted(set(profile.layer_type_of))
        self.grid = budget / space.memory_bins
        # layer DPs without transition costs, by content (may be shared with other searches: search(memo=))
        self.memo = memo if memo is not None else FrontsMemo()
        self.dp_limit = int(math.floor(budget / self.grid + 1e-9)) + 1
        self.tables: dict[tuple, CostTable | None] = {}
        self.fixed_cache: dict[tuple, tuple[float, float, float]] = {}
        self.edge_cache: dict[tuple, list[LayerStrategy]] = {}
        self.dp_cache: dict[tuple, tuple[np.ndarray, np.ndarray, list]] = {}
        self.stats = {"configs": 0, "pruned_by_bound": 0, "infeasible": 0, "dp_runs": 0, "shortcuts": 0,
                      "levels_skipped": 0, "edges_skipped": 0}

    # -- cost tables and bounds ----------------------------------------------------------------------
    def table_ctx(self, S: int, mb: int, cfg: Config | None = None) -> StageContext:
        """The context tables are built in: stage 0 of the configuration (no pipeline, one micro-batch if none)."""
        if cfg is None:
            return StageContext(S, mb, 1)
        return StageContext(S, mb, cfg.m, cfg.pp, 0, cfg.schedule, cfg.v)

    def table(self, S: int, mb: int, cfg: Config | None = None) -> CostTable | None:
        """Per-strategy layer costs of a stage of ``S`` ranks at micro-batch ``mb`` in configuration ``cfg``.

        Keyed by (S, mb) and the cost model's :meth:`~.cost.CostModel.context_key` of the configuration: layer
        costs and transitions depend on the micro-batch count or the pipeline only through that key (the
        contract checks it), so one table serves every (pp, m) of a batch sweep that lands on the same triple.
        """
        ctx = self.table_ctx(S, mb, cfg)
        key = (S, mb, self.cost.context_key(ctx))
        if key in self.tables:
            return self.tables[key]
        if not self.cost.admits(S, mb):
            self.tables[key] = None
            return None
        strategies = candidate_strategies(self.p.shape, S, mb, self.space, self.hw, self.p.num_experts)
        if not strategies:
            self.tables[key] = None
            return None
        top_ep = max(s.ep for s in strategies)
        if top_ep > self.stats.get("max_ep", 1):  # for the explanation; dense searches never set it
            self.stats["max_ep"] = top_ep
        T, J = len(self.p.layer_types), len(strategies)
        fb, extra, states, act, tr = (np.zeros((T, J)) for _ in range(5))
        first_layer_of_type = {t: self.p.layer_type_of.index(t) for t in self.types}
        for t, li in first_layer_of_type.items():
            lt = self.p.layer_types[t]
            for j, s in enumerate(strategies):
                if s.ep > 1 and not applies(lt, s):  # ep on a layer without (enough) experts
                    fb[t, j] = extra[t, j] = np.inf
                    states[t, j] = NEVER_FITS * self.budget
                    continue
                lc: LayerCost = self.cost.layer_cost(li, s, ctx)
                fb[t, j], extra[t, j], states[t, j], act[t, j], tr[t, j] = (
                    lc.fwd + lc.bwd, lc.step_extra, lc.states, lc.act, lc.transient)
        classes: dict[tuple, int] = {}
        reps: list[LayerStrategy] = []
        cls = np.zeros(J, dtype=np.int64)
        for j, s in enumerate(strategies):
            key2 = batch_layout(s)
            if key2 not in classes:
                classes[key2] = len(classes)
                reps.append(s)
            cls[j] = classes[key2]
        K = len(reps)
        if self.space.uniform:  # one strategy for all layers: activations never change layout
            trans = np.zeros((K, K))
        else:
            trans = np.array([[self.cost.transition_time(a, b, ctx) for b in reps] for a in reps]).reshape(K, K)
        partial = not bool(np.isfinite(fb[self.types]).all())
        tab = CostTable(strategies, fb, extra, states, act, tr, cls, trans, partial)
        self.tables[key] = tab
        return tab

    def lower_bounds(self, cfg: Config, tab: CostTable, per_strategy: bool) -> np.ndarray:
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

    # -- embedding and head ---------------------------------------------------------------------------
    def edge_options(self, S: int, mb: int) -> list[LayerStrategy]:
        """:func:`~.space.end_strategies` of a stage of ``S`` ranks at micro-batch ``mb``, memoized."""
        key = ("edges", S, mb)
        hit = self.edge_cache.get(key)
        if hit is None:
            hit = self.edge_cache[key] = end_strategies(self.p.shape, S, mb, self.space, self.hw)
        return hit

    def edge_front(self, S: int, mb: int, first: bool, cfg: Config | None = None) -> list[LayerStrategy]:
        """Options of one end (embedding or head) that no other option beats in time, extra and memory.

        Dominance is checked on the end's own cost (``end_cost``), which is exact whenever embedding
        and head are priced separately (different stages, or different strategies on one stage) and the
        options share a dp degree. Across dp degrees it is not, with a pipeline: the stage's boundary
        sends are sized by the embedding's (head's) dp and are not part of ``end_cost``, so an option
        dominated here can still have the faster stage (the contract checks the same-dp case only).
        The uniform (3-D) space searches the ends' degree too: tying it to the layers' tp would leave
        out plans Galvatron's 3-D search has (its vtp is searched beside the layers' tp).
        """
        opts = self.edge_options(S, mb)
        ctx = self.table_ctx(S, mb, cfg)
        key = ("front", S, mb, first, self.cost.context_key(ctx))
        hit = self.edge_cache.get(key)
        if hit is not None:
            return hit
        cs = [self.cost.end_cost(e, ctx, first, not first, self.space.vocab_parallel_loss) for e in opts]
        vec = np.array([[c.fwd + c.bwd, c.step_extra, c.states, c.act, c.transient] for c in cs]).reshape(len(cs), 5)
        keep = [e for e, kept in zip(opts, pareto_keep(vec.T)) if kept]
        self.edge_cache[key] = keep
        return keep

    def tied_edges(self, cfg: Config, S: int, mb: int) -> list[list[list[Edge]]]:
        """``SearchSpace.tied_ends``: one strategy for both ends (Galvatron's one vtp / vsp / embed_sdp), each
        option its own group, minus options another is no worse than on the first, a middle and the last stage."""
        p = cfg.pp
        opts = self.edge_options(S, mb)
        if not opts:
            return []
        ctxs = [StageContext(S, mb, cfg.m, p, i, cfg.schedule, cfg.v) for i in sorted({0, min(1, p - 1), p - 1})]
        vec = np.array([[x for c in ctxs for x in self.fixed_net(e, e, c)] for e in opts]).reshape(len(opts), -1)
        keep = [e for e, kept in zip(opts, pareto_keep(vec.T)) if kept]
        return [[[(e, e)] for _ in range(p)] for e in keep]

    def stage_edges(self, cfg: Config, S: int, mb: int) -> list[list[list[Edge]]]:
        """Candidate (embedding, head) strategies per stage, in groups that are solved one by one.

        The embedding only costs on stage 0 and the head only on the last stage, so each stage picks
        its own end independently -- except that the cost model sizes the stage-boundary sends of the
        middle stages by the embedding's dp: with pp >= 3 the embedding options are grouped by dp and
        each group is solved separately. With pp = 1 both ends share the stage: pairs are priced jointly.
        """
        p = cfg.pp
        if self.space.tied_ends:
            return self.tied_edges(cfg, S, mb)
        emb = self.edge_front(S, mb, True, cfg)
        head = self.edge_front(S, mb, False, cfg)
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
        """Edges of one stage not beaten by another in mb time, step extra, memory, and memory net of what the head
        frees before backward (:meth:`fixed_net`)."""
        vec = np.array([self.fixed_net(e, h, ctx) for e, h in edges]).reshape(len(edges), 4)
        return [edge for edge, kept in zip(edges, pareto_keep(vec.T)) if kept]

    def fixed_net(self, emb: LayerStrategy, head: LayerStrategy, ctx: StageContext
                  ) -> tuple[float, float, float, float]:
        """:meth:`fixed` and, fourth, its memory less :meth:`~.cost.CostModel.backward_freed`: a stage's peak is
        ``max(fixed, fixed - freed + transient)`` (a checkpointed layer recomputes after the head's activations
        are gone), so an end option is beaten only by one no worse in both. With the memory alone, a head that
        frees more before backward was dropped for one that held less in forward, and a stage of checkpointed
        layers then found no fitting plan where one existed -- whether it did depended on which option was
        faster, i.e. on the hardware's timings (tests/test_planner_search.py)."""
        t, e, mem = self.fixed(emb, head, ctx)
        return t, e, mem, mem - self.cost.backward_freed(head, ctx, self.space.vocab_parallel_loss)

    def fixed(self, emb: LayerStrategy, head: LayerStrategy, ctx: StageContext) -> tuple[float, float, float]:
        """``stage_fixed`` memoized: the same (stage, micro-batch) recurs for every strategy of the 3-D space."""
        key = (emb, head, ctx)
        hit = self.fixed_cache.get(key)
        if hit is None:
            hit = self.fixed_cache[key] = self.cost.stage_fixed(emb, head, ctx, self.space.vocab_parallel_loss)
        return hit

    # -- one stage: layer DP per transient level, per end option ----------------------------------------
    def stage_costs(self, cfg: Config, tab: CostTable, stage: int, edge: tuple[LayerStrategy, LayerStrategy],
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
            if types is None:  # one layer type: a strategy is in or out of the level for every layer
                allowed = np.flatnonzero(r_all[layer_types[0]] <= tau + 1e-6)
                c = c_all[layer_types][:, allowed]
            else:
                allowed, c = level_costs(c_all, r_all, layer_types, tau)
            if len(allowed) == 0:
                continue
            # every layer at its fastest allowed strategy, memory and transitions ignored: if even that
            # cannot beat what lower transient levels already reach for n_lo..n_hi, skip this level's DP
            lb = np.concatenate(([0.0], np.cumsum(c.min(axis=1))))
            if np.all(lb[n_lo:] >= vals[n_lo:]):
                self.stats["levels_skipped"] += 1
                continue
            q = q_all[layer_types][:, allowed]
            cl = tab.cls[allowed]
            level = (c, q, cl)  # the level's whole strategy set, as stage_path sees it
            if types is None:  # drop dominated strategies (exact: same class, no better anywhere)
                keep = pareto_keep((c[0], q[0], r_all[layer_types[0], allowed]), cl)
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
            elif tab.partial:  # per-type columns: dominated on every layer type of the window (exact too)
                present = sorted(set(int(x) for x in layer_types))
                rows = [int(np.flatnonzero(layer_types == t)[0]) for t in present]
                cols = [col for r, t in zip(rows, present) for col in (c[r], q[r], r_all[t, allowed])]
                keep = pareto_keep(cols, cl)
                allowed, c, q, cl = allowed[keep], c[:, keep], q[:, keep], cl[keep]
            self.stats["dp_runs"] += 1
            best = self._dp_values(c, q, cl, trans, n_hi, capacity, level)
            better = best < vals
            better[0] = False
            vals = np.where(better, best, vals)
            for n in np.flatnonzero(better):
                choice["by_n"][int(n)] = ("dp", li, tau)
        self.dp_cache[key] = (vals, None, [info | {}])
        info["choice"] = choice
        self.dp_cache[key][2][0].update({"choice": choice})
        return vals + base, info

    def _dp_values(self, c: np.ndarray, q: np.ndarray, cls: np.ndarray, trans: np.ndarray, n_max: int,
                   capacity: int, level: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
        """``layer_dp(...)[0]`` on the pruned strategies ``c`` / ``q`` / ``cls``. Without transition costs, from
        the memoized fronts of the ``level``'s whole strategy set instead: dominated strategies never reach a
        front, so the values are the same, and that is the set :meth:`stage_path` rebuilds paths on -- one
        forward pass serves both, and every capacity (end options and search contexts differ only in
        fixed memory)."""
        if trans.any():
            return layer_dp(c, q, cls, trans, n_max, capacity)[0]
        return self._fronts(*level, capacity).best(n_max, capacity)

    def _fronts(self, c: np.ndarray, q: np.ndarray, cls: np.ndarray, capacity: int) -> LayerFronts:
        """The memo's fronts of a transition-free layer DP, built for every capacity up to the whole budget
        (so the same layers under another end option or search context find them)."""
        return self.memo.get(c, q, cls, max(self.dp_limit, capacity + 1))

    def stage_path(self, cfg: Config, tab: CostTable, info: dict, n: int, start: int) -> list[LayerStrategy]:
        """Reconstruct the strategies of the n layers chosen for a stage."""
        how, a, tau = info["choice"]["by_n"][n]
        if how == "uniform":
            return [tab.strategies[a]] * n
        k = info["ctx"].inflight
        layer_types = np.array(self.p.layer_type_of[start:start + n])
        c_all = cfg.m * tab.fb + tab.extra
        q_all = np.ceil((tab.states + k * tab.act) / self.grid - 1e-9).astype(np.int64)
        allowed, c = level_costs(c_all, tab.transient, layer_types, tau)
        capacity = int(math.floor((self.budget - info["fixed_mem"] - max(0.0, tau - info["freed"])) / self.grid + 1e-9))
        q, cl, trans = q_all[layer_types][:, allowed], tab.cls[allowed], cfg.m * tab.trans
        if trans.any():
            _, path = layer_dp(c, q, cl, trans, n, capacity, want_path=n)
        else:
            path = self._fronts(c, q, cl, capacity).path(n, capacity)
        assert path is not None
        return [tab.strategies[allowed[j]] for j in path]

    def stage_values(self, cfg: Config, tab: CostTable, stage: int, edges: list[Edge], n_lo: int, n_hi: int,
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

    # -- one configuration ------------------------------------------------------------------------------
    def solve(self, cfg: Config) -> ParallelPlan | None:
        """The best plan of ``cfg`` (priced by the cost model), or None when none of it fits."""
        S = self.world // cfg.pp
        mb = cfg.global_batch // cfg.m
        tab = self.table(S, mb, cfg)
        if tab is None:
            return None
        groups = self.stage_edges(cfg, S, mb)
        if not groups:
            return None
        if cfg.j >= 0 and self.p.homogeneous:
            return self._solve_uniform(cfg, tab, groups)
        if cfg.j >= 0:
            j = cfg.j
            sub = CostTable([tab.strategies[j]], tab.fb[:, [j]], tab.extra[:, [j]], tab.states[:, [j]],
                            tab.act[:, [j]], tab.transient[:, [j]], np.zeros(1, dtype=np.int64), np.zeros((1, 1)))
            return self._solve_with(cfg, sub, groups, uniform_key=j)
        plan = self._solve_with(cfg, tab, groups)
        if self.cost.prices_boundaries and self.p.homogeneous:
            # the layer DP does not see the re-layouts at the chunk edges (CostModel.boundary_time); the uniform
            # plans, priced with them in closed form, compete with its answer
            for j in range(len(tab.strategies)):
                u = self._solve_uniform(replace(cfg, j=j), tab, groups)
                if u is not None and (plan is None or u.prediction.step_time_s < plan.prediction.step_time_s):
                    plan = u
        return plan

    def _solve_uniform(self, cfg: Config, tab: CostTable, groups: list[list[list[Edge]]]) -> ParallelPlan | None:
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
        division, lo, hi = stage_layer_ranges(self.L, cfg.pp, cfg.v, self.space.uneven_partition)
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
                    ft += self._uniform_boundaries(tab.strategies[j], e, h, ctx, i)
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
            got = place(U, self.L, cfg.m, cfg.v, per_stage, lo, hi)
            if got is not None and (best is None or got[1] < best[0]):
                counts = got[0]
                best = (got[1], counts, [group[i][int(picks[i][counts[i]])] for i in range(p)])
        if best is None:
            return None
        _, counts, edges = best
        div = tuple(counts) if per_stage is None else tuple(division)  # type: ignore[arg-type]
        return self._finish(cfg, (tab.strategies[j],) * L, div, edges[0][0], edges[-1][1])

    def _uniform_boundaries(self, s: LayerStrategy, embed: LayerStrategy, head: LayerStrategy, ctx: StageContext,
                            stage: int) -> float:
        """Per micro-batch: the re-layouts at the edges of stage ``stage``'s chunks when every block runs ``s``
        (``CostModel.chunk_boundary_time``), booked with the stage's fixed time -- a stage holding no block
        books them too, a slight overestimate of a layout the partition avoids anyway. The general layer DP
        does not see them (its plans are priced with them once found)."""
        p, v = ctx.pp, ctx.virtual_stages
        data = data_strategy(ctx.stage_size, max(embed.dp, s.dp, head.dp))
        t = 0.0
        for chunk in range(stage, p * v, p):
            entry, exit_ = chunk_ends(chunk, p * v, embed, head, data)
            t += self.cost.boundary_time(entry, s, s, exit_, ctx)
        return t

    def _solve_with(self, cfg: Config, tab: CostTable, groups: list[list[list[Edge]]],
                    uniform_key: int = -1) -> ParallelPlan | None:
        """The general path: per stage and end option a layer DP (:meth:`stage_values`), the partition over
        the stages' values, then the chosen stages' strategies rebuilt. ``uniform_key`` >= 0: ``tab`` is
        the one-strategy table of that strategy, whose DPs must not be cached with the full table's."""
        p, v = cfg.pp, cfg.v
        chunks = p * v
        division, lo, hi = stage_layer_ranges(self.L, cfg.pp, cfg.v, self.space.uneven_partition)
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
                got = place(U, self.L, cfg.m, cfg.v, per_stage, lo, hi)
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

    def _finish(self, cfg: Config, layers: tuple[LayerStrategy, ...], division: tuple[int, ...],
                embed: LayerStrategy, head: LayerStrategy) -> ParallelPlan | None:
        """Build the plan and price it with the full cost model (the search's objective is only a proxy).
        Sequence-split vtp-1 ends (tied, :class:`~.space.SequenceSplitEnd`) become plain ends plus the
        plan's ``vocab_sp`` flag."""
        vocab_sp = isinstance(embed, SequenceSplitEnd)
        if vocab_sp != isinstance(head, SequenceSplitEnd):
            raise AssertionError(f"vsp on one end only ({embed.short()}, {head.short()}): end_strategies offers "
                                 "SequenceSplitEnd with tied ends only")
        if vocab_sp:
            assert isinstance(embed, SequenceSplitEnd) and isinstance(head, SequenceSplitEnd)
            embed, head = embed.plain(), head.plain()
        plan = ParallelPlan(world_size=self.world, layers=layers, pp=cfg.pp, pp_division=division,
                            micro_batches=cfg.m, global_batch=cfg.global_batch, pipeline_schedule=cfg.schedule,
                            virtual_stages=cfg.v, embed=embed, head=head,
                            vocab_parallel_loss=self.space.vocab_parallel_loss, vocab_sp=vocab_sp)
        pc = self.cost.evaluate(plan)
        if pc.peak_memory_bytes > self.budget * (1 + 1e-9):  # cannot happen with the conservative grid
            return None
        # the plan was built just above and nobody else holds it: attach the prediction without a
        # second round of validation (prediction is not part of the plan's identity, compare=False)
        object.__setattr__(plan, "prediction", Prediction(pc.step_time_s, pc.throughput, pc.stage_memory_bytes))
        return plan

    def smallest_fit(self, cfg: Config) -> tuple[float, str] | None:
        """Peak memory of the leanest plan of this configuration (uniform leanest strategy, even split)."""
        S = self.world // cfg.pp
        mb = cfg.global_batch // cfg.m
        tab, edges = self.table(S, mb, cfg), self.edge_options(S, mb)
        if tab is None or not edges:
            return None
        division = even_division(self.L, cfg.pp * cfg.v)
        peak = 0.0
        for i in range(cfg.pp):
            ctx = StageContext(S, mb, cfg.m, cfg.pp, i, cfg.schedule, cfg.v)
            fixed = min(self.fixed(e, e, ctx)[2] for e in edges)  # the leanest embedding/head
            n = sum(division[c] for c in range(i, cfg.pp * cfg.v, cfg.pp))
            mem = tab.states + ctx.inflight * tab.act
            if not self.p.homogeneous:  # layer types differ in memory (and ep applies to some): each its leanest
                types_here = [self.p.layer_type_of[li] for c in range(i, cfg.pp * cfg.v, cfg.pp)
                              for li in range(sum(division[:c]), sum(division[:c + 1]))]
                need = worst = 0.0
                for t in sorted(set(types_here)):
                    k = types_here.count(t)
                    j = int(np.argmin(k * mem[t] + tab.transient[t]))
                    need, worst = need + k * mem[t, j], max(worst, float(tab.transient[t, j]))
                peak = max(peak, fixed + need + worst)
                continue
            t = self.p.layer_type_of[0]
            j = int(np.argmin(n * mem[t] + tab.transient[t]))
            peak = max(peak, fixed + n * mem[t, j] + tab.transient[t, j])
        desc = f"pp={cfg.pp} {cfg.schedule} m={cfg.m} batch={cfg.global_batch}"
        return peak, desc
