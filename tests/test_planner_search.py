"""Search: DP optimal vs brute force, uneven partitions, errors, top-k, divisor degrees, scale."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lightning_galv.plan import LayerStrategy, ModelShape, ParallelPlan
from lightning_galv.planner.cost import GalvatronCostModel, StageContext
from lightning_galv.planner.profiles import HardwareProfile, LayerTypeProfile, ModelProfile, TimeFit, act_key
from lightning_galv.planner.search import DEFAULT_MEMORY_MARGIN, SearchSpace, candidate_strategies, search

MS = 1e-3


def toy_profile(layers: int, seq: int = 8, hidden: int = 8, params: int = 2_000_000, act: float = 4e6,
                head_ms: float = 0.0) -> ModelProfile:
    shape = ModelShape(layers, hidden, 4, 4, 16, 64, seq)
    lt = LayerTypeProfile("block", TimeFit(2e-5, MS / seq), TimeFit(4e-5, 2 * MS / seq), params,
                          {act_key(1, "none", False): act, act_key(2, "none", False): 0.7 * act,
                           act_key(1, "none", True): act / 8}, hidden)
    return ModelProfile("toy", shape, (lt,), (0,) * layers, "bf16", embed_params=10_000, head_params=10_000,
                        head_forward=TimeFit(0.0, head_ms * MS / seq))


def toy_hw(world: int) -> HardwareProfile:
    return HardwareProfile.uniform(1, max(world, 1), 1e12, intra_bw=2e9, inter_bw=2e9, latency_s=2e-5,
                                   overlap_slowdown=1.2, memory_bandwidth=1e11)


# ---------------------------------------------------------------------------------------------------
# DP against brute force
# ---------------------------------------------------------------------------------------------------
def brute_force(prof: ModelProfile, hw: HardwareProfile, world: int, G: int, m: int, budget: float,
                space: SearchSpace) -> tuple[float, tuple[LayerStrategy, ...] | None]:
    """Enumerate every per-layer assignment; feasibility on the search's documented memory grid."""
    cm = GalvatronCostModel(prof, hw, space.default_embed_zero)
    mb = G // m
    cands = candidate_strategies(prof.shape, world, mb, space)
    ctx = StageContext(world, mb, m)
    emb = LayerStrategy(dp=world, zero=space.default_embed_zero if world > 1 else 0)
    fixed_t, fixed_e, fixed_mem = cm.stage_fixed(emb, emb, ctx)
    costs = [cm.layer_cost(0, s, ctx) for s in cands]
    c = np.array([m * (x.fwd + x.bwd) + x.step_extra for x in costs])
    grid = budget / space.memory_bins
    q = np.ceil(np.array([x.memory(1.0) for x in costs]) / grid - 1e-9).astype(np.int64)
    r = np.array([x.transient for x in costs])
    tr = np.array([[m * cm.transition_time(a, b, ctx) for b in cands] for a in cands])
    J, L = len(cands), prof.num_layers
    idx = np.array(list(itertools.product(range(J), repeat=L)))
    total = c[idx].sum(axis=1) + sum(tr[idx[:, i], idx[:, i + 1]] for i in range(L - 1))
    tau = r[idx].max(axis=1)
    cap = np.floor((budget - fixed_mem - tau) / grid + 1e-9)
    ok = q[idx].sum(axis=1) <= cap
    if not ok.any():
        return math.inf, None
    best = int(np.argmin(np.where(ok, total, np.inf)))
    return float(total[best] + m * fixed_t + fixed_e), tuple(cands[j] for j in idx[best])


def test_dp_matches_brute_force_on_every_small_instance() -> None:
    agreed = infeasible = dp_runs = 0
    for world, L, m in itertools.product((1, 2, 4), (1, 2, 3), (1, 2)):
        if world == 4 and L == 3:
            space = SearchSpace(heuristic_pruning=False, pp_degrees=(1,), micro_batches=(m,),
                                sp_modes=("none", "ulysses"), zero_stages=(0, 3))
        else:
            space = SearchSpace(heuristic_pruning=False, pp_degrees=(1,), micro_batches=(m,))
        prof, hw = toy_profile(L), toy_hw(world)
        G = 8
        # budgets from "nothing fits" to "everything fits"
        cm = GalvatronCostModel(prof, hw, space.default_embed_zero)
        fat = cm.evaluate(ParallelPlan.uniform(world, L, LayerStrategy(dp=world), micro_batches=m, global_batch=G))
        for frac in (0.05, 0.2, 0.35, 0.5, 0.7, 0.9, 1.2):
            budget = frac * fat.peak_memory_bytes
            want, plan_bf = brute_force(prof, hw, world, G, m, budget, space)
            try:
                result = search(prof, hw, world, budget, global_batch=G, top_k=1, space=space, memory_margin=0.0)
                got = result[0]
                dp_runs += result.stats["dp_runs"]
            except ValueError:
                assert want == math.inf, (world, L, m, frac)
                infeasible += 1
                continue
            assert want < math.inf, (world, L, m, frac)
            assert got.prediction is not None
            assert got.prediction.step_time_s == pytest.approx(want, rel=1e-9, abs=1e-12), (world, L, m, frac)
            assert max(got.prediction.stage_memory_bytes) <= budget
            assert plan_bf is not None
            # the brute-force optimum, evaluated as a plan, costs the same
            bf_plan = got.with_(layers=plan_bf)
            assert cm.evaluate(bf_plan).step_time_s == pytest.approx(want, rel=1e-9)
            agreed += 1
    # the sweep really exercised feasible, infeasible and memory-constrained (DP, not closed-form) cases
    assert agreed >= 50 and infeasible >= 5 and dp_runs >= 20, (agreed, infeasible, dp_runs)


# ---------------------------------------------------------------------------------------------------
# stage partition
# ---------------------------------------------------------------------------------------------------
def test_uneven_partition_found_when_it_wins() -> None:
    """A heavy head (2 layers' worth of compute) on the last stage: 5/3 beats 4/4."""
    prof = toy_profile(8, params=0, act=1.0, head_ms=2.0)
    hw = toy_hw(2)
    space = SearchSpace(pp_degrees=(2,), micro_batches=(8,), schedules=("1f1b",))
    best = search(prof, hw, 2, 1e9, global_batch=8, top_k=1, space=space)[0]
    assert best.pp_division == (5, 3)
    even = search(prof, hw, 2, 1e9, global_batch=8, top_k=1, space=SearchSpace(
        pp_degrees=(2,), micro_batches=(8,), schedules=("1f1b",), uneven_partition=False))[0]
    assert even.pp_division == (4, 4)
    assert best.prediction.step_time_s < 0.95 * even.prediction.step_time_s


def test_uneven_partition_by_memory_under_1f1b() -> None:
    """1F1B keeps 2 micro-batches on stage 0 and 1 on stage 1: only a lighter stage 0 fits."""
    prof = toy_profile(8, params=0, act=1e6)
    hw = toy_hw(2)
    space = SearchSpace(pp_degrees=(2,), micro_batches=(4,), schedules=("1f1b",), checkpoint=(False,))
    # per layer: 1 sample x 1e6 bytes; stage 0 holds 2 micro-batches -> 2e6 per layer
    budget = 7.0e6 + 1e5  # stage 0: 3 layers (6e6), stage 1: 5 layers (5e6); 4/4 needs 8e6 on stage 0
    best = search(prof, hw, 2, budget, global_batch=4, top_k=1, space=space, memory_margin=0.0)[0]
    assert best.pp_division[0] < best.pp_division[1]
    assert max(best.prediction.stage_memory_bytes) <= budget
    with pytest.raises(ValueError, match="HINT:"):
        search(prof, hw, 2, budget, global_batch=4, top_k=1,
               space=SearchSpace(pp_degrees=(2,), micro_batches=(4,), schedules=("1f1b",), checkpoint=(False,),
                                 uneven_partition=False))


# ---------------------------------------------------------------------------------------------------
# errors, top-k, degrees
# ---------------------------------------------------------------------------------------------------
def test_infeasible_budget_names_smallest_fit() -> None:
    prof, hw = toy_profile(4), toy_hw(4)
    with pytest.raises(ValueError) as err:
        search(prof, hw, 4, 1e6, global_batch=8)
    msg = str(err.value)
    assert "HINT:" in msg and "smallest memory that would fit" in msg
    need = float(msg.split("smallest memory that would fit is ")[1].split(" GiB (")[1].split(" bytes")[0])
    plans = search(prof, hw, 4, need * 1.01, global_batch=8)
    assert max(plans[0].prediction.stage_memory_bytes) <= need * 1.01


def test_memory_margin_keeps_part_of_the_budget_free() -> None:
    """A plan using more than (1 - margin) of the budget is not returned; margin 0 returns it."""
    prof, hw = toy_profile(4), toy_hw(4)
    roomy = search(prof, hw, 4, 1e12, global_batch=8, top_k=1, memory_margin=0.0)[0]
    peak = max(roomy.prediction.stage_memory_bytes)
    budget = peak * 1.01  # the roomy optimum fits the budget, but not 98 % of it
    exact = search(prof, hw, 4, budget, global_batch=8, top_k=1, memory_margin=0.0)[0]
    assert exact == roomy
    kept = search(prof, hw, 4, budget, global_batch=8, top_k=3)  # default margin
    assert kept.stats["usable_budget_bytes"] == pytest.approx(budget * (1 - DEFAULT_MEMORY_MARGIN))
    for plan in kept:
        assert max(plan.prediction.stage_memory_bytes) <= budget * (1 - DEFAULT_MEMORY_MARGIN)
    assert kept[0] != roomy and kept[0].prediction.step_time_s > roomy.prediction.step_time_s
    wide = search(prof, hw, 4, budget, global_batch=8, top_k=1, memory_margin=0.3)[0]
    assert max(wide.prediction.stage_memory_bytes) <= 0.7 * budget
    for bad in (-0.1, 1.0, True, "2%"):
        with pytest.raises(ValueError, match="HINT:"):
            search(prof, hw, 4, budget, global_batch=8, memory_margin=bad)


def test_top_k_sorted_valid_and_explained() -> None:
    prof, hw = toy_profile(6), toy_hw(4)
    plans = search(prof, hw, 4, 1e9, global_batch=16, top_k=4)
    assert len(plans) == 4
    tputs = [p.prediction.throughput for p in plans]
    assert tputs == sorted(tputs, reverse=True)
    for p in plans:
        p.check_model(prof.shape)
        assert p.prediction.throughput == pytest.approx(16 / p.prediction.step_time_s)
        assert len(p.prediction.stage_memory_bytes) == p.pp
    assert "searched" in plans.explanation and "#2" in plans.explanation


def test_any_divisor_degree() -> None:
    shape = ModelShape(4, 12, 6, 6, 48, 60, 6)
    cands = candidate_strategies(shape, 6, 6, SearchSpace())
    assert {s.tp for s in cands} == {1, 2, 3, 6}
    hw = HardwareProfile.uniform(1, 6, 1e12)
    plans = search(shape, hw, 6, 1e11, global_batch=6, top_k=20)
    assert {p.pp for p in plans} & {2, 3, 6} or {s.tp for p in plans for s in p.layers} & {3, 6}


def test_bad_arguments() -> None:
    prof, hw = toy_profile(4), toy_hw(4)
    with pytest.raises(ValueError, match="HINT:"):
        search(prof, hw, 4, 1e9, global_batch=0)
    with pytest.raises(ValueError, match="HINT:"):
        search(prof, hw, 4, -1.0)
    with pytest.raises(TypeError, match="HINT:"):
        search("gpt", hw, 4, 1e9)
    with pytest.raises(ValueError, match="HINT:"):
        SearchSpace(schedules=("zigzag",))


# ---------------------------------------------------------------------------------------------------
# scale
# ---------------------------------------------------------------------------------------------------
def test_simulated_1024_gpus_80_layers() -> None:
    shape = ModelShape(num_layers=80, hidden=8192, num_heads=64, num_kv_heads=8, ffn_hidden=28672,
                       vocab_size=32000, seq_len=4096)
    hw = HardwareProfile.uniform(128, 8, 80 * 2**30, intra_bw=200e9, inter_bw=25e9)
    plans = search(shape, hw, 1024, 80 * 2**30, global_batch=1024, top_k=3)
    best = plans[0]
    best.check_model(shape)
    assert best.world_size == 1024 and 1024 % best.pp == 0
    assert sum(best.pp_division) == 80
    assert max(best.prediction.stage_memory_bytes) <= 80 * 2**30
    # a 70B model does not fit pure data parallel (16 bytes/param x 70e9 / 1024 ranks is fine only with ZeRO)
    assert any(s.tp > 1 or s.zero > 0 for s in best.layers) or best.pp > 1
    assert best.prediction.throughput > 0
