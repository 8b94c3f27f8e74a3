"""Expert parallelism in the planner: MoE profiles, the cost model's ep formulas by hand, the joint search.

Pure (no torch, no processes). The large case is a Mixtral-8x7B-like model (hidden 4096, 32 layers, 8 SwiGLU
experts of width 14336, top-2, GQA 32/8 heads, sequence 4096, bf16) on 64 simulated A100s: Galvatron's own
measured A100 profile (2 nodes x 8, shipped in tests/data/galvatron) stretched to 8 nodes -- groups larger than
the measured ones take the nearest measured size's fit (HardwareProfile.link), all-to-all inside a node comes
from Galvatron's sp_time measurements.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from lightning_galv.cli import main as galv
from lightning_galv.compat.galvatron import read_hardware_profile
from lightning_galv.plan import LayerStrategy, ModelShape, ParallelPlan
from lightning_galv.planner import GalvatronCostModel, SearchSpace, search
from lightning_galv.planner.contract import check_cost_model
from lightning_galv.planner.cost import OPTIMIZER_TRAFFIC_BYTES, StageContext, overlapped
from lightning_galv.planner.profiles import (HardwareProfile, LayerTypeProfile, LinkFit, ModelProfile, MoELayerFacts,
                                             TimeFit, act_key)
from lightning_galv.planner.space import applies, candidate_strategies, end_strategies

ROOT = Path(__file__).resolve().parent.parent
REF = Path(__file__).resolve().parent / "data" / "galvatron"
GiB = float(2**30)
SHAPE = ModelShape(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, ffn_hidden=14336, vocab_size=32000,
                   seq_len=4096)
FACTS = MoELayerFacts.swiglu(4096, num_experts=8, top_k=2, expert_hidden=14336)
ATTN = 2 * 4096 * 4096 + 2 * 4096 * 128 * 8  # wq, wo + wk, wv (8 kv heads of 128)
NORMS = 4 * 4096  # the analytic profile's convention
EXPERT = 3 * 4096 * 14336  # w1, w2, w3
ROUTER = 4096 * 8
A2A_BYTES = 4096 * 2 * 4096 * 2  # one sample's tokens x top-2 rows x 4096 x bf16


def a100(nodes: int = 8) -> HardwareProfile:
    return replace(read_hardware_profile(REF / "hardware", 2, 8), num_nodes=nodes)


def mixtral(moe_layers: range | None = None) -> ModelProfile:
    """All 32 blocks MoE (Mixtral), or only ``moe_layers`` (the others dense SwiGLU of width 14336)."""
    return ModelProfile.from_shape(SHAPE, moe=FACTS, moe_layers=moe_layers)


MIXED = range(1, 32, 2)  # every other block MoE
CTX = StageContext(64, 64, 1)  # 64 ranks, 64-sample micro-batch: one sample per rank at dp64


# ---------------------------------------------------------------------------------------------------
# profiles
# ---------------------------------------------------------------------------------------------------
def test_mixtral_profile_counts_and_json_round_trip() -> None:
    prof = mixtral()
    lt = prof.layer(0)
    assert lt.moe == FACTS and FACTS.expert_params == EXPERT and FACTS.router_params == ROUTER
    assert lt.params == ATTN + NORMS + 8 * EXPERT + ROUTER == 1_451_278_336
    assert prof.total_params == pytest.approx(46.70e9, rel=1e-3)  # Mixtral 8x7B: 46.7 B
    assert prof.num_experts == (8,) and mixtral(MIXED).layer_type_of[:4] == (0, 1, 0, 1)
    for p in (prof, mixtral(MIXED)):
        assert ModelProfile.from_json(p.to_json()) == p
    dense = ModelProfile.from_shape(SHAPE)
    assert '"moe"' not in dense.to_json() and dense.num_experts == ()  # dense profiles serialize as before


def test_moe_facts_are_validated() -> None:
    with pytest.raises(ValueError, match="HINT:"):
        MoELayerFacts(num_experts=2, top_k=3, expert_params=10, dim=4)
    with pytest.raises(ValueError, match="HINT:"):
        MoELayerFacts(num_experts=0, top_k=1, expert_params=10, dim=4)
    with pytest.raises(ValueError, match="HINT:"):  # experts larger than the whole block
        LayerTypeProfile("b", TimeFit(), TimeFit(), 100, {act_key(1, "none", False): 1.0}, 4,
                         moe=MoELayerFacts(8, 2, 100, 4))
    with pytest.raises(ValueError, match="HINT:"):
        ModelProfile.from_shape(SHAPE, moe=FACTS, moe_layers=[40])
    lt = LayerTypeProfile("b", TimeFit(), TimeFit(), 10_000, {act_key(1, "none", False): 1.0}, 4,
                          moe={"num_experts": 4, "top_k": 1, "expert_params": 48, "dim": 4})
    assert lt.moe == MoELayerFacts(4, 1, 48, 4)  # a mapping (from JSON) becomes the dataclass


# ---------------------------------------------------------------------------------------------------
# cost model: formulas by hand
# ---------------------------------------------------------------------------------------------------
def test_expert_states_fall_with_ep_by_hand() -> None:
    """16 bytes/parameter (mixed-precision Adam): the dense part (attention, norms, router) stays whole, the
    experts go E/ep per rank; ZeRO-1 shards the optimizer states of the experts over the 64/ep expert-data ranks,
    ZeRO-3 everything -- so under ZeRO-3 ep saves no state memory (16 E P / 64 either way)."""
    cm = GalvatronCostModel(mixtral(), a100())
    dense = ATTN + NORMS + ROUTER
    got = {}
    for ep in (1, 2, 4, 8):
        experts = 8 / ep * EXPERT
        z0 = cm.layer_cost(0, LayerStrategy(dp=64, ep=ep), CTX)
        assert z0.states == pytest.approx(16 * (dense + experts), rel=1e-12)
        z1 = cm.layer_cost(0, LayerStrategy(dp=64, ep=ep, zero=1), CTX)
        assert z1.states == pytest.approx((4 + 12 / 64) * dense + (4 + 12 / (64 / ep)) * experts, rel=1e-12)
        z3 = cm.layer_cost(0, LayerStrategy(dp=64, ep=ep, zero=3), CTX)
        assert z3.states == pytest.approx(16 * (dense + 8 * EXPERT) / 64, rel=1e-12)
        assert z0.act == z1.act == z3.act  # balanced routing: ep moves rows, it keeps none
        got[ep] = z0.states
    # predicted GiB per MoE layer at ZeRO-0: 21.63, 11.13, 5.88, 3.25 -- the experts' ~21 GiB falls as 1/ep
    assert [round(got[ep] / GiB, 2) for ep in (1, 2, 4, 8)] == [21.63, 11.13, 5.88, 3.25]
    expert_part = {ep: got[ep] - 16 * dense for ep in got}
    assert all(expert_part[ep] == pytest.approx(expert_part[1] / ep, rel=1e-12) for ep in got)


def test_alltoall_time_by_hand_grows_with_ep() -> None:
    """Per MoE layer and micro-batch (one sample of 4096 tokens per rank): forward = compute + the router-statistics
    all-reduce over the 64 data ranks + (ep > 1) the count all-gather and the dispatch and combine
    all-to-alls of 4096 x 2 rows x 4096 x 2 bytes = 64 MiB each, (ep-1)/ep of which leave the rank; backward =
    2 x compute + the two all-to-alls again. All-to-all fits: Galvatron's A100 sp_time measurements."""
    hw = a100()
    cm = GalvatronCostModel(mixtral(), hw)
    active = ATTN + NORMS + ROUTER + 2 * EXPERT  # router, top-2 experts, attention: what one token goes through
    compute = TimeFit(50e-6, 2 * active / 150e12, 4 * 4096 / 150e12)(1, 4096)
    router = hw.collective_time("allreduce", 16 * 9, 64)  # one all-reduce: 2 x 9 float64
    a2a = {}
    for ep in (1, 2, 4, 8):
        c = cm.layer_cost(0, LayerStrategy(dp=64, ep=ep), CTX)
        if ep == 1:
            assert c.fwd == pytest.approx(compute + router, rel=1e-12)
            assert c.bwd == pytest.approx(2 * compute, rel=1e-12)  # analytic backward: 2x forward
            continue
        fit = hw.links[f"alltoall/{ep}/consec/intra"]
        a2a[ep] = fit.latency_s + (ep - 1) / ep * A2A_BYTES / fit.bandwidth
        counts = hw.collective_time("allgather", 8 * 8 * ep, ep)
        assert c.fwd == pytest.approx(compute + router + counts + 2 * a2a[ep], rel=1e-12)
        assert c.bwd == pytest.approx(2 * compute + 2 * a2a[ep], rel=1e-12)
        ck = cm.layer_cost(0, LayerStrategy(dp=64, ep=ep, checkpoint=True), CTX)  # recompute repeats the forward's
        assert ck.bwd == pytest.approx(c.bwd + compute + router + counts + 2 * a2a[ep], rel=1e-12)
    assert a2a[2] < a2a[4] < a2a[8]
    assert [round(a2a[ep] * 1e3, 3) for ep in (2, 4, 8)] == [0.285, 0.344, 0.403]  # ms per all-to-all


def test_routing_skew_adds_the_busiest_ranks_expert_work_by_hand() -> None:
    """A measured routing skew (MoELayerFacts.routing_skew) makes the busiest EP rank push (skew - 1) x its mean
    routed copies more through one expert's weights, at the profile's matmul rate: forward 2 FLOPs per weight,
    backward 4, a checkpointed layer's recompute the forward again. Balanced routing (no skew) and ep = 1 (every
    expert local: the rank's tokens x top_k whatever the routing) are unchanged, and so is a profile without a
    measured matmul rate."""
    rate = 100e12
    base = mixtral().with_(matmul_flops=rate)
    skewed = base.with_routing_skew({2: 1.2, 4: 1.5})
    plain, cm = GalvatronCostModel(base, a100()), GalvatronCostModel(skewed, a100())
    copies = 4096 * 2  # one sample of 4096 tokens per rank, top-2
    for ep, k in ((2, 1.2), (4, 1.5), (8, 1.0)):  # ep 8 was not measured: balanced
        for ck in (False, True):
            s = LayerStrategy(dp=64, ep=ep, checkpoint=ck)
            a, b = plain.layer_cost(0, s, CTX), cm.layer_cost(0, s, CTX)
            extra = (k - 1) * copies * EXPERT / rate
            assert b.fwd - a.fwd == pytest.approx(2 * extra, rel=1e-9, abs=1e-15)
            assert b.bwd - a.bwd == pytest.approx((4 + (2 if ck else 0)) * extra, rel=1e-9, abs=1e-15)
            assert (b.states, b.act, b.transient) == (a.states, a.act, a.transient)
    assert round((1.5 - 1) * copies * EXPERT / rate * 6 * 1e3, 3) == 43.293  # ms per layer and micro-batch at ep 4: 0.5 x 8192 copies x 176 M weights x 6 FLOPs / 100 TFLOP/s
    s1 = LayerStrategy(dp=64)
    assert cm.layer_cost(0, s1, CTX) == plain.layer_cost(0, s1, CTX)
    no_rate = mixtral().with_routing_skew({4: 1.5})
    s4 = LayerStrategy(dp=64, ep=4)
    unrated = GalvatronCostModel(no_rate, a100()).layer_cost(0, s4, CTX)
    assert unrated == GalvatronCostModel(mixtral(), a100()).layer_cost(0, s4, CTX)
    # Ulysses: a rank routes 1/tp of the sequence
    su = LayerStrategy(tp=2, dp=32, sp="ulysses", ep=4)
    d = cm.layer_cost(0, su, CTX).fwd - plain.layer_cost(0, su, CTX).fwd
    assert d == pytest.approx(2 * 0.5 * (copies * 2 / 2) * EXPERT / rate, rel=1e-9)  # 2 samples per data shard / tp 2


def test_routing_skew_round_trips_and_is_validated() -> None:
    skewed = mixtral(MIXED).with_routing_skew({4: 1.5, 2: 1.25})
    assert skewed.layer(1).moe.routing_skew == ((2, 1.25), (4, 1.5)) and skewed.layer(0).moe is None
    assert ModelProfile.from_json(skewed.to_json()) == skewed
    assert '"routing_skew"' not in mixtral().to_json()  # unmeasured: serialized as before the field existed
    assert skewed.with_routing_skew({}) == mixtral(MIXED)
    for bad in ({1: 1.2}, {2: 0.9}, {2: float("nan")}, {2.5: 1.2}, [(2, 1.1), (2, 1.2)], "x"):
        with pytest.raises(ValueError, match="routing_skew.*HINT:"):
            replace(FACTS, routing_skew=bad)
    with pytest.raises(ValueError, match="no MoE|has none.*HINT:"):
        ModelProfile.from_shape(SHAPE).with_routing_skew({2: 1.2})


def test_expert_gradients_sync_over_the_expert_data_group_by_hand() -> None:
    """ZeRO-0 (textbook model): the dense part all-reduces over the 64 data ranks, the experts over the 64/ep
    ranks ep apart that hold the same experts (one bucket each), overlapped with the last backward; the
    optimizer step reads 28 bytes per local parameter."""
    hw = a100()
    cm = GalvatronCostModel(mixtral(), hw)
    dense = ATTN + NORMS + ROUTER
    for ep in (1, 4):
        c = cm.layer_cost(0, LayerStrategy(dp=64, ep=ep), CTX)
        experts = 8 / ep * EXPERT
        opt = OPTIMIZER_TRAFFIC_BYTES * (dense + experts) / hw.memory_bandwidth
        if ep == 1:  # experts are ordinary block parameters: one all-reduce
            comm = hw.collective_time("allreduce", 2 * (dense + experts), 64, 1)
        else:
            comm = hw.collective_time("allreduce", 2 * dense, 64, 1) + \
                hw.collective_time("allreduce", 2 * experts, 64 // ep, ep)
        want = opt + overlapped(c.bwd, comm, hw.overlap_slowdown) - c.bwd
        assert c.step_extra == pytest.approx(want, rel=1e-9)
    assert cm.layer_cost(0, LayerStrategy(dp=64, ep=4), CTX).step_extra < \
        cm.layer_cost(0, LayerStrategy(dp=64), CTX).step_extra / 3  # 1/4 of the expert bytes to sync


def test_moe_layer_is_replicated_over_tp() -> None:
    """Megatron-SP tp2 x dp32: attention weights split, router and experts whole on both tp ranks; the MoE
    layer's input is all-gathered (attention keeps its all-gather + reduce-scatter); its math is not split."""
    hw = a100()
    cm = GalvatronCostModel(mixtral(), hw)
    s = LayerStrategy(tp=2, dp=32, sp="megatron")
    c = cm.layer_cost(0, s, CTX)
    assert c.states == pytest.approx(16 * ((ATTN + NORMS) / 2 + ROUTER + 8 * EXPERT), rel=1e-12)
    nbytes = 2 * 4096 * 4096 * 2  # two samples per rank at dp32
    comm = 2 * hw.collective_time("allgather", nbytes, 2) + hw.collective_time("reducescatter", nbytes, 2)
    router = hw.collective_time("allreduce", 144, 32, 2)  # one all-reduce: 2 x 9 float64
    active = ATTN + NORMS + ROUTER + 2 * EXPERT
    share = (ROUTER + 2 * EXPERT) / active
    per_token, ctx = 2 * active / 150e12, 4 * 4096 / 150e12
    compute = 50e-6 + per_token * 2 * 4096 * (share + (1 - share) / 2) + ctx * 2 * 4096 * 4096 / 2
    assert c.fwd == pytest.approx(compute + comm + router, rel=1e-12)


def test_measured_ep_fit_prices_the_block_compute_under_ep() -> None:
    """A fit measured under ep (``tp1/none/ep<k>``, ShardedLayerProfiler) is the block's compute at that ep --
    the dispatcher's own work included -- and only the predicted collectives come on top; an ep without its
    own fit falls back to the tp1 fit, as profiles from before ep variants have only that."""
    hw = a100()
    lt = mixtral().layer(0)
    plain = TimeFit(1e-3, 2e-7, 0.0)
    ep2 = TimeFit(3e-3, 3e-7, 0.0)
    measured = replace(lt, sharded={"tp1/none": {"forward": plain, "backward": plain.scaled(2.0)},
                                    "tp1/none/ep2": {"forward": ep2, "backward": ep2.scaled(2.0)}})
    cm = GalvatronCostModel(mixtral().with_(layer_types=(measured,)), hw)
    tokens = 4096.0  # one sample per rank at dp64
    for ep, fit in ((2, ep2), (4, plain), (1, plain)):
        s = LayerStrategy(dp=64, ep=ep)
        c = cm.layer_cost(0, s, CTX)
        nbytes = tokens * 2 * 4096 * 2
        router = hw.collective_time("allreduce", 144, 64, 1)
        a2a_f = (hw.collective_time("allgather", 8.0 * 8 * ep, ep, 1) + 2 * hw.collective_time("alltoall", nbytes, ep, 1)
                 if ep > 1 else 0.0)
        assert c.fwd == pytest.approx(fit(1, 4096) + router + a2a_f, rel=1e-12), ep
    assert measured.sharded_fit("forward", 1, "none", 2) is ep2
    assert measured.sharded_fit("forward", 1, "none", 8) is plain


def test_ep_on_a_dense_layer_is_refused_with_a_hint() -> None:
    cm = GalvatronCostModel(mixtral(MIXED), a100())
    with pytest.raises(ValueError, match="HINT:.*ep=1 on dense layers"):
        cm.layer_cost(0, LayerStrategy(dp=64, ep=2), CTX)  # block 0 is dense
    with pytest.raises(ValueError, match="HINT:"):
        cm.layer_cost(1, LayerStrategy(dp=64, ep=16), CTX)  # 16 does not divide 8 experts
    assert cm.layer_cost(1, LayerStrategy(dp=64, ep=8), CTX).states > 0
    plan = ParallelPlan.uniform(64, 32, LayerStrategy(dp=64, ep=2), global_batch=64)
    with pytest.raises(ValueError, match="HINT:"):
        cm.evaluate(plan)


# ---------------------------------------------------------------------------------------------------
# search space
# ---------------------------------------------------------------------------------------------------
def test_candidates_branch_into_ep_only_for_moe_models() -> None:
    space = SearchSpace()
    dense = candidate_strategies(SHAPE, 64, 64, space, a100())
    assert dense == candidate_strategies(SHAPE, 64, 64, space, a100(), experts=()) and {s.ep for s in dense} == {1}
    moe = candidate_strategies(SHAPE, 64, 64, space, a100(), experts=(8,))
    assert [s for s in moe if s.ep == 1] == dense  # the dense tree, each node branched into its ep options
    by_base: dict[LayerStrategy, set[int]] = {}
    for s in moe:
        by_base.setdefault(replace(s, ep=1, zero=0, checkpoint=False), set()).add(s.ep)
    assert by_base[LayerStrategy(dp=64)] == {1, 2, 4, 8}  # divisors of 64 that divide 8 experts
    assert by_base[LayerStrategy(tp=8, dp=8, sp="ulysses")] == {1, 2, 4, 8}  # Ulysses: data group 64
    assert by_base[LayerStrategy(tp=8, dp=8, sp="megatron")] == {1, 2, 4, 8}  # data group dp=8
    assert {s.ep for s in candidate_strategies(SHAPE, 64, 64, SearchSpace(ep_degrees=(1, 4)), experts=(8,))} == {1, 4}
    for bad in ((2, 4), (0, 1)):
        with pytest.raises(ValueError, match="HINT:"):
            SearchSpace(ep_degrees=bad)
    mixed = mixtral(MIXED)
    assert not applies(mixed.layer(0), LayerStrategy(dp=64, ep=2)) and applies(mixed.layer(1), LayerStrategy(dp=64, ep=2))


# ---------------------------------------------------------------------------------------------------
# search: ep chosen jointly with the other dimensions
# ---------------------------------------------------------------------------------------------------
def test_search_spreads_experts_when_they_do_not_fit_otherwise() -> None:
    """40 GB A100s, ZeRO-0/1 only: 16 MoE layers keep >= 5.7 GiB of states each without ep (90 GiB), so
    only expert parallelism fits -- on the MoE layers, never on the dense ones."""
    prof, hw = mixtral(MIXED), a100()
    space = SearchSpace(zero_stages=(0, 1), pp_degrees=(1,))
    result = search(prof, hw, 64, 40 * GiB, global_batch=128, top_k=3, space=space)
    for plan in result:
        for i, s in enumerate(plan.layers):
            assert (s.ep > 1) == (prof.layer(i).moe is not None), plan.describe()
    best = result.best
    assert best.prediction.stage_memory_bytes[0] <= 40 * GiB * 0.98
    assert "expert parallelism on the MoE layers" in result.explanation
    assert "expert parallel: layers 1, 3, 5" in best.describe()
    with pytest.raises(ValueError, match=r"smallest memory that would fit is (9\d|1\d\d)\.\d\d GiB"):
        search(prof, hw, 64, 40 * GiB, global_batch=128, space=replace(space, ep_degrees=(1,)))
    roomy = search(prof, hw, 64, 200 * GiB, global_batch=128, top_k=1, space=replace(space, ep_degrees=(1,)))
    assert "no expert-parallel degree was in the search space" in roomy.explanation


def test_search_keeps_experts_whole_when_alltoall_is_slow() -> None:
    """Memory to spare (1 TiB, a what-if budget): with the A100's all-to-all, spreading experts still pays
    (4x less expert gradient to sync); with a 1 GB/s all-to-all (0.1 ms latency) the search keeps ep=1."""
    prof, hw = mixtral(MIXED), a100()
    slow = replace(hw, links={k: LinkFit(1e9, 1e-4) if k.startswith("alltoall") else v for k, v in hw.links.items()})
    space = SearchSpace(pp_degrees=(1,))
    fast_best = search(prof, hw, 64, 2**40, global_batch=128, top_k=1, space=space).best
    assert any(s.ep > 1 for s in fast_best.layers)
    result = search(prof, slow, 64, 2**40, global_batch=128, top_k=1, space=space)
    assert all(s.ep == 1 for s in result.best.layers), result.best.describe()
    assert "keep every expert on every rank (ep=1)" in result.explanation
    slow_cm = GalvatronCostModel(prof, slow, SearchSpace().default_embed_zero)
    assert slow_cm.evaluate(fast_best).step_time_s > result.best.prediction.step_time_s


def test_mixed_model_gets_different_strategies_per_layer_when_faster() -> None:
    """Full space, 40 GB: dense and MoE blocks take different strategies, and the plan beats every plan that
    gives all blocks one of its strategies (ep dropped on dense blocks) -- slower, or over the budget."""
    prof, hw = mixtral(MIXED), a100()
    result = search(prof, hw, 64, 40 * GiB, global_batch=128, top_k=1, space=SearchSpace(pp_degrees=(1,)))
    best = result.best
    dense_s = {best.layers[i] for i in range(32) if i % 2 == 0}
    moe_s = {best.layers[i] for i in range(32) if i % 2 == 1}
    assert not dense_s & moe_s and all(s.ep > 1 for s in moe_s), best.describe()
    cm = GalvatronCostModel(prof, hw, SearchSpace().default_embed_zero)
    usable = 40 * GiB * 0.98
    for s in dense_s | moe_s:
        one = best.with_(layers=tuple(s if applies(prof.layer(i), s) else replace(s, ep=1) for i in range(32)))
        c = cm.evaluate(one)
        assert c.step_time_s > best.prediction.step_time_s or c.peak_memory_bytes > usable, s.short()


def test_all_moe_search_on_a100_world_64() -> None:
    """Mixtral (every block MoE), 40 GB: every layer spreads its experts; one layer type, so the search's
    homogeneous path (Pareto pruning before the layer DP) handles the ep options."""
    result = search(mixtral(), a100(), 64, 40 * GiB, global_batch=128, top_k=2, space=SearchSpace(pp_degrees=(1,)))
    assert all(s.ep > 1 for p in result for s in p.layers)
    assert result.best.prediction.stage_memory_bytes[0] <= 40 * GiB * 0.98


def brute_force_pp1(prof: ModelProfile, hw: HardwareProfile, world: int, G: int, m: int, budget: float,
                    space: SearchSpace) -> float:
    """Best step time over every per-layer assignment (ep only where it applies) and (embedding, head) pair,
    with the search's memory grid; pp = 1."""
    cm = GalvatronCostModel(prof, hw, space.default_embed_zero)
    mb = G // m
    ctx = StageContext(world, mb, m)
    cands = candidate_strategies(prof.shape, world, mb, space, experts=prof.num_experts)
    grid = budget / space.memory_bins
    options, t, q, r = [], [], [], []
    for i in range(prof.num_layers):
        ok = [s for s in cands if applies(prof.layer(i), s)]
        cs = [cm.layer_cost(i, s, ctx) for s in ok]
        options.append(ok)
        t.append(np.array([m * (c.fwd + c.bwd) + c.step_extra for c in cs]))
        q.append(np.ceil(np.array([c.memory(1.0) for c in cs]) / grid - 1e-9))
        r.append(np.array([c.transient for c in cs]))
    idx = np.array(list(itertools.product(*(range(len(o)) for o in options))))  # [combos, layers]
    cols = range(prof.num_layers)
    total = sum(t[i][idx[:, i]] for i in cols)
    for i in range(1, prof.num_layers):
        trans = np.array([[m * cm.transition_time(a, b, ctx) if a != b else 0.0 for b in options[i]]
                          for a in options[i - 1]])
        total = total + trans[idx[:, i - 1], idx[:, i]]
    mem = sum(q[i][idx[:, i]] for i in cols)
    tau = np.max([r[i][idx[:, i]] for i in cols], axis=0)
    best = math.inf
    for e, h in itertools.product(end_strategies(prof.shape, world, mb, space), repeat=2):
        ft, fe, fmem = cm.stage_fixed(e, h, ctx)
        cap = np.floor((budget - fmem - np.maximum(0.0, tau - cm.backward_freed(h, ctx))) / grid + 1e-9)
        fits = mem <= cap
        if fits.any():
            best = min(best, float(total[fits].min() + m * ft + fe))
    return best


@pytest.mark.parametrize("budget, zeros", [(1e12, (0, 3)), (1e6, (0, 1))])
def test_mixed_search_matches_brute_force(budget: float, zeros: tuple[int, ...]) -> None:
    """A tiny dense/MoE/dense model on 4 ranks: the layer DP over a strategy list where ep > 1 exists only for
    the MoE layer (infinite cost elsewhere, per-type Pareto pruning) finds the brute-force optimum -- with memory
    to spare, and at 1 MB under ZeRO-0/1, where no plan without expert parallelism fits."""
    shape = ModelShape(3, 64, 4, 4, 128, 256, 16)
    facts = MoELayerFacts.swiglu(64, 4, 2, 64)
    prof = ModelProfile.from_shape(shape, flops_per_s=1e9, moe=facts, moe_layers=(1,), framework_bytes=0.0)
    hw = HardwareProfile.uniform(1, 4, 1e12, intra_bw=2e8, latency_s=2e-5, memory_bandwidth=1e10)
    space = SearchSpace(zero_stages=zeros, sp_modes=("none", "ulysses"), pp_degrees=(1,), micro_batches=(2,),
                        heuristic_pruning=False)
    want = brute_force_pp1(prof, hw, 4, 8, 2, budget, space)
    assert math.isfinite(want)
    best = search(prof, hw, 4, budget, global_batch=8, top_k=1, space=space, memory_margin=0.0).best
    assert best.prediction.step_time_s == pytest.approx(want, rel=1e-9)
    assert best.layers[0].ep == best.layers[2].ep == 1
    if budget < 1e9:  # tight: the MoE layer needs ep to fit
        assert best.layers[1].ep > 1, best.describe()
        with pytest.raises(ValueError, match="HINT:"):
            search(prof, hw, 4, budget, global_batch=8, space=replace(space, ep_degrees=(1,)), memory_margin=0.0)


def two_dense_types() -> ModelProfile:
    """Two dense layer types, the second with a measured recompute peak far above its checkpointed activations
    (the rich profile of the contract tests)."""
    shape = ModelShape(5, 8, 4, 4, 16, 64, 8)
    plain = LayerTypeProfile("attn", TimeFit(2e-5, 1e-3 / 8), TimeFit(4e-5, 2e-3 / 8), 2_000_000,
                             {act_key(1, "none", False): 4e6, act_key(2, "none", False): 2.5e6,
                              act_key(1, "none", True): 5e5}, 8)
    heavy = LayerTypeProfile("mlp", TimeFit(1e-5, 2e-3 / 8), TimeFit(2e-5, 4e-3 / 8), 3_000_000,
                             {act_key(1, "none", False): 6e6, act_key(1, "none", True): 1e6, "tp1/none/ckpt/peak": 8e6},
                             8)
    return ModelProfile("two", shape, (plain, heavy), (0, 1, 1, 0, 1), "bf16", embed_params=50_000,
                        head_params=80_000, head_forward=TimeFit(1e-5, 0.5e-3 / 8), head_act_bytes=2e5,
                        framework_bytes=1e6)


@pytest.mark.parametrize("budget", [1.31e8, 1.48e8, 1.49e8])
def test_recompute_levels_are_per_layer_type(budget: float) -> None:
    """A strategy whose recompute peak exceeds the DP's transient level on one layer type stays usable on a
    type where it does not (regression: it used to be dropped for every layer, and the search missed the
    optimum of this dense two-type model at 148 and 149 MB -- 131.3 and 128.4 ms instead of 128.4 and 127.4)."""
    prof = two_dense_types()
    hw = HardwareProfile.uniform(1, 4, 1e12, intra_bw=2e9, inter_bw=2e9, latency_s=2e-5, overlap_slowdown=1.2,
                                 memory_bandwidth=1e11)
    space = SearchSpace(zero_stages=(0, 3), sp_modes=("none",), pp_degrees=(1,), micro_batches=(2,),
                        heuristic_pruning=False)
    want = brute_force_pp1(prof, hw, 2, 8, 2, budget, space)
    got = search(prof, hw, 2, budget, global_batch=8, top_k=1, space=space, memory_margin=0.0).best
    assert got.prediction.step_time_s == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("s", [LayerStrategy(dp=64, ep=4), LayerStrategy(dp=64, ep=8, checkpoint=True),
                               LayerStrategy(tp=2, dp=32, sp="megatron", ep=2),
                               LayerStrategy(tp=4, dp=16, sp="ulysses", ep=8, checkpoint=True)])
@pytest.mark.parametrize("counted", [None, 0.25])
def test_calibration_observations_split_moe_layers_like_the_cost_model(s: LayerStrategy, counted: float | None
                                                                       ) -> None:
    """The online calibration predicts a measured block as compute + collectives: for an MoE block those are
    the cost model's own (tp-replicated MoE compute, all-to-alls, router statistics), so without data
    parallel terms (ZeRO-0: gradient sync is per step) they add up to the layer's fwd + bwd -- also where the
    profiler counted that a recompute repeats only a share of the forward's collectives (``counted``)."""
    from dataclasses import replace

    from lightning_galv.planner.calibration import layer_observations
    from lightning_galv.planner.profiles import time_key

    prof, hw = mixtral(MIXED), a100()
    if counted is not None:
        moe_type = prof.layer_type_of[1]
        lt = replace(prof.layer_types[moe_type],
                     recompute_comm={time_key(s.tp, s.sp if s.tp > 1 else "none", s.ep): counted})
        prof = prof.with_(layer_types=tuple(lt if j == moe_type else t for j, t in enumerate(prof.layer_types)))
    plan = ParallelPlan(64, tuple(s if i % 2 else LayerStrategy(dp=64) for i in range(32)), global_batch=64)
    obs = layer_observations(plan, prof, hw, 64, {"layers.1": 1.0, "layers.2": 1.0})
    cm = GalvatronCostModel(prof, hw)
    for o, layer in zip(obs, (1, 2)):
        c = cm.layer_cost(layer, plan.layers[layer], CTX)
        assert o.compute_s + o.comm_s == pytest.approx(c.fwd + c.bwd, rel=1e-12)
    assert obs[0].comm_s > 0
    if counted is not None and s.checkpoint:  # the share moved both alike: fewer repeated collectives
        full = layer_observations(plan, mixtral(MIXED), hw, 64, {"layers.1": 1.0})[0]
        assert obs[0].comm_s < full.comm_s and obs[0].compute_s == pytest.approx(full.compute_s)


def test_activations_measured_under_ep_are_priced_never_below_the_experts_whole_figure() -> None:
    """The all-to-all dispatcher saves buffers of its own, so the profiler measures an MoE block's activations
    and recompute peak per ep (the MoE benchmark's checkpointed ep plans had been 8 % over their predicted peak);
    the cost model takes them -- but never below the experts-whole figure, which balanced routing guarantees
    (a noisy smaller measurement would have the search buy ep for memory it does not save)."""
    from dataclasses import replace

    from lightning_galv.planner.profiles import act_key, transient_key

    prof, hw = mixtral(MIXED), a100()
    moe_type = prof.layer_type_of[1]
    lt = prof.layer_types[moe_type]
    s, ck = LayerStrategy(dp=64, ep=8), LayerStrategy(dp=64, ep=8, checkpoint=True)
    whole = GalvatronCostModel(prof, hw).layer_cost(1, s, CTX)

    def with_acts(**acts: float) -> ModelProfile:
        t = replace(lt, activation_bytes={**lt.activation_bytes, **acts})
        return prof.with_(layer_types=tuple(t if j == moe_type else x for j, x in enumerate(prof.layer_types)))

    full = lt.activation_bytes[act_key(1, "none", False)]
    more = GalvatronCostModel(with_acts(**{act_key(1, "none", False, 8): 1.2 * full}), hw)
    assert more.layer_cost(1, s, CTX).act == pytest.approx(1.2 * whole.act)
    assert more.layer_cost(1, LayerStrategy(dp=64, ep=4), CTX).act == pytest.approx(whole.act)  # ep 4: not measured
    less = GalvatronCostModel(with_acts(**{act_key(1, "none", False, 8): 0.5 * full}), hw)
    assert less.layer_cost(1, s, CTX).act == pytest.approx(whole.act)
    # nor below a smaller ep's measurement that divides it (ep 4 measured higher than ep 8: ep 8 priced at ep 4's)
    noisy = GalvatronCostModel(with_acts(**{act_key(1, "none", False, 8): 1.1 * full,
                                            act_key(1, "none", False, 4): 1.3 * full}), hw)
    assert noisy.layer_cost(1, s, CTX).act == pytest.approx(1.3 * whole.act)
    # checkpointed: the recompute peak measured at this ep sets the transient
    kept = lt.activation(1, "none", True)
    peaked = GalvatronCostModel(with_acts(**{transient_key(1, "none", 8): 2.0 * full}), hw).layer_cost(1, ck, CTX)
    b = 1  # one sample per rank (CTX)
    assert peaked.act == pytest.approx(kept * b) and peaked.transient == pytest.approx((2.0 * full - kept) * b)
    assert GalvatronCostModel(prof, hw).layer_cost(1, ck, CTX).transient == pytest.approx((full - kept) * b)
    low = GalvatronCostModel(with_acts(**{transient_key(1, "none", 8): 0.5 * full}), hw).layer_cost(1, ck, CTX)
    assert low.transient == pytest.approx((full - kept) * b)  # a measured ep peak never below the experts-whole one


# ---------------------------------------------------------------------------------------------------
# contract, plan show
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("runtime", ["ideal", "native"])
@pytest.mark.parametrize("layers", ["all", "mixed"])
def test_contract_on_mixtral_profiles(runtime: str, layers: str) -> None:
    prof = mixtral(None if layers == "all" else MIXED)
    check_cost_model(GalvatronCostModel(prof, a100(1), runtime=runtime), prof, world_size=8)


def test_contract_holds_with_a_routing_skew_and_expert_parallelism_gets_dearer() -> None:
    """A skewed profile keeps every contract rule (the search's bounds among them), and every ep's forward gets
    dearer under its skew, never cheaper."""
    prof = mixtral().with_(matmul_flops=150e12)
    skewed = prof.with_routing_skew({2: 1.3, 4: 1.6, 8: 2.0})
    check_cost_model(GalvatronCostModel(skewed, a100(1), runtime="native"), skewed, world_size=8)
    for ep in (2, 4, 8):
        s = LayerStrategy(dp=8, ep=ep)
        ctx = StageContext(8, 8, 1)
        assert GalvatronCostModel(skewed, a100(1)).layer_cost(0, s, ctx).fwd > \
            GalvatronCostModel(prof, a100(1)).layer_cost(0, s, ctx).fwd


def test_plan_show_prints_ep(capsys: pytest.CaptureFixture[str]) -> None:
    galv(["plan", "show", str(ROOT / "recipes/plans/moe_ep4.yaml")])
    out = capsys.readouterr().out
    assert "dp4·ep4·zero1" in out and "ulysses2·dp2·ep2" in out and "expert parallel: layers 1, 3" in out
    plan = ParallelPlan.load(ROOT / "recipes/plans/moe_ep4.yaml")
    assert ParallelPlan.from_yaml(plan.to_yaml()) == plan and plan.layers[1].ep == 4


def test_native_zero2_experts_gather_per_expert_every_micro_batch() -> None:
    """Native runtime, ZeRO-2 with ep > 1: FSDP2 shards each local expert on its own over the expert-data group
    (parallel/parallelize.py), so the forward all-gathers the dense part once over the data group and each of the
    E/ep local experts separately over the |D|/ep ranks ep apart -- in every micro-batch, accumulating or not
    (FSDP2 re-shards after each backward); the reduce-scatters run only in the last micro-batch's backward when
    accumulating without a pipeline."""
    hw = a100()
    cm = GalvatronCostModel(mixtral(), hw, runtime="native")
    ep, dense, el = 4, ATTN + NORMS + ROUTER, 2.0
    pieces, experts = 8 // ep, 8 // ep * EXPERT
    one, accum = CTX, StageContext(64, 64, 4)
    for ctx in (one, accum):
        z0, z2 = cm.layer_cost(0, LayerStrategy(dp=64, ep=ep), ctx), cm.layer_cost(0, LayerStrategy(dp=64, ep=ep, zero=2), ctx)
        gather = hw.collective_time("allgather", el * dense, 64, 1) + \
            pieces * hw.collective_time("allgather", el * experts / pieces, 64 // ep, ep)
        assert z2.fwd == pytest.approx(overlapped(z0.fwd, gather, hw.overlap_slowdown), rel=1e-9)
    acc0 = cm.layer_cost(0, LayerStrategy(dp=64, ep=ep), accum)
    acc2 = cm.layer_cost(0, LayerStrategy(dp=64, ep=ep, zero=2), accum)
    assert acc2.bwd == pytest.approx(acc0.bwd, rel=1e-9)  # no reduce-scatter before the last micro-batch
    single2 = cm.layer_cost(0, LayerStrategy(dp=64, ep=ep, zero=2), one)
    assert single2.bwd > cm.layer_cost(0, LayerStrategy(dp=64, ep=ep), one).bwd  # ... but every one without accumulation
    # an inline backend (gloo): the dense part's gather is prefetched beside compute, all but the first unit's
    # 1/layers share; the routed experts' nested FSDP2 states are outside the forward prefetch chain, so theirs
    # stay inline in forward
    inline = HardwareProfile.from_dict({**hw.to_dict(), "async_collectives": False})
    cpu = GalvatronCostModel(mixtral(), inline, runtime="native")
    z0 = cpu.layer_cost(0, LayerStrategy(dp=64, ep=ep), one)
    z2 = cpu.layer_cost(0, LayerStrategy(dp=64, ep=ep, zero=2), one)
    dense_gather = hw.collective_time("allgather", el * dense, 64, 1)
    expert_gather = pieces * hw.collective_time("allgather", el * experts / pieces, 64 // ep, ep)
    first = dense_gather / mixtral().num_layers
    assert z2.fwd == pytest.approx(overlapped(z0.fwd, dense_gather - first, inline.overlap_slowdown) + first
                                   + expert_gather, rel=1e-9)


def test_fsdp_overhead_skips_experts_on_a_one_rank_expert_data_group() -> None:
    """The native runtime gives routed experts no FSDP2 state when their expert-data group is one rank (ep equal
    to the data degree: nothing to shard or reduce; parallel/parallelize.py), so the block's measured FSDP2
    overhead is charged on the dense part only there, and on the dense part plus the local experts where the
    experts are sharded over two or more ranks."""
    from lightning_galv.planner.profiles import TimeFit

    ms = 1e-3
    base = mixtral()
    lt = base.layer(0)
    over = {"zero3": {"forward": TimeFit(10 * ms, 0.0), "backward": TimeFit(20 * ms, 0.0)}}
    prof = base.with_(layer_types=tuple(replace(t, zero_overhead=over) for t in base.layer_types))
    hw = a100()
    dense = ATTN + NORMS + ROUTER
    ctx = StageContext(8, 8, 1)
    for ep, edp in ((4, 2), (8, 1)):
        s = LayerStrategy(dp=8, ep=ep, zero=3)
        with_over = GalvatronCostModel(prof, hw, runtime="native").layer_cost(0, s, ctx)
        without = GalvatronCostModel(base, hw, runtime="native").layer_cost(0, s, ctx)
        managed = dense + (8 // ep) * EXPERT if edp > 1 else dense
        assert with_over.fwd - without.fwd == pytest.approx(10 * ms * managed / lt.params, rel=1e-9), ep
        assert with_over.bwd - without.bwd == pytest.approx(20 * ms * managed / lt.params, rel=1e-9), ep


def test_fsdp_overhead_measured_at_the_plans_ep_wins_over_the_scaled_whole_block() -> None:
    """FSDP2's work is largely per unit and per tensor, so the profiler also measures an MoE block's overhead as
    the runtime wraps it at each ep (``zero3/ep8``: experts plain; ``zero3/ep4/edp2``: experts FSDP2 units of
    their own). A strategy with the same ep and the same expert wrapping takes that entry, scaled only by its
    share of the measured layout's FSDP2-managed parameters (1 at tp 1, the dense part / tp under tp); others
    fall back to the whole block's entry scaled by bytes."""
    from lightning_galv.planner.cost import zero_overhead_entry
    from lightning_galv.planner.profiles import TimeFit

    ms = 1e-3
    base = mixtral()
    lt = base.layer(0)
    fit = lambda f, b: {"forward": TimeFit(f * ms, 0.0), "backward": TimeFit(b * ms, 0.0)}  # noqa: E731
    over = {"zero3": fit(10, 20), "zero3/ep8": fit(3, 5), "zero3/ep4/edp2": fit(7, 9), "zero2/ep8": fit(1, 2)}
    lt = replace(lt, zero_overhead=over)
    dense = ATTN + NORMS + ROUTER
    assert zero_overhead_entry(lt, 3, 1, 8, 1) == (over["zero3/ep8"], 1.0)
    assert zero_overhead_entry(lt, 3, 1, 4, 4) == (over["zero3/ep4/edp2"], 1.0)  # any edp > 1: experts wrapped
    assert zero_overhead_entry(lt, 2, 1, 8, 1) == (over["zero2/ep8"], 1.0)
    # tp 2 halves the attention, not the router (replicated over tp)
    fits, share = zero_overhead_entry(lt, 3, 2, 8, 1)
    assert fits == over["zero3/ep8"] and share == pytest.approx((ATTN / 2 + NORMS / 2 + ROUTER) / dense, rel=1e-12)
    # ep 4 with its experts plain (edp 1) was not measured: the whole block's entry, by bytes
    assert zero_overhead_entry(lt, 3, 1, 4, 1) == (over["zero3"], pytest.approx(dense / lt.params, rel=1e-12))
    assert zero_overhead_entry(lt, 2, 1, 4, 2) is None  # no ZeRO-2 entry for it, nor a whole-block one
    assert zero_overhead_entry(lt, 3, 1, 1, 8) == (over["zero3"], 1.0)
    # the cost model charges exactly that on the layer
    prof = base.with_(layer_types=tuple(replace(t, zero_overhead=over) for t in base.layer_types))
    s, ctx = LayerStrategy(dp=8, ep=8, zero=3), StageContext(8, 8, 1)
    with_over = GalvatronCostModel(prof, a100(), runtime="native").layer_cost(0, s, ctx)
    without = GalvatronCostModel(base, a100(), runtime="native").layer_cost(0, s, ctx)
    assert with_over.fwd - without.fwd == pytest.approx(3 * ms, rel=1e-9)
    assert with_over.bwd - without.bwd == pytest.approx(5 * ms, rel=1e-9)


def test_native_dense_and_expert_all_reduces_wait_side_by_side() -> None:
    """Native runtime, ZeRO-0, ep > 1: GradientSync runs the dense gradients' buckets (over the data group) and the
    experts' (over the expert-data group) on two communicators, so the last backward waits for the slower queue,
    not for both in a row: the block's part charges the larger of the two groups' simulated exposures. The stage
    then adds nothing for a uniform plan whose ends ride with the dense group (their tail is shorter than the
    experts'), and the ends' tail beyond the experts' when it is longer (one bucket per group here: a small MoE
    model, 8 ranks, 1 GB/s, 1 ms latency)."""
    from lightning_galv.planner.cost import (bucket_copy_time, bucket_latency, bucketed_allreduce_time,
                                             bucketed_sync_exposed)

    shape = ModelShape(num_layers=4, hidden=128, num_heads=4, num_kv_heads=2, ffn_hidden=256, vocab_size=256,
                       seq_len=64)
    prof = ModelProfile.from_shape(shape, moe=MoELayerFacts.swiglu(128, num_experts=8, top_k=2, expert_hidden=256))
    hw = HardwareProfile.uniform(1, 8, 80 * GiB, intra_bw=1e9, latency_s=1e-3, memory_bandwidth=1e11)
    cm = GalvatronCostModel(prof, hw, runtime="native")
    lt, el, L, ep = prof.layer(0), (4.0 if prof.precision == "fp32" else 2.0), 4, 2
    experts = 8 // ep * lt.moe.expert_params
    dense = lt.params - 8 * lt.moe.expert_params
    s, ctx = LayerStrategy(dp=8, ep=ep), StageContext(8, 8, 1)
    c = cm.layer_cost(0, s, ctx)

    def queue(params: float, d: int, stride: int) -> tuple[float, float, float]:
        nb = el * params
        return (bucketed_allreduce_time(hw, nb, d, stride, stage_bytes=nb * L),
                bucket_latency(hw, nb, d, stride, stage_bytes=nb * L), nb)

    qs = [queue(dense, 8, 1), queue(experts, 8 // ep, ep)]
    exposed = [bucketed_sync_exposed(c.bwd, comm, L, nb, hw.overlap_slowdown, latency=lat) for comm, lat, nb in qs]
    fixed = OPTIMIZER_TRAFFIC_BYTES * (dense + experts) / hw.memory_bandwidth + \
        bucket_copy_time(el * (dense + experts), hw.memory_bandwidth)
    assert c.step_extra == pytest.approx(fixed + max(exposed), rel=1e-9)
    one_queue = bucketed_sync_exposed(c.bwd, qs[0][0] + qs[1][0], L, qs[0][2] + qs[1][2], hw.overlap_slowdown,
                                      latency=qs[0][1] + qs[1][1])
    assert fixed + one_queue > c.step_extra * 1.05  # the negative control: one queue for both costs more
    plan = ParallelPlan.uniform(8, L, s, global_batch=8).with_(embed=LayerStrategy(dp=8), head=LayerStrategy(dp=8))
    assert cm.stage_sync_time(plan, 0, ctx) == 0.0
    # a large vocabulary: the ends' 8-rank all-reduce (with the blocks' dense gradients, 20 MB: one bucket)
    # outlasts the experts' (3 MB over 4 ranks), which is all the blocks charged; but the ends priced their bytes'
    # share of that tail themselves, and with it the parts already sum past the slowest tail: nothing to add
    big = prof.with_(embed_params=5_000_000, head_params=5_000_000)
    dense_tail = hw.collective_time("allreduce", el * (1e7 + dense * L), 8, 1)
    expert_tail = hw.collective_time("allreduce", el * experts * L, 8 // ep, ep)
    ends_priced = dense_tail * 1e7 / (1e7 + dense * L)
    assert expert_tail < dense_tail < expert_tail + ends_priced
    assert GalvatronCostModel(big, hw, runtime="native").stage_sync_time(plan, 0, ctx) == 0.0
