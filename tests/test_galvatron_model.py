"""Galvatron24CostModel: Galvatron 2.4's accounting as a cost model the search runs on (no judge needed: the
reference numbers are GalvatronAccounting's, itself checked against the judge in benchmarks/galvatron_accounting.py,
and Galvatron's own search output for its gpt-2.7b plan)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lightning_galv.compat.galvatron import read_galvatron_hardware, read_hardware_profile, read_model_profile, read_plan
from lightning_galv.plan import LayerStrategy, ParallelPlan
from lightning_galv.planner import SearchSpace, search
from lightning_galv.planner.contract import check_cost_model
from lightning_galv.planner.cost import GalvatronCostModel, StageContext
from lightning_galv.planner.galvatron_accounting import MB, GalvatronAccounting
from lightning_galv.planner.galvatron_model import Galvatron24CostModel, galvatron_contexts, galvatron_search
from lightning_galv.planner.searcher import Config, Searcher

DATA = Path(__file__).resolve().parent / "data" / "galvatron"
T06 = DATA / "plans" / "T06_galvatron_gpt2.7b_1x8_40G.json"
GALVATRON_T06_TIME = 1.8092703918457038  # what Galvatron's search reported for its plan (judge README)


def profile(name: str = "gpt-2.7b"):
    fam, kw = ("llama_hf", dict(layout="legacy")) if name.startswith("llama") else ("gpt_hf", dict(layout="legacy"))
    return read_model_profile(DATA / "models" / fam / "meta_configs" / f"{name}.json", DATA / "models" / fam / "configs",
                              **kw)


def ghw(nodes: int = 1):
    return read_galvatron_hardware(DATA / "hardware", nodes, 8)


def plan_of(n: int, world: int, pp: int, tp: int, zero3: bool, ckpt: bool, bsz: int, m: int, vtp: int = 1,
            esdp: bool = False, sp: str = "none") -> ParallelPlan:
    stage = world // pp
    s = LayerStrategy(tp=tp, dp=stage // tp, sp=sp if tp > 1 else "none", zero=3 if zero3 else 2, checkpoint=ckpt)
    e = LayerStrategy(tp=vtp, dp=stage // vtp, zero=(3 if esdp else 2) if stage // vtp > 1 else 0)
    return ParallelPlan.uniform(world, n, s, pp=pp, micro_batches=m, global_batch=bsz, embed=e, head=e)


VARIANTS = [  # (model, Megatron-SP, plan): pipelines, ZeRO-3, checkpointing, vocab tp, embed_sdp, uneven division
    ("gpt-2.7b", False, plan_of(32, 8, 2, 2, False, False, 64, 4)),
    ("gpt-2.7b", False, plan_of(32, 8, 1, 2, True, True, 32, 2, vtp=2, esdp=True)),
    ("gpt-2.7b", False, plan_of(32, 8, 4, 1, False, True, 64, 8)),
    ("gpt-2.7b", False, plan_of(32, 8, 2, 4, False, False, 32, 4, vtp=4).with_(pp_division=(12, 20))),
    ("llama-7b", True, plan_of(32, 8, 2, 2, False, False, 32, 4, sp="megatron")),
    ("llama-7b", True, plan_of(32, 8, 1, 4, True, True, 16, 2, vtp=2, sp="megatron")),
]


@pytest.mark.parametrize("i", range(len(VARIANTS)))
def test_evaluate_is_the_accountings_price(i: int) -> None:
    """Time and per-stage memory of the search's model equal the scorer's, to rounding, in the scorer's context."""
    name, sp, plan = VARIANTS[i]
    prof = profile(name)
    best = GalvatronAccounting(prof, ghw(), 40, sequence_parallel=sp).score(plan).best
    assert best is not None
    cost = Galvatron24CostModel(prof, ghw(), 40, plan.global_batch, best.min_tp, best.max_tp, sequence_parallel=sp)
    got = cost.evaluate(plan)
    assert got.step_time_s == pytest.approx(best.time_s, rel=1e-12)
    assert [x / MB for x in got.stage_memory_bytes] == list(best.used_mb)


def test_galvatrons_plan_and_search() -> None:
    """Galvatron's plan for gpt-2.7b 1x8 40 GB is priced what Galvatron's search reported; our search under
    this model finds a plan at least as fast that fits Galvatron's usable memory (its memory model)."""
    plan = read_plan(T06, 8)
    cost = Galvatron24CostModel(profile(), ghw(), 40, 64)
    assert cost.evaluate(plan).step_time_s == pytest.approx(GALVATRON_T06_TIME, rel=1e-12)
    assert cost.usable_bytes == 32768 * MB  # 40 GB less the 20 % reserve
    hw = read_hardware_profile(DATA / "hardware", 1, 8)
    res = galvatron_search(profile(), hw, ghw(), 40, 64, contexts=[(1, 8), (2, 8)])
    assert res.plan is not None and res.context is not None
    assert res.plan.prediction.step_time_s <= GALVATRON_T06_TIME * (1 + 1e-9)
    check = GalvatronAccounting(profile(), ghw(), 40).score(res.plan).best
    assert check is not None and check.within_budget
    assert check.time_s <= res.plan.prediction.step_time_s * (1 + 1e-9)  # the scorer may find a better context


@pytest.mark.parametrize("name,sp,S,min_tp", [("gpt-2.7b", False, 8, 1), ("gpt-2.7b", False, 4, 2),
                                              ("llama-7b", True, 8, 2), ("llama-7b", True, 4, 1)])
def test_keeps_the_cost_model_contract(name: str, sp: bool, S: int, min_tp: int) -> None:
    prof = profile(name)
    cost = Galvatron24CostModel(prof, ghw(), 40, 2 * S, min_tp, 8, sequence_parallel=sp)
    check_cost_model(cost, prof, world_size=S, space=cost.search_space())


def test_memory_rounds_up_per_layer_like_galvatrons_dp() -> None:
    cost = Galvatron24CostModel(profile(), ghw(), 40, 16)
    c = cost.layer_cost(0, LayerStrategy(tp=2, dp=4, zero=2), StageContext(8, 8, 2))
    assert c.memory(1.0) % MB == 0 and c.memory(1.0) >= c.states + c.act
    assert c.memory(1.0) - (c.states + c.act) < MB


def test_contexts_and_admission() -> None:
    assert galvatron_contexts(8, 8, sequence_parallel=True) == [(a, b) for a in (1, 2, 4, 8) for b in (1, 2, 4, 8)
                                                                 if a <= b]
    assert galvatron_contexts(8, 8, sequence_parallel=False) == [(1, 8), (2, 8), (4, 8), (8, 8)]
    cost = Galvatron24CostModel(profile(), ghw(), 40, 32, min_tp=2)
    assert cost.admits(8, 8) and cost.admits(8, 4) and not cost.admits(8, 2)  # mb splits over 4 groups of 2
    assert not cost.admits(3, 4) and not cost.admits(8, 3)


def test_search_space_holds_galvatrons() -> None:
    """One vtp / embed_sdp for both ends, the context's tp range, ZeRO-2/3, checkpointing; plus uneven stages,
    non-consecutive tp; the searcher pairs each end option with itself."""
    cost = Galvatron24CostModel(profile(), ghw(), 40, 32, min_tp=2, max_tp=4)
    space = cost.search_space()
    assert space.tied_ends and space.min_tp == 2 and space.max_tp == 4 and space.zero_stages == (2, 3)
    assert space.uneven_partition and set(space.checkpoint) == {False, True} and False in space.tp_consecutive
    hw = read_hardware_profile(DATA / "hardware", 1, 8)
    s = Searcher(profile(), hw, 8, cost.usable_bytes, space, cost)
    tab = s.table(4, 8)
    assert tab is not None and {x.tp for x in tab.strategies} == {2, 4}
    groups = s.stage_edges(Config(32, 2, "1f1b", 1, 4), 4, 8)
    assert groups and all(e == h for g in groups for stage in g for e, h in stage)
    assert {g[0][0][0].tp for g in groups} <= {2, 4}


def test_three_d_space_searches_vocab_tp_on_its_own() -> None:
    """The 3-D preset no longer ties the ends' tp to the layers' (Galvatron's 3-D plans choose vtp too)."""
    prof, hw = profile(), read_hardware_profile(DATA / "hardware", 1, 8)
    space = SearchSpace.three_d(max_tp=8, schedules=("1f1b",), vocab_padding=True)
    s = Searcher(prof, hw, 8, 40 * 2**30, space, GalvatronCostModel(prof, hw))
    tab = s.table(8, 8)
    assert tab is not None
    j = next(j for j, x in enumerate(tab.strategies) if x.tp == 1)
    ends = [e for g in s.stage_edges(Config(32, 1, "1f1b", 1, 4, j=j), 8, 8) for stage in g for pair in stage
            for e in pair]
    assert any(e.tp > 1 for e in ends)  # tp-1 layers, vocab-parallel ends on offer


def test_refusals_name_value_rule_and_hint() -> None:
    prof = profile()
    cost = Galvatron24CostModel(prof, ghw(), 40, 64)
    ctx = StageContext(8, 16, 4)
    for bad in (LayerStrategy(tp=2, dp=4, sp="ulysses", zero=2), LayerStrategy(tp=2, dp=4, sp="megatron", zero=2),
                LayerStrategy(dp=8, zero=1), LayerStrategy(dp=8, zero=2, ep=2)):
        with pytest.raises(ValueError, match="HINT:"):
            cost.layer_cost(0, bad, ctx)
    with pytest.raises(ValueError, match="tp=2.*HINT:"):
        Galvatron24CostModel(prof, ghw(), 40, 64, min_tp=4).layer_cost(0, LayerStrategy(tp=2, dp=4, zero=2), ctx)
    plan = read_plan(T06, 8)
    with pytest.raises(ValueError, match="global_batch=32.*HINT:"):
        cost.evaluate(plan.with_(global_batch=32, micro_batches=2))
    with pytest.raises(ValueError, match="gpipe.*HINT:"):
        cost.evaluate(replace(plan_of(32, 8, 2, 1, False, False, 64, 4), pipeline_schedule="gpipe"))
    with pytest.raises(ValueError, match="min_tp=3.*HINT:"):
        Galvatron24CostModel(prof, ghw(), 40, 64, min_tp=3)
    with pytest.raises(ValueError, match="global_batch=0.*HINT:"):
        Galvatron24CostModel(prof, ghw(), 40, 0)
    with pytest.raises(ValueError, match="min_tp=4, max_tp=2.*HINT:"):
        SearchSpace(min_tp=4, max_tp=2)


def test_native_model_stays_the_default() -> None:
    """search() without cost_model= still prices with the native model (plans fit our budget, not Galvatron's)."""
    prof, hw = profile(), read_hardware_profile(DATA / "hardware", 1, 8)
    res = search(prof, hw, 8, 40 * 2**30, global_batch=16, top_k=1,
                 space=SearchSpace(max_tp=8, max_pp=2, schedules=("1f1b",), vocab_padding=True))
    assert res[0].prediction.step_time_s == pytest.approx(
        GalvatronCostModel(prof, hw, SearchSpace().default_embed_zero).evaluate(res[0]).step_time_s, rel=1e-12)


def test_refining_on_galvatrons_1mb_grid_finds_the_memory_tight_plan() -> None:
    """gpt-2.7b 2x8 24 GB: Galvatron's plan leaves 2 MB free; the 4 MB grid misses it, the refined search does not."""
    hw, g2 = read_hardware_profile(DATA / "hardware", 2, 8), ghw(2)
    coarse = galvatron_search(profile(), hw, g2, 24, 32, contexts=[(1, 8)])
    fine = galvatron_search(profile(), hw, g2, 24, 32, contexts=[(1, 8)], refine_mb=1.0)
    assert coarse.plan is not None and fine.plan is not None
    assert fine.plan.prediction.throughput >= coarse.plan.prediction.throughput
    assert fine.plan.prediction.throughput == pytest.approx(68.6456, rel=1e-5)  # Galvatron's plan, by the judge: 68.646
    check = GalvatronAccounting(profile(), g2, 24).score(fine.plan).best
    assert check is not None and check.within_budget


def test_contexts_sharing_layer_dps_find_what_each_finds_alone() -> None:
    """galvatron_search shares one FrontsMemo across its contexts (their stages repeat each other's layer DPs
    at other capacities): every context's plan and prediction are the ones it finds searched on its own."""
    prof, hw = profile("llama-7b"), read_hardware_profile(DATA / "hardware", 1, 8)
    together = galvatron_search(prof, hw, ghw(), 24, 32, sequence_parallel=True)
    assert len(together.contexts) == 10 and together.plan is not None
    for c in together.contexts:
        alone = galvatron_search(prof, hw, ghw(), 24, 32, sequence_parallel=True, contexts=[(c.min_tp, c.max_tp)])
        got, want = c.plan, alone.contexts[0].plan
        assert (got is None) == (want is None)
        if got is not None:
            assert got.to_dict() == want.to_dict()  # strategies, division, prediction: exactly
