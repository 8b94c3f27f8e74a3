"""The cost-model contract: what the search assumes of any :class:`~lightning_galv.planner.cost.CostModel`,
as checks to run an implementation through.

The search is exact only relative to its cost model, and only if the model behaves the way the search's
shortcuts assume: it prices the first layer of each type and reuses the number, builds one table per
(stage size, micro-batch) for every pipeline position, prices one transition per pair of activation
layouts, drops end strategies another one dominates, and trusts ``evaluate`` to agree with the parts
it optimized. A new model (the tuner's calibrated one, a Galvatron-2.4-compatible one) that breaks one
of these would make the search silently wrong, so each is a check here::

    from lightning_galv.planner.contract import check_cost_model
    check_cost_model(MyCostModel(profile, hw), profile, world_size=4)

:func:`contract_violations` returns the broken rules as readable lines instead of raising. Pure Python:
no pytest, no torch -- usable from any test suite. Checks probe the strategies the search itself would
enumerate for ``world_size`` ranks (guideline pruning off), so the probe is as wide as the search -- for a
model with MoE layer types that includes every expert-parallel degree, each probed on the layer types it
applies to (:func:`~lightning_galv.planner.space.applies`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

from ..errors import bad_value
from ..plan import LayerStrategy, ParallelPlan, divisors
from .cost import CostModel, LayerCost, StageContext, batch_layout, pipeline_time
from .profiles import ModelProfile
from .space import SearchSpace, applies, candidate_strategies, end_strategies

REL = 1e-9  # relative tolerance of equalities: the parts and the whole are summed in different orders


@dataclass(frozen=True)
class Probe:
    """Where the contract probes a model: a stage of ``stage_size`` ranks at ``micro_batch`` samples,
    ``micro_batches`` per step, with the layer and end strategies the search would enumerate there."""

    cost: CostModel
    profile: ModelProfile
    stage_size: int
    micro_batch: int
    micro_batches: int
    layers: tuple[LayerStrategy, ...]
    ends: tuple[LayerStrategy, ...]
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b")  # of the probe's pipeline plans

    @property
    def table_ctx(self) -> StageContext:
        """The context the search builds its tables in (stage 0 of no pipeline, one micro-batch)."""
        return StageContext(self.stage_size, self.micro_batch, 1)

    def contexts(self) -> list[StageContext]:
        """Other positions with the same stage size and micro-batch: the table must serve them all."""
        S, mb, m = self.stage_size, self.micro_batch, self.micro_batches
        return [StageContext(S, mb, m), StageContext(S, mb, m, 2, 0), StageContext(S, mb, m, 2, 1),
                StageContext(S, mb, m, 3, 1, "gpipe"), StageContext(S, mb, 2 * m, 2, 0, "interleaved_1f1b", 2)]

    def first_of_type(self) -> dict[int, int]:
        return {t: self.profile.layer_type_of.index(t) for t in sorted(set(self.profile.layer_type_of))}

    def applies(self, layer: int, s: LayerStrategy) -> bool:
        """Whether the search would ever ask for ``s`` on ``layer`` (not: ep > 1 on a layer without experts)."""
        return applies(self.profile.layer(layer), s)

    def plan_layers(self, pick: Callable[[int], LayerStrategy]) -> tuple[LayerStrategy, ...]:
        """Per-layer strategies ``pick(i)``, with ep dropped to 1 where it does not apply (dense layers of an
        MoE model): the probe's plans are ones the search could emit."""
        out = []
        for i in range(self.profile.num_layers):
            s = pick(i)
            out.append(s if self.applies(i, s) else replace(s, ep=1))
        return tuple(out)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-15)


def _at_most(a: float, b: float) -> bool:
    return a <= b + REL * max(abs(a), abs(b))


def _fields(c: LayerCost) -> tuple[float, ...]:
    return (c.fwd, c.bwd, c.step_extra, c.states, c.act, c.transient)


def _same_cost(a: LayerCost, b: LayerCost) -> bool:
    return all(_close(x, y) for x, y in zip(_fields(a), _fields(b)))


# ---------------------------------------------------------------------------------------------------
# the rules
# ---------------------------------------------------------------------------------------------------
def finite_and_non_negative(p: Probe) -> Iterator[str]:
    """Every time and byte count is a finite number >= 0: the DP sums them and compares sums, and the
    memory grid rounds them up -- a negative or NaN entry would make a plan look cheaper than free."""
    ctx = p.table_ctx
    for t, layer in p.first_of_type().items():
        for s in p.layers:
            if not p.applies(layer, s):
                continue
            c = p.cost.layer_cost(layer, s, ctx)
            if not all(math.isfinite(x) and x >= 0 for x in _fields(c)):
                yield f"layer_cost(layer {layer}, {s.short()}) = {c}: a field is negative or not finite"
    for a in p.layers:
        for b in p.layers:
            x = p.cost.transition_time(a, b, ctx)
            if not (math.isfinite(x) and x >= 0):
                yield f"transition_time({a.short()} -> {b.short()}) = {x}: negative or not finite"
    for e in p.ends:
        for first, last in ((True, False), (False, True), (True, True)):
            c = p.cost.end_cost(e, ctx, first, last)
            if not all(math.isfinite(x) and x >= 0 for x in _fields(c)):
                yield f"end_cost({e.short()}, first={first}, last={last}) = {c}: a field is negative or not finite"
    for ctx2 in p.contexts():
        for e in p.ends:
            fixed = p.cost.stage_fixed(e, e, ctx2)
            freed = p.cost.backward_freed(e, ctx2)
            if not all(math.isfinite(x) and x >= 0 for x in (*fixed, freed)):
                yield f"stage_fixed / backward_freed({e.short()}, {ctx2}) = {fixed}, {freed}: negative or not finite"


def layer_cost_depends_on_type_and_stage_shape_only(p: Probe) -> Iterator[str]:
    """``layer_cost`` depends on the layer only through its profile type and on the context only through
    stage size, micro-batch and ``cost.context_key(ctx)``; so does ``end_cost``. The search prices the first layer
    of each type once, in one table per (stage size, micro-batch, key), and reuses it at every pipeline position
    and micro-batch count of that key. Each context is compared with the first context of its key."""
    first = p.first_of_type()
    refs: dict[tuple, StageContext] = {}
    for c in [p.table_ctx, *p.contexts()]:
        refs.setdefault(p.cost.context_key(c), c)
    ctx = p.table_ctx
    for s in p.layers:
        ref = {t: p.cost.layer_cost(layer, s, ctx) for t, layer in first.items() if p.applies(layer, s)}
        for layer, t in enumerate(p.profile.layer_type_of):
            if t not in ref:
                continue
            got = p.cost.layer_cost(layer, s, ctx)
            if not _same_cost(got, ref[t]):
                yield f"layer_cost(layer {layer}, {s.short()}) = {got} differs from layer {first[t]} of the same type"
        for ctx2 in p.contexts():
            c0 = refs[p.cost.context_key(ctx2)]
            for t, layer in first.items():
                if t not in ref:
                    continue
                want, got = p.cost.layer_cost(layer, s, c0), p.cost.layer_cost(layer, s, ctx2)
                if not _same_cost(got, want):
                    yield f"layer_cost(layer {layer}, {s.short()}) at {ctx2} = {got} differs from {want} at {c0}"
    for e in p.ends:
        for first_, last in ((True, False), (False, True)):
            for ctx2 in p.contexts():
                c0 = refs[p.cost.context_key(ctx2)]
                want, got = p.cost.end_cost(e, c0, first_, last), p.cost.end_cost(e, ctx2, first_, last)
                if not _same_cost(got, want):
                    yield f"end_cost({e.short()}, first={first_}) at {ctx2} = {got} differs from {want} at {c0}"


def model_states_shrink_with_zero(p: Probe) -> Iterator[str]:
    """At fixed tp, dp, sequence parallelism, checkpointing and rank order, a higher ZeRO stage never keeps
    more bytes of model states and never changes the activations kept: ZeRO shards model states, not
    activations (Rajbhandari et al. SC'20, Sec. 5). A model breaking it prices ZeRO backwards, and the
    search would trade memory for time in the wrong direction."""
    def groups(options: Sequence[LayerStrategy]) -> dict[tuple, list[LayerStrategy]]:
        out: dict[tuple, list[LayerStrategy]] = {}
        for s in options:
            out.setdefault(replace(s, zero=0), []).append(s)
        return out

    ctx = p.table_ctx
    for t, layer in p.first_of_type().items():
        for group in groups([s for s in p.layers if p.applies(layer, s)]).values():
            costs = [(s, p.cost.layer_cost(layer, s, ctx)) for s in sorted(group, key=lambda s: s.zero)]
            yield from _check_zero_ladder(costs, f"layer_cost(layer {layer}, ...)")
    for first, last in ((True, False), (False, True)):
        for group in groups(p.ends).values():
            costs = [(s, p.cost.end_cost(s, ctx, first, last)) for s in sorted(group, key=lambda s: s.zero)]
            yield from _check_zero_ladder(costs, f"end_cost(..., first={first})")


def checkpointing_costs_time(p: Probe) -> Iterator[str]:
    """Checkpointing a layer never makes it faster, per micro-batch or per step: its forward runs the same
    math and the recompute adds work (Chen et al. 2016). The search takes checkpointing as memory bought with
    time, and ``explain`` says so of a checkpointed winner; a model pricing it cheaper -- say, a checkpointed
    forward and a plain one fitted apart, crossing where extrapolated -- would have the search checkpoint for
    speed."""
    options = set(p.layers)
    for ctx in [p.table_ctx, *p.contexts()]:  # pipelines and accumulation change what a layer overlaps
        for t, layer in p.first_of_type().items():
            for s in p.layers:
                ck = replace(s, checkpoint=True)
                if s.checkpoint or ck not in options or not p.applies(layer, s):
                    continue
                a, b = p.cost.layer_cost(layer, s, ctx), p.cost.layer_cost(layer, ck, ctx)
                if not (_at_most(a.fwd + a.bwd, b.fwd + b.bwd)
                        and _at_most(a.fwd + a.bwd + a.step_extra, b.fwd + b.bwd + b.step_extra)):
                    yield (f"layer_cost(layer {layer}, {ck.short()}) at {ctx} = {b.fwd + b.bwd:.6g} s per "
                           f"micro-batch, {b.step_extra:.6g} s per step: cheaper than without checkpointing "
                           f"({a.fwd + a.bwd:.6g}, {a.step_extra:.6g})")


def _check_zero_ladder(costs: list[tuple[LayerStrategy, LayerCost]], what: str) -> Iterator[str]:
    for (a, ca), (b, cb) in zip(costs, costs[1:]):
        if not _at_most(cb.states, ca.states):
            yield f"{what}: {b.short()} keeps {cb.states:.6g} bytes of states, more than {a.short()} ({ca.states:.6g})"
        if not _close(ca.act, cb.act):
            yield f"{what}: activations differ between {a.short()} ({ca.act:.6g}) and {b.short()} ({cb.act:.6g})"


def transitions_follow_batch_layout(p: Probe) -> Iterator[str]:
    """``transition_time`` is 0 between strategies with the same batch layout and depends on the two
    strategies only through their layouts: the search prices one transition per pair of layouts."""
    ctx = p.table_ctx
    rep: dict[tuple[int, bool], LayerStrategy] = {}
    for s in p.layers:
        rep.setdefault(batch_layout(s), s)
    for a in p.layers:
        for b in p.layers:
            x = p.cost.transition_time(a, b, ctx)
            if batch_layout(a) == batch_layout(b) and x != 0.0:
                yield f"transition_time({a.short()} -> {b.short()}) = {x}: same batch layout, must be 0"
            y = p.cost.transition_time(rep[batch_layout(a)], rep[batch_layout(b)], ctx)
            if not _close(x, y):
                yield (f"transition_time({a.short()} -> {b.short()}) = {x} but {y} between other strategies "
                       "with the same two layouts")


def stage_fixed_sees_only_its_ends(p: Probe) -> Iterator[str]:
    """With a pipeline, stage 0's fixed part ignores the head, the last stage's ignores the embedding and a
    middle stage's sees only the embedding's dp (its boundary sends): the search picks each end on its
    own stage and stands one embedding option in for its dp on the middle stages."""
    S, mb, m = p.stage_size, p.micro_batch, p.micro_batches
    e0 = p.ends[0]
    for pp in (2, 3):
        for stage in range(pp):
            ctx = StageContext(S, mb, m, pp, stage)
            for e in p.ends:
                for h in p.ends:
                    if stage == 0:
                        ref, why = p.cost.stage_fixed(e, e0, ctx), "the head"
                    elif stage == pp - 1:
                        ref, why = p.cost.stage_fixed(e0, h, ctx), "the embedding"
                    else:
                        twin = next(x for x in p.ends if x.dp == e.dp)
                        ref, why = p.cost.stage_fixed(twin, e0, ctx), "more than the embedding's dp"
                    got = p.cost.stage_fixed(e, h, ctx)
                    if not all(_close(x, y) for x, y in zip(got, ref)):
                        yield (f"stage_fixed({e.short()}, {h.short()}) on stage {stage} of {pp} = {got}, {ref} with "
                               f"other ends: it depends on {why}")


def dominated_ends_stay_dominated(p: Probe) -> Iterator[str]:
    """If one end strategy is no worse than another in ``end_cost`` (time, per-step extra, states,
    activations, transient) and has the same dp, the stage's fixed part with it is no worse either -- so the search
    may drop the dominated one. (Same dp: a pipeline stage also sends activations sized by the embedding's
    dp, which ``end_cost`` does not include.)"""
    S, mb, m = p.stage_size, p.micro_batch, p.micro_batches
    ctx = p.table_ctx
    h0 = p.ends[0]
    for first in (True, False):
        vec = {e: p.cost.end_cost(e, ctx, first, not first) for e in p.ends}
        cols = {e: (c.fwd + c.bwd, c.step_extra, c.states, c.act, c.transient) for e, c in vec.items()}
        stages = [StageContext(S, mb, m), StageContext(S, mb, m, 2, 0 if first else 1)]
        for a in p.ends:
            for b in p.ends:
                if a == b or a.dp != b.dp or not all(x <= y for x, y in zip(cols[a], cols[b])):
                    continue
                for st in stages:
                    fa = p.cost.stage_fixed(a, h0, st) if first else p.cost.stage_fixed(h0, a, st)
                    fb = p.cost.stage_fixed(b, h0, st) if first else p.cost.stage_fixed(h0, b, st)
                    if not all(_at_most(x, y) for x, y in zip(fa, fb)):
                        yield (f"{'embedding' if first else 'head'} {a.short()} dominates {b.short()} in end_cost, "
                               f"but stage_fixed on stage {st.stage} of {st.pp} is {fa} vs {fb}")


def backward_freed_is_the_heads(p: Probe) -> Iterator[str]:
    """``backward_freed`` is 0 on stages without the head and never more than the head's activations: the
    memory it frees is counted against a recomputing block's peak, so overstating it overfills the budget."""
    S, mb, m = p.stage_size, p.micro_batch, p.micro_batches
    for h in p.ends:
        for ctx in (StageContext(S, mb, m, 2, 0), StageContext(S, mb, m, 3, 1)):
            if p.cost.backward_freed(h, ctx) != 0.0:
                yield f"backward_freed({h.short()}) on stage {ctx.stage} of {ctx.pp} is not 0 (no head there)"
        for ctx in (StageContext(S, mb, m), StageContext(S, mb, m, 2, 1)):
            act = p.cost.end_cost(h, ctx, False, True).act
            if not _at_most(p.cost.backward_freed(h, ctx), act):
                yield f"backward_freed({h.short()}) exceeds the head's activations ({act})"


def expert_parallelism_only_where_experts_are(p: Probe) -> Iterator[str]:
    """``layer_cost`` refuses ep > 1 on a layer type without experts, or whose expert count ep does not
    divide, with a ``ValueError`` carrying a HINT: the runtime rejects such a plan (``parallel/expert.py``),
    so a model that priced it would let a caller build plans that cannot run. (The search never asks.)"""
    ctx = p.table_ctx
    asked = 0
    for t, layer in p.first_of_type().items():
        lt = p.profile.layer(layer)
        tries = [s for s in p.layers if s.ep > 1 and not p.applies(layer, s)]
        if not tries:  # a dense model's probe has no ep at all: try the smallest ep the data group allows
            tries = [replace(s, ep=divisors(s.data_group)[1]) for s in p.layers if s.data_group > 1 and s.ep == 1]
            tries = [s for s in tries if not p.applies(layer, s)]
        for s in tries[:6]:
            asked += 1
            try:
                c = p.cost.layer_cost(layer, s, ctx)
            except ValueError as exc:
                if "HINT:" not in str(exc):
                    yield f"layer_cost(layer {layer} ({lt.name}), {s.short()}) raised {exc!r} without a HINT"
            else:
                yield (f"layer_cost(layer {layer} ({lt.name}), {s.short()}) = {c}: ep={s.ep} on a layer with "
                       f"{lt.moe.num_experts if lt.moe else 'no'} experts must be a ValueError")


def expert_states_do_not_grow_with_ep(p: Probe) -> Iterator[str]:
    """For an MoE layer type, at fixed tp, dp, sp, ZeRO stage, checkpointing and rank order, a larger ep
    never keeps more bytes of model states (each rank holds E/ep experts, ZeRO shards them over the
    |D|/ep expert-data ranks: at worst equal, under ZeRO-3) and never keeps fewer bytes of activations
    (balanced routing hands every rank tokens x top_k rows whatever ep is; the all-to-all dispatcher can
    only add buffers of its own, which the profiler measures per ep). A model breaking it would make the
    search buy expert parallelism for memory it does not save."""
    ctx = p.table_ctx
    for t, layer in p.first_of_type().items():
        if p.profile.layer(layer).moe is None:
            continue
        ladders: dict[LayerStrategy, list[LayerStrategy]] = {}
        for s in p.layers:
            if p.applies(layer, s):
                ladders.setdefault(replace(s, ep=1), []).append(s)
        for group in ladders.values():
            costs = [(s, p.cost.layer_cost(layer, s, ctx)) for s in sorted(group, key=lambda s: s.ep)]
            for (a, ca), (b, cb) in zip(costs, costs[1:]):
                if not _at_most(cb.states, ca.states):
                    yield (f"layer_cost(layer {layer}, ...): {b.short()} keeps {cb.states:.6g} bytes of states, "
                           f"more than {a.short()} ({ca.states:.6g})")
                if not _at_most(ca.act, cb.act):
                    yield (f"layer_cost(layer {layer}, ...): {b.short()} keeps {cb.act:.6g} bytes of activations, "
                           f"fewer than {a.short()} ({ca.act:.6g})")


def stage_sync_time_is_never_negative(p: Probe) -> Iterator[str]:
    """``stage_sync_time`` only adds: a negative one would price a plan below the parts the search bounded it by."""
    for plan in _probe_plans(p):
        assert plan.global_batch is not None
        for st in range(plan.pp):
            ctx = StageContext(plan.stage_size, plan.global_batch // plan.micro_batches, plan.micro_batches, plan.pp,
                               st, plan.pipeline_schedule, plan.virtual_stages)
            t = p.cost.stage_sync_time(plan, st, ctx)
            if not (t >= 0.0 and math.isfinite(t)):
                yield f"stage_sync_time({_name(plan)}, stage {st}) = {t}: must be finite and >= 0"


def evaluate_is_the_sum_of_its_parts(p: Probe) -> Iterator[str]:
    """``evaluate`` agrees with the parts the search optimized: per stage, the fixed part plus every layer's
    time, per-step extra and memory (with the transitions between unequal neighbours and the largest
    recompute transient not covered by ``backward_freed``). Its step time relates to the objective the search
    optimizes, :func:`~lightning_galv.planner.cost.pipeline_time` of the stages (without a pipeline: m * stage
    time + extra), the way the model declares (``CostModel.step_time_vs_pipeline``): never below it (the
    search's bounds and partition assume that), or -- a model with its own whole-plan formula -- never above
    it, so no plan is priced worse than the search saw it."""
    at_least = p.cost.step_time_vs_pipeline == "at_least"
    if p.cost.step_time_vs_pipeline not in ("at_least", "at_most"):
        yield f"step_time_vs_pipeline = {p.cost.step_time_vs_pipeline!r}: must be 'at_least' or 'at_most'"
        return
    for plan in _probe_plans(p):
        got = p.cost.evaluate(plan)
        want_t, want_e, want_mem = _stage_sums(p, plan)
        for name, g, w in (("time per micro-batch", got.stage_mb_time_s, want_t),
                           ("per-step extra", got.stage_extra_s, want_e), ("memory", got.stage_memory_bytes, want_mem)):
            if len(g) != plan.pp or not all(_close(x, y) for x, y in zip(g, w)):
                yield f"evaluate({_name(plan)}): stage {name} {tuple(g)}, the parts sum to {tuple(w)}"
        m, v = plan.micro_batches, plan.virtual_stages
        formula = pipeline_time(want_t, want_e, m, v)
        if at_least and plan.pp == 1 and not _close(got.step_time_s, m * want_t[0] + want_e[0]):
            yield f"evaluate({_name(plan)}).step_time_s = {got.step_time_s}, parts give {m * want_t[0] + want_e[0]}"
        if at_least and not _at_most(formula, got.step_time_s):
            yield (f"evaluate({_name(plan)}).step_time_s = {got.step_time_s} is below the pipeline formula "
                   f"{formula} of its stages")
        if not at_least and not _at_most(got.step_time_s, formula):
            yield (f"evaluate({_name(plan)}).step_time_s = {got.step_time_s} is above the pipeline formula "
                   f"{formula} of its stages, which the model declares it never exceeds")


def predict_fills_the_prediction(p: Probe) -> Iterator[str]:
    """``predict`` returns the same plan with ``evaluate``'s step time, throughput (global batch / step
    time) and per-stage memory attached, and ``evaluate`` refuses a plan without a global batch (a
    ``ValueError`` with a HINT)."""
    for plan in _probe_plans(p)[:8]:
        cost = p.cost.evaluate(plan)
        got = p.cost.predict(plan)
        pred = got.prediction
        if got != plan or pred is None:
            yield f"predict({_name(plan)}) changed the plan or attached no prediction"
            continue
        assert plan.global_batch is not None
        same_memory = len(pred.stage_memory_bytes) == plan.pp and all(
            _close(x, y) for x, y in zip(pred.stage_memory_bytes, cost.stage_memory_bytes))
        if not (_close(pred.step_time_s, cost.step_time_s) and same_memory
                and _close(pred.throughput, plan.global_batch / cost.step_time_s)):
            yield f"predict({_name(plan)}).prediction = {pred} disagrees with evaluate: {cost}"
    plan = _probe_plans(p)[0].with_(global_batch=None)
    try:
        p.cost.evaluate(plan)
    except ValueError as exc:
        if "HINT:" not in str(exc):
            yield f"evaluate(plan without global batch) raised {exc!r} without a HINT"
    else:
        yield "evaluate(plan without global batch) did not raise ValueError"


RULES: tuple[Callable[[Probe], Iterator[str]], ...] = (
    finite_and_non_negative, layer_cost_depends_on_type_and_stage_shape_only, model_states_shrink_with_zero,
    checkpointing_costs_time,
    transitions_follow_batch_layout, stage_fixed_sees_only_its_ends, dominated_ends_stay_dominated,
    backward_freed_is_the_heads, stage_sync_time_is_never_negative, evaluate_is_the_sum_of_its_parts,
    predict_fills_the_prediction,
    expert_parallelism_only_where_experts_are, expert_states_do_not_grow_with_ep)


# ---------------------------------------------------------------------------------------------------
# probe plans
# ---------------------------------------------------------------------------------------------------
def _name(plan: ParallelPlan) -> str:
    layers = ",".join(s.short() for s in plan.layers[:2]) + ("..." if len(plan.layers) > 2 else "")
    return f"pp{plan.pp} m{plan.micro_batches} v{plan.virtual_stages} [{layers}]"


def _probe_plans(p: Probe) -> list[ParallelPlan]:
    """Uniform single-stage plans of every layer strategy (ends taken round-robin), plans alternating two
    strategies of different layouts (transitions), and uniform two-stage 1F1B, GPipe and interleaved plans -- of the
    probe's schedules, and for a model bound to one world size (``CostModel.world_size``) only the plans of
    that size."""
    S, mb, m, L = p.stage_size, p.micro_batch, p.micro_batches, p.profile.num_layers
    G = mb * m
    ends = p.ends
    world = p.cost.world_size
    plans: list[ParallelPlan] = []
    if world in (None, S):
        plans += [ParallelPlan(world_size=S, layers=p.plan_layers(lambda i, s=s: s), micro_batches=m, global_batch=G,
                               embed=ends[j % len(ends)], head=ends[(j + 1) % len(ends)])
                  for j, s in enumerate(p.layers)]
        rep: dict[tuple[int, bool], LayerStrategy] = {}
        for s in p.layers:
            rep.setdefault(batch_layout(s), s)
        reps = list(rep.values())
        for a in reps:
            for b in reps:
                if a != b and L >= 2:
                    plans.append(ParallelPlan(world_size=S, layers=p.plan_layers(lambda i, a=a, b=b: a if i % 2 == 0 else b),
                                              micro_batches=m, global_batch=G, embed=ends[0], head=ends[-1]))
    if world not in (None, 2 * S):
        return plans
    # pipelines: the same stage size on two stages (world 2S), even and interleaved
    for s in p.layers[:: max(1, len(p.layers) // 6)]:
        layers = p.plan_layers(lambda i, s=s: s)
        if L >= 2 and "1f1b" in p.schedules:
            plans.append(ParallelPlan(world_size=2 * S, layers=layers, pp=2, micro_batches=m, global_batch=G,
                                      embed=ends[0], head=ends[-1]))
        if L >= 2 and "gpipe" in p.schedules:
            plans.append(ParallelPlan(world_size=2 * S, layers=layers, pp=2, micro_batches=m, global_batch=G,
                                      pipeline_schedule="gpipe", embed=ends[0], head=ends[-1]))
        if L >= 4 and m % 2 == 0 and "interleaved_1f1b" in p.schedules:
            plans.append(ParallelPlan(world_size=2 * S, layers=layers, pp=2, micro_batches=m, global_batch=G,
                                      pipeline_schedule="interleaved_1f1b", virtual_stages=2, embed=ends[0],
                                      head=ends[-1]))
    return plans


def _stage_sums(p: Probe, plan: ParallelPlan) -> tuple[list[float], list[float], list[float]]:
    """Per stage: (seconds per micro-batch, seconds per step, bytes) from the parts alone."""
    assert plan.global_batch is not None and plan.embed is not None and plan.head is not None
    m, v = plan.micro_batches, plan.virtual_stages
    mb = plan.global_batch // m
    times, extras, mems = [], [], []
    for st in range(plan.pp):
        ctx = StageContext(plan.stage_size, mb, m, plan.pp, st, plan.pipeline_schedule, v)
        t, e, mem = p.cost.stage_fixed(plan.embed, plan.head, ctx, plan.vocab_parallel_loss)
        e += p.cost.stage_sync_time(plan, st, ctx)
        transient = 0.0
        for chunk in range(st, plan.pp * v, plan.pp):
            t += p.cost.chunk_boundary_time(plan, chunk, ctx)
            prev = None
            for i in plan.stage_layers(chunk):
                c = p.cost.layer_cost(i, plan.layers[i], ctx)
                t += c.fwd + c.bwd + (p.cost.transition_time(prev, plan.layers[i], ctx)
                                      if prev is not None and prev != plan.layers[i] else 0.0)
                e += c.step_extra
                mem += c.memory(ctx.inflight)
                transient = max(transient, c.transient)
                prev = plan.layers[i]
        times.append(t)
        extras.append(e)
        mems.append(mem + max(0.0, transient - p.cost.backward_freed(plan.head, ctx, plan.vocab_parallel_loss)))
    return times, extras, mems


# ---------------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------------
def make_probe(cost: CostModel, profile: ModelProfile, world_size: int = 4, micro_batch: int | None = None,
               micro_batches: int = 2, space: SearchSpace | None = None) -> Probe:
    """The probe of ``cost`` on ``profile`` for a stage of ``world_size`` ranks (micro-batch: the stage
    size, so every dp degree divides it), over the strategies ``space`` enumerates (default: the whole space
    without guideline pruning; a model that prices only part of it -- Galvatron's -- is probed on its own)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise bad_value(f"world_size={world_size}", "must be a positive int", "e.g. world_size=4.")
    mb = world_size if micro_batch is None else micro_batch
    if mb < 1 or micro_batches < 1:
        raise bad_value(f"micro_batch={mb}, micro_batches={micro_batches}", "must be >= 1", "e.g. micro_batch=4.")
    space = space or SearchSpace(heuristic_pruning=False)
    layers = tuple(candidate_strategies(profile.shape, world_size, mb, space, experts=profile.num_experts))
    ends = tuple(end_strategies(profile.shape, world_size, mb, space))
    if not layers or not ends:
        raise bad_value(f"world_size={world_size}, micro_batch={mb}",
                        f"no layer or end strategy is valid for this model (tp degrees {divisors(world_size)})",
                        "probe with a micro-batch divisible by the world size and a model whose heads divide it.")
    return Probe(cost, profile, world_size, mb, micro_batches, layers, ends, tuple(space.schedules))


def contract_violations(cost: CostModel, profile: ModelProfile, world_size: int = 4, micro_batch: int | None = None,
                        micro_batches: int = 2, space: SearchSpace | None = None) -> list[str]:
    """Every broken rule as ``rule: detail`` lines (at most 5 per rule); empty when ``cost`` keeps the contract."""
    probe = make_probe(cost, profile, world_size, micro_batch, micro_batches, space)
    out: list[str] = []
    for rule in RULES:
        found = list(rule(probe))
        out += [f"{rule.__name__}: {line}" for line in found[:5]]
        if len(found) > 5:
            out.append(f"{rule.__name__}: ... and {len(found) - 5} more")
    return out


def check_cost_model(cost: CostModel, profile: ModelProfile, world_size: int = 4, micro_batch: int | None = None,
                     micro_batches: int = 2, space: SearchSpace | None = None) -> None:
    """Raise ``AssertionError`` listing every rule ``cost`` breaks on ``profile`` (see :data:`RULES`)."""
    problems = contract_violations(cost, profile, world_size, micro_batch, micro_batches, space)
    if problems:
        raise AssertionError(f"{type(cost).__name__} breaks the cost-model contract:\n  " + "\n  ".join(problems))
