"""Galvatron's --sp_space tp+sp (Ulysses layers, sequence-split ends, vsp at vtp 1 included) and its gpipe pipeline
type, against golden numbers of Galvatron 2.4.0's own cost model (the judge), taken by
benchmarks/galvatron_judge_golden.py and committed in tests/data/galvatron/judge_golden.json (CI has no judge venv):
per plan the judge's best context, time per iteration and memory per stage; per search configuration Galvatron's
own plan and its score; our gpipe searches' plans and the judge's score of them."""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

import pytest

from lightning_galv.compat.galvatron import (SIDE_FIELD, read_galvatron_hardware, read_hardware_profile,
                                             read_model_profile, read_plan, write_plan)
from lightning_galv.plan import LayerStrategy, ParallelPlan
from lightning_galv.planner.contract import check_cost_model
from lightning_galv.planner.cost import StageContext
from lightning_galv.planner.galvatron_accounting import MB, GalvatronAccounting, collective_tables
from lightning_galv.planner.galvatron_model import Galvatron24CostModel, galvatron_contexts, galvatron_search
from lightning_galv.planner.searcher import Config, Searcher
from lightning_galv.planner.space import SequenceSplitEnd, end_strategies

DATA = Path(__file__).resolve().parent / "data" / "galvatron"
GOLDEN = json.loads((DATA / "judge_golden.json").read_text())
MODELS = {  # as the judge's default profile sets (benchmarks/vs_galvatron.py MODELS): family, reader, Megatron-SP
    "gpt-2.7b": ("gpt_hf", dict(layout="legacy"), False),
    "gpt-6.7b": ("gpt_hf", dict(layout="2.4", memory_mode="sequence"), True),
    "llama-7b": ("llama_hf", dict(layout="legacy"), True),
}
TOL = 0.01  # issue 15: within 1 % of the judge


@lru_cache(maxsize=None)
def profile(name: str):
    fam, kw, _ = MODELS[name]
    return read_model_profile(DATA / "models" / fam / "meta_configs" / f"{name}.json", DATA / "models" / fam / "configs",
                              **kw)


@lru_cache(maxsize=None)
def ghw(nodes: int):
    return read_galvatron_hardware(DATA / "hardware", nodes, 8)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _case(c: dict) -> tuple[ParallelPlan, GalvatronAccounting]:
    sp = MODELS[c["model"]][2]
    plan = read_plan(c["plan"], 8 * c["nodes"], sequence_parallel=sp)
    acc = GalvatronAccounting(profile(c["model"]), ghw(c["nodes"]), c["memory_gb"], sequence_parallel=sp,
                              default_dp_type=c["plan"]["default_dp_type"], sp_space=c["sp_space"])
    return plan, acc


PLANS = GOLDEN["plans"]


def test_golden_cases_cover_ulysses_vsp_and_gpipe() -> None:
    tpsp = [c for c in PLANS if c["sp_space"] == "tp+sp"]
    assert len(tpsp) >= 8 and all(c["judge"] is not None for c in PLANS)
    assert sum("1" in c["plan"]["use_sp"].split(",") for c in tpsp) >= 8
    assert sum(int(c["plan"]["vsp"]) for c in tpsp) >= 5
    assert {c["judge"]["sp_search"] for c in tpsp} >= {2, 3}  # the Ulysses-only context (no Megatron-SP buffer) too
    gpipe = [c for c in PLANS if c["plan"]["pipeline_type"] == "gpipe"]
    assert len(gpipe) >= 6 and all(int(c["plan"]["pp_deg"]) > 1 for c in gpipe)
    assert {c["nodes"] for c in gpipe} == {1, 2} and {c["plan"]["default_dp_type"] for c in gpipe} == {"zero2", "ddp"}
    vtp1 = [c for c in tpsp if int(c["plan"]["vsp"]) and int(c["plan"]["vtp"]) == 1]
    assert len(vtp1) >= 5 and {int(c["plan"]["pp_deg"]) > 1 for c in vtp1} == {False, True}
    assert {c["judge"]["sp_search"] for c in vtp1} >= {2, 3} and {c["model"] for c in vtp1} >= {"llama-7b", "gpt-6.7b"}


@pytest.mark.parametrize("c", PLANS, ids=lambda c: f"{c['model']}-{c['name']}")
def test_accounting_matches_the_judge(c: dict) -> None:
    """Time and per-stage memory within 1 % of Galvatron's own model, in the judge's best context."""
    plan, acc = _case(c)
    j = c["judge"]
    best = acc.score(plan).best
    assert best is not None
    assert (best.min_tp, best.max_tp, best.sp_search) == (j["min_tp"], j["max_tp"], j["sp_search"])
    assert rel(best.time_s, j["time_per_iter_s"]) < TOL
    assert len(best.used_mb) == len(j["mem_used_MB_per_stage"])
    assert max(rel(a, b) for a, b in zip(best.used_mb, j["mem_used_MB_per_stage"])) < TOL
    assert best.usable_mb == j["usable_MB"] and best.within_budget == j["within_budget"]


def search_model(c: dict, plan: ParallelPlan) -> Galvatron24CostModel:
    """Galvatron24CostModel of a golden case, in the judge's best context and the plan's pipeline type."""
    j = c["judge"]
    return Galvatron24CostModel(profile(c["model"]), ghw(c["nodes"]), c["memory_gb"], plan.global_batch or 0,
                                j["min_tp"], j["max_tp"], MODELS[c["model"]][2], c["plan"]["default_dp_type"],
                                c["sp_space"], j["sp_search"] if c["sp_space"] == "tp+sp" else None,
                                c["plan"]["pipeline_type"])


@pytest.mark.parametrize("c", PLANS, ids=lambda c: f"{c['model']}-{c['name']}")
def test_search_model_matches_the_judge(c: dict) -> None:
    """Galvatron24CostModel (what the search runs on) in the judge's context prices the plan as the judge: 1F1B
    and GPipe (one kept micro-batch per stage), vsp at vtp 1 (ParallelPlan.vocab_sp) included."""
    plan, _ = _case(c)
    j = c["judge"]
    got = search_model(c, plan).evaluate(plan)
    assert rel(got.step_time_s, j["time_per_iter_s"]) < TOL
    assert len(got.stage_memory_bytes) == len(j["mem_used_MB_per_stage"])
    assert max(rel(a / MB, b) for a, b in zip(got.stage_memory_bytes, j["mem_used_MB_per_stage"])) < TOL


@pytest.mark.parametrize("c", PLANS, ids=lambda c: f"{c['model']}-{c['name']}")
def test_plan_json_round_trips_use_sp_and_vsp(c: dict) -> None:
    """read_plan -> write_plan gives back every key Galvatron reads (use_sp, vsp included), so the judge scores
    the written plan exactly as the original."""
    plan, _ = _case(c)
    out = {k: v for k, v in write_plan(plan).items() if k != SIDE_FIELD}  # Megatron-SP: a launch flag, kept aside
    assert {k: str(v) for k, v in out.items()} == {k: str(v) for k, v in c["plan"].items()}


def test_collective_tables_are_galvatrons_fit() -> None:
    """remap_config: all-reduce halved, a measured size read from the table, others from the least-squares line."""
    sp = json.loads((DATA / "hardware" / "sp_time_1nodes_8gpus_per_node.json").read_text())
    ar, a2a = collective_tables(sp, "allreduce"), collective_tables(sp, "all2all")
    assert sorted(ar) == sorted(a2a) == [2, 4, 8]
    assert ar[8].at(64.0 * 2**20) == sp["allreduce_size_8_64MB_time"] / 2  # float message equal to a measured size
    assert a2a[4].at(16 * 2**20) == sp["all2all_size_4_16MB_time"]
    t = a2a[8]
    assert t.at(40 * 2**20) == pytest.approx(t.slope * 40 + t.intercept) and t.slope > 0
    with pytest.raises(ValueError, match="8 message sizes.*HINT:"):
        collective_tables({"all2all_size_2_1MB_time": 0.1}, "all2all")


def test_contexts_of_tp_sp() -> None:
    """sp_search 3 covers 1 at the same price; 2 (no Megatron-SP buffer) only with Megatron-SP, widest max_tp."""
    assert galvatron_contexts(8, 8, sequence_parallel=False, sp_space="tp+sp") == [(1, 8, 3), (2, 8, 3), (4, 8, 3),
                                                                                   (8, 8, 3)]
    with_sp = galvatron_contexts(8, 8, sequence_parallel=True, sp_space="tp+sp")
    assert [c for c in with_sp if c[2] == 2] == [(1, 8, 2), (2, 8, 2), (4, 8, 2), (8, 8, 2)]
    assert len([c for c in with_sp if c[2] == 3]) == 10
    assert galvatron_contexts(8, 8, sequence_parallel=True) == [(a, b) for a in (1, 2, 4, 8) for b in (1, 2, 4, 8)
                                                                 if a <= b]  # sp_space 'tp' unchanged


def test_tp_sp_space_and_refusals() -> None:
    prof = profile("llama-7b")
    cost = Galvatron24CostModel(prof, ghw(1), 40, 32, 1, 8, True, sp_space="tp+sp")
    space = cost.search_space()
    assert set(space.sp_modes) == {"megatron", "ulysses"} and set(space.vocab_sp) == {False, True}
    only = Galvatron24CostModel(prof, ghw(1), 40, 32, 1, 8, True, sp_space="tp+sp", sp_search=2).search_space()
    assert only.sp_modes == ("ulysses",) and only.vocab_sp == (True,)
    tp_only = Galvatron24CostModel(prof, ghw(1), 40, 32, 1, 8, True).search_space()
    assert tp_only.sp_modes == ("megatron",) and tp_only.vocab_sp == (False,)
    ctx = StageContext(8, 8, 4)
    uly = LayerStrategy(tp=2, dp=4, sp="ulysses", zero=2)
    assert cost.layer_cost(0, uly, ctx).fwd > 0
    with pytest.raises(ValueError, match="sp_search 2 holds Ulysses layers only.*HINT:"):
        Galvatron24CostModel(prof, ghw(1), 40, 32, 1, 8, True, sp_space="tp+sp", sp_search=2).layer_cost(
            0, LayerStrategy(tp=2, dp=4, sp="megatron", zero=2), ctx)
    with pytest.raises(ValueError, match="sp_space 'tp'.*HINT:.*tp\\+sp"):
        Galvatron24CostModel(prof, ghw(1), 40, 32, 1, 8, True).layer_cost(0, uly, ctx)
    with pytest.raises(ValueError, match="sp_search=2.*HINT:"):
        Galvatron24CostModel(prof, ghw(1), 40, 32, 1, 8, True, sp_search=2)
    with pytest.raises(ValueError, match="sp_space='tp\\+ssp'.*HINT:"):
        GalvatronAccounting(prof, ghw(1), 40, sp_space="tp+ssp")
    bare = type(ghw(1))(8, ghw(1).comm_coe, ghw(1).p2p_coe, ghw(1).overlap_coe)
    with pytest.raises(ValueError, match="sp_time.*HINT:"):
        GalvatronAccounting(prof, bare, 40, sp_space="tp+sp")


@pytest.mark.parametrize("S,min_tp,sps", [(8, 1, 3), (4, 2, 3), (8, 1, 2)])
def test_tp_sp_keeps_the_cost_model_contract(S: int, min_tp: int, sps: int) -> None:
    prof = profile("llama-7b")
    cost = Galvatron24CostModel(prof, ghw(1), 40, 2 * S, min_tp, 8, True, sp_space="tp+sp", sp_search=sps)
    check_cost_model(cost, prof, world_size=S, space=cost.search_space())


SEARCHES = [s for s in GOLDEN["searches"] if s["plan"] is not None]
# our price of a plan matches the judge's to ~1e-5 (Galvatron fits its collective lines with scipy's iterative
# curve_fit, we in closed form), so "at least as fast" is up to that
SLACK = 1e-4


def uses_ulysses(d: dict) -> bool:
    return "1" in str(d["use_sp"]).split(",")


@pytest.mark.parametrize("s", SEARCHES, ids=lambda s: f"{s['model']}-{s['nodes']}x8-{s['memory_gb']}G")
def test_tp_sp_search_at_least_galvatrons(s: dict) -> None:
    """Galvatron's own tp+sp search's plan is priced by us as by the judge, and our tp+sp search (every context)
    finds a plan at least as fast under Galvatron's model that fits its usable memory."""
    name, nodes, mem, bsz, j = s["model"], s["nodes"], s["memory_gb"], s["global_batch"], s["judge"]
    sp = MODELS[name][2]
    galv = read_plan(s["plan"], 8 * nodes, sequence_parallel=sp)
    acc = GalvatronAccounting(profile(name), ghw(nodes), mem, sequence_parallel=sp, sp_space="tp+sp")
    mine = acc.score(galv).best
    assert mine is not None and rel(mine.time_s, j["time_per_iter_s"]) < TOL  # our price of Galvatron's plan
    assert max(rel(a, b) for a, b in zip(mine.used_mb, j["mem_used_MB_per_stage"])) < TOL
    hw = read_hardware_profile(DATA / "hardware", nodes, 8)
    res = galvatron_search(profile(name), hw, ghw(nodes), mem, bsz, sequence_parallel=sp, sp_space="tp+sp")
    assert res.plan is not None and res.plan.prediction is not None
    assert res.plan.prediction.step_time_s <= j["time_per_iter_s"] * (1 + SLACK)
    check = acc.score(res.plan).best
    assert check is not None and check.within_budget
    assert check.time_s <= j["time_per_iter_s"] * (1 + SLACK)


def test_ulysses_where_it_pays() -> None:
    """Under Galvatron's model a Ulysses layer pays only in the Ulysses-only context (no Megatron-SP buffer):
    elsewhere its all-to-alls cost more than the all-reduce halves of tp and its states are tp times larger.
    Galvatron's own search picked none on the golden configurations; ours does on at least one (gpt-6.7b
    2x8 24 GB), and the judge scored that plan (golden 'ours') within Galvatron's budget and at least as fast
    as Galvatron's own tp+sp plan -- and we price it as the judge did."""
    hits = [s for s in SEARCHES if s["ours"]["plan"] is not None and uses_ulysses(s["ours"]["plan"])]
    assert hits, "our tp+sp search chose no Ulysses layer on any golden configuration"
    for s in hits:
        ours, galv = s["ours"]["judge"], s["judge"]
        assert ours["within_budget"] and ours["time_per_iter_s"] <= galv["time_per_iter_s"] * (1 + SLACK)
        sp = MODELS[s["model"]][2]
        plan = read_plan(s["ours"]["plan"], 8 * s["nodes"], sequence_parallel=sp)
        best = GalvatronAccounting(profile(s["model"]), ghw(s["nodes"]), s["memory_gb"], sequence_parallel=sp,
                                   sp_space="tp+sp").score(plan).best
        assert best is not None and (best.min_tp, best.max_tp, best.sp_search) == (ours["min_tp"], ours["max_tp"],
                                                                                    ours["sp_search"])
        assert rel(best.time_s, ours["time_per_iter_s"]) < TOL
        assert max(rel(a, b) for a, b in zip(best.used_mb, ours["mem_used_MB_per_stage"])) < TOL


def test_gpipe_memory_is_one_micro_batch_per_stage() -> None:
    """The search model's GPipe layers keep Galvatron's one (min_tp-group) micro-batch: the same activation bytes
    on every stage, and less than 1F1B keeps on the first stage (pp micro-batches there)."""
    prof = profile("gpt-2.7b")
    s = LayerStrategy(tp=2, dp=2, zero=2)
    gp = Galvatron24CostModel(prof, ghw(1), 40, 64, pipeline_type="gpipe")
    fb = Galvatron24CostModel(prof, ghw(1), 40, 64)
    ctxs = [StageContext(4, 16, 4, 2, st, "gpipe") for st in (0, 1)]
    mems = [gp.layer_cost(0, s, c).memory(c.inflight) for c in ctxs]
    assert mems[0] == mems[1]
    c1 = StageContext(4, 16, 4, 2, 0, "1f1b")
    assert mems[0] < fb.layer_cost(0, s, c1).memory(c1.inflight)
    # Galvatron's micro-batch in context min_tp 1: 64 samples over 4 one-wide groups, in 4 chunks -> 4
    want = GalvatronAccounting(prof, ghw(1), 40).layer_memory(0, s, 2, 0, 64, 4, 1, "gpipe")
    assert mems[0] == math.ceil(want) * MB
    assert gp.search_space().schedules == ("gpipe",) and fb.search_space().schedules == ("1f1b",)
    with pytest.raises(ValueError, match="pipeline_type='1f1b'.*HINT:.*pipedream_flush"):
        Galvatron24CostModel(prof, ghw(1), 40, 64, pipeline_type="1f1b")


@pytest.mark.parametrize("S,min_tp", [(8, 1), (4, 1), (4, 2)])
def test_gpipe_keeps_the_cost_model_contract(S: int, min_tp: int) -> None:
    """With a model of world 8, S = 4 probes two-stage GPipe plans, S = 8 one-stage ones."""
    prof = profile("llama-7b")
    cost = Galvatron24CostModel(prof, ghw(1), 40, 2 * S, min_tp, 8, True, pipeline_type="gpipe")
    check_cost_model(cost, prof, world_size=S, space=cost.search_space())


GPIPE_SEARCHES = GOLDEN["gpipe_searches"]


def _up_to_layer_order(plan: dict) -> tuple:
    """A Galvatron plan with each pipeline stage's per-layer strategies sorted. These models' layers are identical,
    so strategies swapped between layers of one stage price the same (time and memory); which of those exact ties
    the DP's path reconstruction returns turns on float rounding (it changed with a numpy upgrade: 2.4.6 put a
    ZeRO-3 layer of stage 1 one position later). Everything else must match as it is."""
    stages = [int(x) for x in str(plan["pp_division"]).split(",")]
    n = sum(stages)
    per_layer = sorted(k for k, v in plan.items() if isinstance(v, str) and v.count(",") == n - 1 and k != "pp_division")
    rest = tuple(sorted((k, str(v)) for k, v in plan.items() if k not in per_layer))
    cols = list(zip(*(str(plan[k]).split(",") for k in per_layer)))  # [layer] -> tuple over per_layer fields
    starts = [sum(stages[:i]) for i in range(len(stages))]
    return rest, tuple(tuple(sorted(cols[a:a + m])) for a, m in zip(starts, stages))


@pytest.mark.parametrize("s", GPIPE_SEARCHES, ids=lambda s: f"{s['model']}-{s['nodes']}x8-{s['memory_gb']}G")
def test_gpipe_search_fits_the_judges_budget(s: dict) -> None:
    """Our search with Galvatron's pipeline_type 'gpipe' returns the plan the judge scored (golden 'ours'; re-run
    benchmarks/galvatron_judge_golden.py when the search changes on purpose), up to ties our model prices exactly
    alike (identical layers of a stage in another order; another partition at the same step time): a pipeline,
    within Galvatron's budget by the judge, and priced by us as by the judge."""
    name, nodes, mem, bsz = s["model"], s["nodes"], s["memory_gb"], s["global_batch"]
    sp = MODELS[name][2]
    hw = read_hardware_profile(DATA / "hardware", nodes, 8)
    res = galvatron_search(profile(name), hw, ghw(nodes), mem, bsz, sequence_parallel=sp, pipeline_type="gpipe")
    assert res.plan is not None and res.plan.prediction is not None and res.context is not None
    got = {k: v for k, v in write_plan(res.plan, side=True).items() if k != SIDE_FIELD}
    j = s["ours"]["judge"]
    assert j is not None and j["within_budget"]
    assert max(j["mem_used_MB_per_stage"]) <= j["usable_MB"]
    assert rel(res.plan.prediction.step_time_s, j["time_per_iter_s"]) < TOL
    if _up_to_layer_order(got) != _up_to_layer_order(s["ours"]["plan"]):
        # another stage partition that our model prices *exactly* like the golden one: the search met an exact tie
        # and float rounding of its partial sums broke it the other way (as with a numpy upgrade, 2.4.6: stages of
        # 5,5,2 layers instead of 4,4,4 at the same step time). The judge never scored this plan, so: the golden
        # plan must price exactly as ours in our model (a tie, not a worse pick), and ours fit Galvatron's budget
        lo, hi = res.context[:2]
        cost = Galvatron24CostModel(profile(name), ghw(nodes), mem, bsz, lo, hi, sp, "zero2", "tp", 1, "gpipe")
        gold = read_plan(s["ours"]["plan"], 8 * nodes, sequence_parallel=sp)
        assert cost.evaluate(gold).step_time_s == res.plan.prediction.step_time_s, (got, s["ours"]["plan"])
        assert max(res.plan.prediction.stage_memory_bytes) / MB <= j["usable_MB"]
        return
    assert max(rel(a / MB, b) for a, b in zip(res.plan.prediction.stage_memory_bytes, j["mem_used_MB_per_stage"])) < TOL


def test_gpipe_search_pipelines_somewhere() -> None:
    """GPipe matters only with pp > 1: at least one golden gpipe search picked a pipeline (else the test above
    would check nothing GPipe-specific)."""
    assert any(int(s["ours"]["plan"]["pp_deg"]) > 1 and s["ours"]["plan"]["pipeline_type"] == "gpipe"
               for s in GPIPE_SEARCHES)


def test_vsp_at_vtp1_is_in_the_space() -> None:
    """Galvatron's search visits vsp with every vtp of its context, 1 included where min_tp is 1; so does ours:
    a SequenceSplitEnd (tied ends), emitted as ParallelPlan.vocab_sp."""
    prof = profile("llama-7b")
    hw = read_hardware_profile(DATA / "hardware", 1, 8)
    for sps, want in ((2, {True}), (3, {False, True})):
        cost = Galvatron24CostModel(prof, ghw(1), 40, 32, 1, 8, True, sp_space="tp+sp", sp_search=sps)
        ends = end_strategies(prof.shape, 8, 8, cost.search_space(), hw)
        assert {isinstance(e, SequenceSplitEnd) for e in ends if e.tp == 1} == want
    at2 = Galvatron24CostModel(prof, ghw(1), 40, 32, 2, 8, True, sp_space="tp+sp", sp_search=2)
    assert all(e.tp >= 2 for e in end_strategies(prof.shape, 8, 8, at2.search_space(), hw))
    untied = Galvatron24CostModel(prof, ghw(1), 40, 32, 1, 8, True, sp_space="tp+sp").search_space(tied_ends=False)
    assert not any(isinstance(e, SequenceSplitEnd) for e in end_strategies(prof.shape, 8, 8, untied, hw))
    e = SequenceSplitEnd(tp=1, dp=8, zero=2)
    assert e != e.plain() and e.plain() == LayerStrategy(tp=1, dp=8, zero=2) and SequenceSplitEnd.of(e.plain()) == e
    with pytest.raises(ValueError, match="tp=2.*HINT:"):
        SequenceSplitEnd(tp=2, dp=4)


def test_search_emits_vsp_at_vtp1_as_vocab_sp() -> None:
    """In the Ulysses-only context with min_tp 1 a vtp-1 end must be sequence-split: the searcher's plans with
    vtp 1 carry vocab_sp, and the model prices them as the accounting does (checked against the judge above)."""
    prof = profile("gpt-6.7b")
    hw = read_hardware_profile(DATA / "hardware", 1, 8)
    cost = Galvatron24CostModel(prof, ghw(1), 40, 32, 1, 8, True, sp_space="tp+sp", sp_search=2)
    s = Searcher(prof, hw, 8, cost.usable_bytes, cost.search_space(), cost)
    seen = [e for g in s.stage_edges(Config(32, 1, "1f1b", 1, 4), 8, 8) for stage in g for pair in stage for e in pair]
    assert any(isinstance(e, SequenceSplitEnd) for e in seen)
    uly = LayerStrategy(tp=8, dp=1, sp="ulysses", zero=2)
    one = ParallelPlan.uniform(8, prof.num_layers, uly, micro_batches=4, global_batch=32,
                               embed=LayerStrategy(dp=8, zero=2), head=LayerStrategy(dp=8, zero=2)).with_(vocab_sp=True)
    acc = GalvatronAccounting(prof, ghw(1), 40, sequence_parallel=True, sp_space="tp+sp")
    got, ref = cost.evaluate(one), acc.score_in(one, 1, 8, True, False, 2)
    assert ref is not None and not ref.reasons
    assert got.step_time_s == pytest.approx(ref.time_s, rel=1e-12)
    assert [x / MB for x in got.stage_memory_bytes] == list(ref.used_mb)


def test_megatron_sp_parameter_size_is_galvatrons() -> None:
    """Under --sequence_parallel Galvatron prices layer states and gradient traffic from the SP memory table's
    parameter_size (llama-7b legacy: 773.017 MB, the plain table says 773.251): the profile keeps both, and with
    it our per-stage memory of every llama golden plan is the judge's to the MB (it was 1 MB high per layer)."""
    lt = profile("llama-7b").layer_types[0]
    assert lt.params_sp is not None and lt.params_sp * 4 / MB == pytest.approx(773.0166015625, abs=1e-5)
    assert lt.params * 4 / MB == pytest.approx(773.2509765625, abs=1e-5)
    assert profile("gpt-2.7b").layer_types[0].params_sp is None  # no separate SP table: nothing to keep
    llama = [c for c in PLANS if c["model"] == "llama-7b"]
    assert len(llama) >= 8
    for c in llama:
        plan, acc = _case(c)
        best = acc.score(plan).best
        assert best is not None
        assert max(abs(a - b) for a, b in zip(best.used_mb, c["judge"]["mem_used_MB_per_stage"])) <= 1, c["name"]
