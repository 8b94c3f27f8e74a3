"""Search for the fastest hybrid-parallel plan that fits in memory.

Structure (Galvatron VLDB'23, Galvatron-BMW TKDE'24), outermost first, one module per step:

1. **Outer loop** (here, :func:`search`) over global batch (fixed or a range), pipeline degree (any
   divisor of the world size), schedule (GPipe / 1F1B / interleaved 1F1B) and micro-batch count.
   Configurations are visited in order of an optimistic lower bound on step time and skipped once the
   bound cannot beat the k-th best plan found so far; each is solved by :mod:`.searcher`. In the
   uniform ("3-D") space the unit is a (configuration, strategy) pair with its own bound.
2. **Decision tree** per stage size (:mod:`.space`): the per-layer strategy space is enumerated and
   pruned by Galvatron's guideline rules, then by exact dominance (:mod:`.pareto`).
3. **Dynamic programming over layers** per stage under the memory budget with inter-layer transition
   costs (:mod:`.layer_dp`); one run yields the best cost for every layer count.
4. **Joint stage partition** (:mod:`.partition`): layer counts per stage minimizing the pipeline step
   time given each stage's memory-constrained cost -- uneven partitions come out when they are faster.

Plans are priced through the :class:`~lightning_galv.planner.cost.CostModel` interface only, so any
implementation can be searched with (``cost_model=``); :mod:`.explain` words the result.

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
from dataclasses import replace
from typing import Iterable, Sequence

from ..errors import bad_value
from ..plan import SCHEDULES, ModelShape, ParallelPlan, divisors
from .cost import CostModel, GalvatronCostModel
from ..units import format_bytes
from .explain import explain
from .layer_dp import FrontsMemo
from .profiles import HardwareProfile, ModelProfile
from .searcher import Config, Searcher
from .space import SearchSpace

DEFAULT_MEMORY_MARGIN = 0.02  # fraction of the budget kept free for what the cost model does not itemize


class SearchResult(list):
    """The top-k plans (best first), plus how the search went. A plain ``list[ParallelPlan]`` otherwise."""

    def __init__(self, plans: Iterable[ParallelPlan], explanation: str, stats: dict[str, float]) -> None:
        super().__init__(plans)
        self.explanation = explanation
        self.stats = stats

    @property
    def best(self) -> ParallelPlan:
        return self[0]


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
           memory_margin: float = DEFAULT_MEMORY_MARGIN, memo: FrontsMemo | None = None) -> SearchResult:
    """The ``top_k`` fastest plans (by throughput) that fit ``memory_budget_bytes`` per device.

    ``model`` is a measured/imported :class:`ModelProfile`, or a :class:`ModelShape` (then an analytic
    profile is used). ``world_size`` defaults to the hardware profile's; the budget to its device
    memory. ``global_batch`` is one value or a range to sweep: plans are ranked by samples/second, ties
    going to the larger batch (fewer optimizer steps for the same samples). Raises ``ValueError`` with
    the smallest budget that would fit when nothing does. Plans must fit ``memory_budget_bytes x
    (1 - memory_margin)`` (see the module docstring for why the margin exists). ``memo`` shares layer-DP
    results (content-addressed, so any searches may share one) between searches that repeat each other's
    stages, e.g. one per search context of a Galvatron search.
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
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model={type(cost_model).__name__}: expected a CostModel. HINT: subclass "
                        "lightning_galv.planner.CostModel (and run it through planner.contract.check_cost_model).")
    cost = cost_model or GalvatronCostModel(profile, hw, space.default_embed_zero)
    batches = _batches(global_batch)
    s = Searcher(profile, hw, world, budget, space, cost, memo)
    L = profile.num_layers

    configs: list[Config] = []
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
                        configs.append(Config(G, pp, sched, v, m))
    if not configs:
        raise bad_value(f"world_size={world}, global_batch={batches}", "no pipeline configuration is possible",
                        "check that the global batch is divisible by the micro-batch counts and pp <= layers.")

    # optimistic bound per unit of work: a configuration, or in the uniform space a (configuration,
    # strategy) pair -- the 3-D space then prunes strategies, not just pipeline shapes
    units: list[Config] = []
    solvable: list[Config] = []  # configurations with strategies for their layers and ends
    for cfg in configs:
        S, mb = world // cfg.pp, cfg.global_batch // cfg.m
        tab = s.table(S, mb, cfg)
        if tab is None or not s.edge_options(S, mb):
            continue
        solvable.append(cfg)
        if space.uniform:  # a strategy that does not apply to every layer (ep on dense ones) has no bound
            bounds = s.lower_bounds(cfg, tab, per_strategy=True)
            units += [replace(cfg, j=j, bound=float(bd)) for j, bd in enumerate(bounds) if math.isfinite(bd)]
        else:
            units.append(replace(cfg, bound=float(s.lower_bounds(cfg, tab, per_strategy=False)[0])))
    units.sort(key=lambda c: c.bound / c.global_batch)

    best_of: dict[tuple, tuple[ParallelPlan, int]] = {}  # configuration -> (its best plan, strategy index)
    found: list[ParallelPlan] = []
    for n_done, unit in enumerate(units):
        # units come in order of their throughput bound: once one cannot reach the k-th best (compared
        # as the ranking rounds it), none of the rest can
        if len(found) >= top_k and unit.bound > 0 and tput_key(unit.global_batch / unit.bound) < tput_key(
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
        found.sort(key=rank_key)
        del found[top_k:]
    wall = time.perf_counter() - t_start
    s.stats["wall_s"] = wall
    if not found:
        fits = [r for r in (s.smallest_fit(c) for c in solvable) if r is not None]
        need, how = min(fits) if fits else (math.inf, "none")
        need /= 1.0 - memory_margin  # the budget to ask for, margin included
        error = ValueError(
            f"memory_budget_bytes={given:.0f} ({format_bytes(given)}, {format_bytes(budget)} usable after the "
            f"{memory_margin:.0%} margin): no plan fits on {world} devices for "
            f"global batch {batches}; the smallest memory that would fit is {format_bytes(need)} "
            f"({need:.0f} bytes, {how}). HINT: raise the budget to at least {format_bytes(need)}, lower the "
            f"global batch, or allow more ZeRO stages / checkpointing / pipeline stages in the SearchSpace.")
        # for callers that search several configurations and report the smallest fit once (automatic mode)
        error.smallest_fit = (need, how)  # type: ignore[attr-defined]
        raise error
    s.stats["usable_budget_bytes"] = budget
    return SearchResult(found, explain(found, profile, s.stats, budget, batches, given), s.stats)


def tput_key(throughput: float) -> float:
    """Throughput rounded to 5 significant digits: closer plans count as tied in the ranking."""
    return round(throughput, 4 - int(math.floor(math.log10(throughput))))


def rank_key(plan: ParallelPlan) -> tuple:
    """Sort key of the top-k (and of automatic mode's choice among plans): best first."""
    assert plan.prediction is not None
    # throughput first; near-ties (0.01 %) go to the larger batch, then to fewer micro-batches and 1F1B
    return (-tput_key(plan.prediction.throughput),
            -(plan.global_batch or 0), plan.micro_batches, SCHEDULES.index(plan.pipeline_schedule) != 1)
