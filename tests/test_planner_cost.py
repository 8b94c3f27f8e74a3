"""Cost model: golden numbers for hand-computable plans, memory per ZeRO stage and schedule."""

from __future__ import annotations

import pytest

from lightning_galv.plan import LayerStrategy, ModelShape, ParallelPlan
from lightning_galv.planner.cost import (GalvatronCostModel, StageContext, inflight_microbatches, overlapped,
                                         pipeline_time, state_bytes_per_param)
from lightning_galv.planner.profiles import HardwareProfile, LayerTypeProfile, ModelProfile, TimeFit, act_key

SEQ, H = 100, 10
SHAPE = ModelShape(num_layers=4, hidden=H, num_heads=2, num_kv_heads=2, ffn_hidden=40, vocab_size=64, seq_len=SEQ)
MS = 1e-3


def profile(params: int = 1_000_000, act: float = 1e6, head_ms: float = 0.0, precision: str = "bf16") -> ModelProfile:
    """1 ms forward and 2 ms backward per sample per layer; activations ``act`` bytes per sample."""
    lt = LayerTypeProfile("block", TimeFit(0.0, MS / SEQ), TimeFit(0.0, 2 * MS / SEQ), params,
                          {act_key(1, "none", False): act, act_key(1, "none", True): act / 10}, H)
    return ModelProfile("toy", SHAPE, (lt,), (0,) * 4, precision, head_forward=TimeFit(0.0, head_ms * MS / SEQ))


def hardware(bw: float = 1e9, slowdown: float = 1.0) -> HardwareProfile:
    return HardwareProfile.uniform(1, 8, 1e12, intra_bw=bw, inter_bw=bw, latency_s=0.0, overlap_slowdown=slowdown,
                                   memory_bandwidth=0.0)


def test_state_bytes_per_zero_stage() -> None:
    # ZeRO SC'20: mixed precision keeps 2 + 2 + 12 bytes per parameter
    assert [state_bytes_per_param(z, 4, "mixed") for z in range(4)] == [16.0, 4 + 12 / 4, 2 + 14 / 4, 16 / 4]
    assert [state_bytes_per_param(z, 4, "fp32") for z in range(4)] == [16.0, 8 + 8 / 4, 4 + 12 / 4, 16 / 4]


def test_inflight_by_schedule() -> None:
    assert inflight_microbatches(1, 0, 8, "1f1b") == 1
    assert inflight_microbatches(4, 0, 8, "gpipe") == 8
    assert [inflight_microbatches(4, i, 8, "1f1b") for i in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches(4, 0, 2, "1f1b") == 2
    assert inflight_microbatches(4, 0, 8, "interleaved_1f1b", 2) == pytest.approx(4 + 3 / 2)  # Korthikanti p(1+(p-1)/(pv))


def test_pipeline_and_overlap_formulas() -> None:
    assert pipeline_time([1.0, 1.0, 1.0, 1.0], [0.0] * 4, m=8) == pytest.approx(11.0)  # (m + p - 1) t
    assert pipeline_time([1.0] * 4, [0.0] * 4, m=8, v=2) == pytest.approx(8 + 3 / 2)
    assert pipeline_time([2.0, 1.0], [0.5, 0.1], m=4) == pytest.approx(4 * 2 + 1 + 0.5)
    assert overlapped(3.0, 1.0, 1.2) == pytest.approx(3.2)
    assert overlapped(1.0, 3.0, 1.0) == pytest.approx(3.0)


def test_pure_dp_plan_golden_time_and_memory() -> None:
    """2 ranks, dp2, zero0, batch 8 in 2 micro-batches: b = 2 samples/rank/micro-batch."""
    cm = GalvatronCostModel(profile(), hardware())
    plan = ParallelPlan.uniform(2, 4, LayerStrategy(dp=2), micro_batches=2, global_batch=8)
    c = cm.evaluate(plan)
    compute = 2 * 4 * (2 * 1 + 2 * 2) * MS  # m * layers * b * (fwd + bwd)
    sync = 2 * 1 / 2 * 1_000_000 * 2 / 1e9  # all-reduce of bf16 grads: 2 ms per layer < 4 ms backward: hidden
    assert sync < 4 * MS
    assert c.step_time_s == pytest.approx(compute)
    assert c.stage_memory_bytes[0] == pytest.approx(4 * (16 * 1_000_000 + 2 * 1e6))


def test_exposed_gradient_sync_with_overlap_slowdown() -> None:
    """Slow link: per-layer sync 20 ms vs 4 ms backward, overlap slowdown 1.5."""
    cm = GalvatronCostModel(profile(), hardware(bw=1e8, slowdown=1.5))
    plan = ParallelPlan.uniform(2, 4, LayerStrategy(dp=2), micro_batches=2, global_batch=8)
    sync, bwd = 20 * MS, 4 * MS
    exposed = sync + 0.5 * bwd - bwd  # overlapped(b, sync) - b
    assert cm.evaluate(plan).step_time_s == pytest.approx(2 * 4 * 6 * MS + 4 * exposed)


@pytest.mark.parametrize("zero,expected", [(0, 16.0), (1, 4 + 12 / 2), (2, 2 + 14 / 2), (3, 8.0)])
def test_memory_per_zero_stage(zero: int, expected: float) -> None:
    cm = GalvatronCostModel(profile(act=0.0), hardware())
    plan = ParallelPlan.uniform(2, 4, LayerStrategy(dp=2, zero=zero), micro_batches=1, global_batch=2)
    assert cm.evaluate(plan).stage_memory_bytes[0] == pytest.approx(4 * expected * 1_000_000)


def test_zero3_gathers_every_micro_batch() -> None:
    cm = GalvatronCostModel(profile(), hardware(bw=1e8))
    z2 = cm.evaluate(ParallelPlan.uniform(2, 4, LayerStrategy(dp=2, zero=2), micro_batches=4, global_batch=8))
    z3 = cm.evaluate(ParallelPlan.uniform(2, 4, LayerStrategy(dp=2, zero=3), micro_batches=4, global_batch=8))
    assert z3.step_time_s > z2.step_time_s  # 4 micro-batches x (2 gathers + 1 scatter) vs one sync per step
    assert z3.stage_memory_bytes[0] < z2.stage_memory_bytes[0]


def test_activation_memory_by_schedule() -> None:
    """pp2 on 2 ranks, 4 layers split 2/2, m=4: GPipe keeps 4 micro-batches, 1F1B keeps p - i."""
    cm = GalvatronCostModel(profile(params=0, act=1e6), hardware())
    base = dict(pp=2, micro_batches=4, global_batch=8)
    g = cm.evaluate(ParallelPlan.uniform(2, 4, LayerStrategy(), pipeline_schedule="gpipe", **base))
    f = cm.evaluate(ParallelPlan.uniform(2, 4, LayerStrategy(), pipeline_schedule="1f1b", **base))
    per_mb = 2 * 2 * 1e6  # 2 layers x 2 samples per micro-batch
    assert g.stage_memory_bytes == pytest.approx((4 * per_mb, 4 * per_mb))
    assert f.stage_memory_bytes == pytest.approx((2 * per_mb, 1 * per_mb))
    assert g.step_time_s == pytest.approx(f.step_time_s)


def test_checkpoint_costs_recompute_and_saves_memory() -> None:
    cm = GalvatronCostModel(profile(params=0), hardware())
    ctx = StageContext(stage_size=1, micro_batch=2, micro_batches=1)
    plain = cm.layer_cost(0, LayerStrategy(), ctx)
    ck = cm.layer_cost(0, LayerStrategy(checkpoint=True), ctx)
    assert ck.bwd - plain.bwd == pytest.approx(2 * MS)  # one more forward of 2 samples
    assert ck.act == pytest.approx(plain.act / 10)
    assert ck.transient == pytest.approx(plain.act - ck.act)


def test_tensor_parallel_comm_golden() -> None:
    """tp2: compute halves; 2 all-reduces of b*s*h*2 bytes forward and 2 backward."""
    cm = GalvatronCostModel(profile(params=0), hardware(bw=1e6))
    ctx = StageContext(stage_size=2, micro_batch=2, micro_batches=1)
    c = cm.layer_cost(0, LayerStrategy(tp=2), ctx)
    msg = 2 * SEQ * H * 2
    ar = 2 * 1 / 2 * msg / 1e6
    assert c.fwd == pytest.approx(1 * MS + 2 * ar)
    assert c.bwd == pytest.approx(2 * MS + 2 * ar)
    sp = cm.layer_cost(0, LayerStrategy(tp=2, sp="megatron"), ctx)
    assert sp.fwd == pytest.approx(c.fwd)  # all-gather + reduce-scatter move what one all-reduce moves
    assert sp.act < c.act
    uly = cm.layer_cost(0, LayerStrategy(tp=2, sp="ulysses"), ctx)
    assert uly.fwd == pytest.approx(1 * MS + 4 * (1 / 2) * (msg / 2) / 1e6)


def test_transition_only_when_layout_changes() -> None:
    cm = GalvatronCostModel(profile(), hardware(bw=1e6))
    ctx = StageContext(stage_size=4, micro_batch=4, micro_batches=1)
    a, b = LayerStrategy(dp=4), LayerStrategy(dp=4, zero=3, checkpoint=True)
    assert cm.transition_time(a, b, ctx) == 0.0
    c = LayerStrategy(tp=2, dp=2)
    # dp 4 -> 2: each rank gathers 2 samples from 2 ranks
    assert cm.transition_time(a, c, ctx) == pytest.approx(1 / 2 * 2 * SEQ * H * 2 / 1e6)
    assert cm.transition_time(c, LayerStrategy(tp=2, dp=2, tp_consecutive=False), ctx) > 0


def test_evaluate_needs_global_batch() -> None:
    cm = GalvatronCostModel(profile(), hardware())
    with pytest.raises(ValueError, match="HINT:"):
        cm.evaluate(ParallelPlan.uniform(2, 4, LayerStrategy(dp=2)))
