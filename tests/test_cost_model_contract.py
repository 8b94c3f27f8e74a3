"""The CostModel interface is what the search uses: GalvatronCostModel keeps the contract on many profiles,
broken models are caught rule by rule, and a second implementation (times scaled) drives the search."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

from lightning_galv.compat.galvatron import read_hardware_profile, read_model_profile
from lightning_galv.plan import LayerStrategy, ModelShape, ParallelPlan
from lightning_galv.planner import CostModel, GalvatronCostModel, SearchSpace, search
from lightning_galv.planner.contract import RULES, check_cost_model, contract_violations
from lightning_galv.planner.cost import LayerCost, PlanCost, StageContext
from lightning_galv.planner.profiles import (HardwareProfile, LayerTypeProfile, MoELayerFacts, ModelProfile, TimeFit,
                                             act_key, transient_key)

MS = 1e-3
REF = Path(__file__).resolve().parent / "data" / "galvatron"
SHAPE = ModelShape(num_layers=6, hidden=1024, num_heads=16, num_kv_heads=8, ffn_hidden=4096, vocab_size=32000,
                   seq_len=1024)


def toy_hw(world: int = 8) -> HardwareProfile:
    return HardwareProfile.uniform(1, world, 1e12, intra_bw=2e9, inter_bw=2e9, latency_s=2e-5, overlap_slowdown=1.2,
                                   memory_bandwidth=1e11)


def rich_profile(precision: str = "bf16") -> ModelProfile:
    """Two layer types; the second with measured sharded compute (plain and checkpointed, the checkpointed
    forward fitted below the plain one, as separately fitted variants can come out: the cost model must not
    price checkpointing faster -- ``checkpointing_costs_time`` fails without its guard), counted
    recompute collectives, FSDP2 overheads and a recompute peak, so the native runtime's extra terms are all
    exercised."""
    shape = ModelShape(5, 8, 4, 4, 16, 64, 8)
    plain = LayerTypeProfile("attn", TimeFit(2e-5, MS / 8), TimeFit(4e-5, 2 * MS / 8), 2_000_000,
                             {act_key(1, "none", False): 4e6, act_key(2, "none", False): 2.5e6,
                              act_key(1, "none", True): 5e5}, 8)
    over = {"zero3": {"forward": TimeFit(MS, 0.0), "backward": TimeFit(2 * MS, 0.0)},
            "zero2": {"forward": TimeFit(0.5 * MS, 0.0), "backward": TimeFit(0.5 * MS, 0.0)}}
    measured = {"tp2/none": {"forward": TimeFit(MS, 1e-4), "backward": TimeFit(2 * MS, 2e-4),
                             "checkpoint_forward": TimeFit(0.5 * MS, 0.5e-4), "recompute": TimeFit(0.0, 0.1e-4)}}
    heavy = LayerTypeProfile("mlp", TimeFit(1e-5, 2 * MS / 8), TimeFit(2e-5, 4 * MS / 8), 3_000_000,
                             {act_key(1, "none", False): 6e6, act_key(1, "none", True): 1e6,
                              transient_key(1, "none"): 8e6}, 8, sharded=measured, zero_overhead=over,
                             recompute_comm={"tp2/none": 0.5})
    return ModelProfile("rich", shape, (plain, heavy), (0, 1, 1, 0, 1), precision, embed_params=50_000,
                        head_params=80_000, head_forward=TimeFit(1e-5, 0.5 * MS / 8), head_act_bytes=2e5,
                        framework_bytes=1e6)


def moe_profile(every: int | None = 2, shared: int = 0) -> ModelProfile:
    """Analytic MoE model: 8 experts top-2 in every ``every``-th block (None: all blocks)."""
    facts = MoELayerFacts.swiglu(SHAPE.hidden, 8, 2, 2048, shared_hidden=shared)
    ids = None if every is None else range(every - 1, SHAPE.num_layers, every)
    return ModelProfile.from_shape(SHAPE, moe=facts, moe_layers=ids)


def galvatron_gpt() -> tuple[ModelProfile, HardwareProfile]:
    return (read_model_profile(REF / "gpt" / "meta_configs" / "gpt-1.5b.json", REF / "gpt" / "configs"),
            read_hardware_profile(REF / "hardware", 1, 8))


# ---------------------------------------------------------------------------------------------------
# the Galvatron-style model keeps the contract
# ---------------------------------------------------------------------------------------------------
CASES: dict[str, Callable[[], tuple[ModelProfile, HardwareProfile]]] = {
    "analytic": lambda: (ModelProfile.from_shape(SHAPE), HardwareProfile.uniform(1, 8, 40e9)),
    "rich": lambda: (rich_profile(), toy_hw()),
    "rich-fp32": lambda: (rich_profile("fp32"), toy_hw()),
    "galvatron-gpt-1.5b": galvatron_gpt,
    "moe-mixed": lambda: (moe_profile(2), HardwareProfile.uniform(1, 8, 40e9)),
    "moe-all-shared": lambda: (moe_profile(None, shared=1024), HardwareProfile.uniform(1, 4, 40e9)),
}


@pytest.mark.parametrize("runtime", ["ideal", "native"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_galvatron_cost_model_keeps_the_contract(case: str, runtime: str, world: int) -> None:
    prof, hw = CASES[case]()
    check_cost_model(GalvatronCostModel(prof, hw, runtime=runtime), prof, world_size=world)


# ---------------------------------------------------------------------------------------------------
# a second implementation: another model's times, scaled
# ---------------------------------------------------------------------------------------------------
class ScaledCostModel(CostModel):
    """``inner``'s times multiplied by ``factor``, and layer times further by ``kind_factor`` where
    ``kind(strategy)`` holds; memory untouched. The shape of the tuner's calibrated model (measured
    factors on top of another model); ``evaluate`` is the base class's, assembled from these parts."""

    def __init__(self, inner: CostModel, factor: float = 1.0, kind: Callable[[LayerStrategy], bool] | None = None,
                 kind_factor: float = 1.0) -> None:
        self.inner, self.factor, self.kind, self.kind_factor = inner, factor, kind, kind_factor

    def _scaled(self, c: LayerCost, f: float) -> LayerCost:
        return replace(c, fwd=c.fwd * f, bwd=c.bwd * f, step_extra=c.step_extra * f)

    def layer_cost(self, layer: int, s: LayerStrategy, ctx: StageContext) -> LayerCost:
        f = self.factor * (self.kind_factor if self.kind is not None and self.kind(s) else 1.0)
        return self._scaled(self.inner.layer_cost(layer, s, ctx), f)

    def transition_time(self, a: LayerStrategy, b: LayerStrategy, ctx: StageContext) -> float:
        return self.factor * self.inner.transition_time(a, b, ctx)

    def boundary_time(self, entry: LayerStrategy, first: LayerStrategy, last: LayerStrategy, exit_: LayerStrategy,
                      ctx: StageContext) -> float:
        return self.factor * self.inner.boundary_time(entry, first, last, exit_, ctx)

    @property
    def prices_boundaries(self) -> bool:
        return self.inner.prices_boundaries

    def stage_sync_time(self, plan: ParallelPlan, stage: int, ctx: StageContext) -> float:
        return self.factor * self.inner.stage_sync_time(plan, stage, ctx)

    def context_key(self, ctx: StageContext) -> tuple:
        return self.inner.context_key(ctx)  # a wrapper's costs vary with the context as the wrapped model's do

    def end_cost(self, s: LayerStrategy, ctx: StageContext, first: bool, last: bool,
                 vocab_parallel_loss: bool = False) -> LayerCost:
        return self._scaled(self.inner.end_cost(s, ctx, first, last, vocab_parallel_loss), self.factor)

    def stage_fixed(self, plan_embed: LayerStrategy, plan_head: LayerStrategy, ctx: StageContext,
                    vocab_parallel_loss: bool = False) -> tuple[float, float, float]:
        t, e, mem = self.inner.stage_fixed(plan_embed, plan_head, ctx, vocab_parallel_loss)
        return t * self.factor, e * self.factor, mem


@pytest.mark.parametrize("case", ["rich", "analytic"])
def test_scaled_model_keeps_the_contract(case: str) -> None:
    prof, hw = CASES[case]()
    inner = GalvatronCostModel(prof, hw, runtime="native")
    check_cost_model(ScaledCostModel(inner, 3.0), prof, world_size=4)
    check_cost_model(ScaledCostModel(inner, 1.0, lambda s: s.tp > 1, 5.0), prof, world_size=4)


SEARCHES = {  # (profile + hardware, world, budget, search keywords)
    "rich pp sweep": ("rich", 4, 6e7, dict(global_batch=(8, 16), top_k=5)),
    "rich 3-D": ("rich", 4, 1.5e8, dict(global_batch=16, top_k=4, space=SearchSpace.three_d())),
    "analytic 8 ranks": ("analytic", 8, 12 * 2**30, dict(global_batch=32, top_k=5)),
    "gpt-1.5b": ("galvatron-gpt-1.5b", 8, 16 * 2**30, dict(global_batch=32, top_k=3)),
}


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_uniformly_scaled_times_leave_the_search_unchanged(name: str) -> None:
    """Twice (or half) every time: the same plans in the same order, with the same search work, each
    predicted exactly twice (half) as slow -- nothing in the search depends on the model's class."""
    case, world, budget, kw = SEARCHES[name]
    prof, hw = CASES[case]()
    inner = GalvatronCostModel(prof, hw, SearchSpace().default_embed_zero, runtime="native")
    base = search(prof, hw, world, budget, cost_model=inner, **kw)
    assert len(base) >= 2
    for factor in (2.0, 0.5):
        got = search(prof, hw, world, budget, cost_model=ScaledCostModel(inner, factor), **kw)
        assert list(got) == list(base)  # plans compare without their predictions
        for g, b in zip(got, base):
            assert g.prediction.step_time_s == factor * b.prediction.step_time_s
            assert g.prediction.stage_memory_bytes == b.prediction.stage_memory_bytes
        assert {k: v for k, v in got.stats.items() if k != "wall_s"} == \
            {k: v for k, v in base.stats.items() if k != "wall_s"}


def test_an_expensive_strategy_kind_changes_the_choice() -> None:
    """The Galvatron model picks pure data parallelism for this 8-rank model; a model that makes every
    tp = 1 layer 5x slower gets tensor/sequence-parallel layers instead, which it prices faster than the
    first choice -- while the first model still prefers its own optimum."""
    prof, hw = CASES["analytic"]()
    kw = dict(global_batch=32, top_k=3)
    inner = GalvatronCostModel(prof, hw, SearchSpace().default_embed_zero)
    first = search(prof, hw, 8, 12 * 2**30, cost_model=inner, **kw).best
    assert all(s.tp == 1 for s in first.layers), first.describe()
    slow_dp = ScaledCostModel(inner, 1.0, lambda s: s.tp == 1, 5.0)
    second = search(prof, hw, 8, 12 * 2**30, cost_model=slow_dp, **kw).best
    assert all(s.tp > 1 for s in second.layers), second.describe()
    assert second.prediction.step_time_s < slow_dp.evaluate(first).step_time_s
    assert inner.evaluate(second).step_time_s > first.prediction.step_time_s


# ---------------------------------------------------------------------------------------------------
# negative controls: each rule catches the model that breaks it
# ---------------------------------------------------------------------------------------------------
class Broken(ScaledCostModel):
    """A correct model with one part replaced."""

    def __init__(self, inner: CostModel, **parts: Callable) -> None:
        super().__init__(inner)
        self.parts = parts

    def layer_cost(self, layer: int, s: LayerStrategy, ctx: StageContext) -> LayerCost:
        try:
            c = super().layer_cost(layer, s, ctx)
        except ValueError:
            if "accept_ep" not in self.parts:
                raise
            c = super().layer_cost(layer, replace(s, ep=1), ctx)  # silently prices ep as if it were not there
        return self.parts["layer"](layer, s, ctx, c) if "layer" in self.parts else c

    def transition_time(self, a: LayerStrategy, b: LayerStrategy, ctx: StageContext) -> float:
        t = super().transition_time(a, b, ctx)
        return self.parts["transition"](a, b, t) if "transition" in self.parts else t

    def end_cost(self, s: LayerStrategy, ctx: StageContext, first: bool, last: bool,
                 vocab_parallel_loss: bool = False) -> LayerCost:
        c = super().end_cost(s, ctx, first, last, vocab_parallel_loss)
        return self.parts["end"](s, ctx, c) if "end" in self.parts else c

    def stage_fixed(self, plan_embed: LayerStrategy, plan_head: LayerStrategy, ctx: StageContext,
                    vocab_parallel_loss: bool = False) -> tuple[float, float, float]:
        f = super().stage_fixed(plan_embed, plan_head, ctx, vocab_parallel_loss)
        return self.parts["fixed"](plan_embed, plan_head, ctx, f) if "fixed" in self.parts else f

    def backward_freed(self, plan_head: LayerStrategy, ctx: StageContext, vocab_parallel_loss: bool = False) -> float:
        freed = super().backward_freed(plan_head, ctx, vocab_parallel_loss)
        return self.parts["freed"](ctx, freed) if "freed" in self.parts else freed

    def stage_sync_time(self, plan: ParallelPlan, stage: int, ctx: StageContext) -> float:
        t = super().stage_sync_time(plan, stage, ctx)
        return self.parts["sync"](t) if "sync" in self.parts else t

    def evaluate(self, plan: ParallelPlan) -> PlanCost:
        c = super().evaluate(plan)
        return self.parts["evaluate"](c) if "evaluate" in self.parts else c

    def predict(self, plan: ParallelPlan) -> ParallelPlan:
        got = super().predict(plan)
        return self.parts["predict"](got) if "predict" in self.parts else got


BREAKS: dict[str, tuple] = {  # what breaks -> (the rule that must catch it, the part[, the case probed; "rich"])
    "negative recompute time": (
        "finite_and_non_negative", dict(layer=lambda i, s, ctx, c: replace(c, bwd=-c.bwd) if s.checkpoint else c)),
    "time depends on the stage": (
        "layer_cost_depends_on_type_and_stage_shape_only",
        dict(layer=lambda i, s, ctx, c: replace(c, fwd=c.fwd * (1 + ctx.stage)))),
    "time depends on the layer index": (
        "layer_cost_depends_on_type_and_stage_shape_only",
        dict(layer=lambda i, s, ctx, c: replace(c, fwd=c.fwd * (1 + i)))),
    "checkpointing priced faster": (
        "checkpointing_costs_time", dict(layer=lambda i, s, ctx, c: replace(c, bwd=0.5 * c.bwd) if s.checkpoint else c)),
    "ZeRO-3 keeps more states": (
        "model_states_shrink_with_zero",
        dict(layer=lambda i, s, ctx, c: replace(c, states=c.states * (4 if s.zero == 3 else 1)))),
    "ZeRO changes activations": (
        "model_states_shrink_with_zero", dict(end=lambda s, ctx, c: replace(c, act=c.act * (1 + s.zero)))),
    "a transition inside one layout": (
        "transitions_follow_batch_layout",
        dict(transition=lambda a, b, t: t + (1e-3 if a.checkpoint != b.checkpoint else 0.0))),
    "first stage pays for the head": (
        "stage_fixed_sees_only_its_ends", dict(fixed=lambda e, h, ctx, f: (f[0] + 1e-3 * h.zero, f[1], f[2]))),
    "end cost hides the differences": (
        "dominated_ends_stay_dominated", dict(end=lambda s, ctx, c: LayerCost(0.0, 0.0, 0.0, 0.0, 0.0))),
    "frees memory it does not hold": (
        "backward_freed_is_the_heads", dict(freed=lambda ctx, freed: freed + 1e9)),
    "gradient sync gives time back": ("stage_sync_time_is_never_negative", dict(sync=lambda t: t - 1e-3)),
    "evaluate undercuts its parts": (
        "evaluate_is_the_sum_of_its_parts", dict(evaluate=lambda c: replace(c, step_time_s=0.9 * c.step_time_s))),
    "evaluate forgets a stage's memory": (
        "evaluate_is_the_sum_of_its_parts",
        dict(evaluate=lambda c: replace(c, stage_memory_bytes=c.stage_memory_bytes[:1]))),
    "predict misreports throughput": (
        "predict_fills_the_prediction",
        dict(predict=lambda p: p.with_(prediction=replace(p.prediction, throughput=1.0)))),
    "ep priced on a dense layer": ("expert_parallelism_only_where_experts_are", dict(accept_ep=lambda: None)),
    "ep priced on the dense layers of an MoE model": (
        "expert_parallelism_only_where_experts_are", dict(accept_ep=lambda: None), "moe-mixed"),
    "ep keeps more expert states": (
        "expert_states_do_not_grow_with_ep",
        dict(layer=lambda i, s, ctx, c: replace(c, states=c.states * s.ep)), "moe-mixed"),
    "ep changes activations": (
        "expert_states_do_not_grow_with_ep",
        dict(layer=lambda i, s, ctx, c: replace(c, act=c.act / s.ep)), "moe-all-shared"),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_rule_catches_a_model_that_breaks_it(name: str) -> None:
    rule, parts, *case = BREAKS[name]
    prof, hw = CASES[case[0] if case else "rich"]()
    inner = GalvatronCostModel(prof, hw, runtime="native")
    assert contract_violations(Broken(inner), prof) == []  # the wrapper alone is fine
    found = contract_violations(Broken(inner, **parts), prof)
    assert any(line.startswith(rule + ":") for line in found), found
    with pytest.raises(AssertionError, match=rule):
        check_cost_model(Broken(inner, **parts), prof)


def test_every_rule_has_a_negative_control() -> None:
    assert {rule.__name__ for rule in RULES} == {rule for rule, *_ in BREAKS.values()}


def test_probe_arguments_are_checked() -> None:
    prof, hw = CASES["rich"]()
    cm = GalvatronCostModel(prof, hw)
    for bad in (0, True, "4"):
        with pytest.raises(ValueError, match="HINT:"):
            contract_violations(cm, prof, world_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="HINT:"):
        contract_violations(cm, prof, world_size=3, micro_batch=2)  # 3 ranks: tp3 splits no head, dp3 no sample pair
