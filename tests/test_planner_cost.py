"""Cost model: golden numbers for hand-computable plans, memory per ZeRO stage and schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_galv.plan import LayerStrategy, ModelShape, ParallelPlan
from lightning_galv.planner.cost import (GRAD_BUCKET_BYTES, GalvatronCostModel, StageContext, inflight_microbatches,
                                         bucketed_sync_exposed, bucketed_sync_split, overlapped, pipeline_time,
                                         state_bytes_per_param)
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


@pytest.mark.parametrize("compute,comm", [(2.0, 1.0), (1.0, 3.0), (5.0, 5.0)])
def test_overlap_slowdown_is_the_inverse_of_overlapped(compute: float, comm: float) -> None:
    """The profiler's estimator must give the ``s`` the cost model then prices with: serial pairs give 2 whatever
    the ratio (the former ``both / max`` gave 1.5 at 2:1), perfect overlap 1, a measured ``both`` is reproduced."""
    from lightning_galv.planner.cost import overlap_slowdown_from, overlapped

    assert overlap_slowdown_from(compute, comm, compute + comm) == pytest.approx(2.0)
    assert overlap_slowdown_from(compute, comm, max(compute, comm)) == pytest.approx(1.0)
    assert overlap_slowdown_from(compute, comm, 0.5 * max(compute, comm)) == 1.0  # faster than either: clamped
    for both in (max(compute, comm) * 1.2, compute + comm, 1.3 * (compute + comm)):
        s = overlap_slowdown_from(compute, comm, both)
        assert overlapped(compute, comm, s) == pytest.approx(both)
    assert overlap_slowdown_from(0.0, comm, comm) == 1.0


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


def test_vocab_parallel_head_golden() -> None:
    """tp=2 head, b=2 samples, seq 100, vocab 64, bf16 (2 bytes), 1e6 B/s, no latency, no head compute.

    Gathered logits: all-gather of the full 2*100*64*2 = 25600 bytes, each rank receives half: 12800 / 1e6
    = 12.8 ms; saved logits 2 samples x 1000 bytes. Vocab-parallel loss: all-reduce of 2*100 fp32 maxima
    (800 bytes, ring factor 2*(1/2) = 1) + all-reduce of 2*100*2 fp32 sums (1600 bytes): 2.4 ms; saved
    logits 2 x 1000 / 2. Backward and states are the same (no head parameters in this profile).
    """
    cm = GalvatronCostModel(profile(params=0).with_(head_act_bytes=1000.0), hardware(bw=1e6))
    ctx = StageContext(stage_size=2, micro_batch=2, micro_batches=1)
    head = LayerStrategy(tp=2)
    gathered = cm.end_cost(head, ctx, False, True)
    vpl = cm.end_cost(head, ctx, False, True, vocab_parallel_loss=True)
    assert gathered.fwd == pytest.approx(12.8e-3) and gathered.act == pytest.approx(2000.0)
    assert vpl.fwd == pytest.approx(2.4e-3) and vpl.act == pytest.approx(1000.0)
    assert vpl.bwd == gathered.bwd and vpl.states == gathered.states
    # a tp=1 head neither gathers nor shards, whatever the flag
    dp = LayerStrategy(dp=2)
    assert cm.end_cost(dp, ctx, False, True, True) == cm.end_cost(dp, ctx, False, True, False)
    # the whole plan: the flag is read from ParallelPlan.vocab_parallel_loss
    plan = ParallelPlan.uniform(2, 4, LayerStrategy(tp=2), global_batch=2)
    a, b = cm.evaluate(plan), cm.evaluate(plan.with_(vocab_parallel_loss=True))
    assert a.step_time_s - b.step_time_s == pytest.approx(12.8e-3 - 2.4e-3)
    assert a.peak_memory_bytes - b.peak_memory_bytes == pytest.approx(1000.0)


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


# ---------------------------------------------------------------------------------------------------
# runtime-faithful terms: measured sharded compute, synchronous collectives, bucketed DP sync, FSDP2 work
# ---------------------------------------------------------------------------------------------------
def _layer_cost(cm: GalvatronCostModel, s: LayerStrategy, mb: int = 8):
    return cm.layer_cost(0, s, StageContext(s.width, mb, 1))


def test_measured_sharded_compute_replaces_division() -> None:
    """tp2 ranks each see b = 8 samples; divided fit: 8 ms / 2; measured: whatever the profile says."""
    base = profile()
    hw = hardware(bw=1e30)  # free collectives: only compute is left
    s = LayerStrategy(tp=2)
    divided = _layer_cost(GalvatronCostModel(base, hw), s)
    assert divided.fwd == pytest.approx(8 * MS / 2) and divided.bwd == pytest.approx(16 * MS / 2)
    lt = base.layer(0)
    measured = {"tp2/none": {"forward": TimeFit(3 * MS, 0.0), "backward": TimeFit(5 * MS, 0.0)}}
    prof = base.with_(layer_types=(LayerTypeProfile(lt.name, lt.forward, lt.backward, lt.params, lt.activation_bytes,
                                                    lt.hidden, sharded=measured),))
    got = _layer_cost(GalvatronCostModel(prof, hw), s)
    assert got.fwd == pytest.approx(3 * MS) and got.bwd == pytest.approx(5 * MS)
    ck = _layer_cost(GalvatronCostModel(prof, hw), LayerStrategy(tp=2, checkpoint=True))
    assert ck.bwd == pytest.approx(5 * MS + 3 * MS)  # recomputation = one more measured sharded forward


def test_a_timed_checkpointed_variant_prices_its_own_forward_and_recompute() -> None:
    """Where the profiler timed the variant checkpointed, a checkpointed layer takes that forward and, as the
    recompute, what its backward added -- not one more plain forward (non-reentrant checkpointing stops at the
    last saved tensor); the plain layer and other variants keep their fits; the recompute repeats the forward's
    collectives all the same."""
    base = profile()
    lt = base.layer(0)
    measured = {"tp2/none": {"forward": TimeFit(3 * MS, 0.0), "backward": TimeFit(5 * MS, 0.0),
                             "checkpoint_forward": TimeFit(3.5 * MS, 0.0), "recompute": TimeFit(2 * MS, 0.0)},
                "tp2/megatron": {"forward": TimeFit(4 * MS, 0.0), "backward": TimeFit(6 * MS, 0.0)}}
    prof = base.with_(layer_types=(LayerTypeProfile(lt.name, lt.forward, lt.backward, lt.params, lt.activation_bytes,
                                                    lt.hidden, sharded=measured),))
    free = GalvatronCostModel(prof, hardware(bw=1e30))
    ck = _layer_cost(free, LayerStrategy(tp=2, checkpoint=True))
    assert ck.fwd == pytest.approx(3.5 * MS) and ck.bwd == pytest.approx(5 * MS + 2 * MS)
    plain = _layer_cost(free, LayerStrategy(tp=2))
    assert plain.fwd == pytest.approx(3 * MS) and plain.bwd == pytest.approx(5 * MS)
    sp = _layer_cost(free, LayerStrategy(tp=2, sp="megatron", checkpoint=True))  # not timed checkpointed
    assert sp.fwd == pytest.approx(4 * MS) and sp.bwd == pytest.approx(6 * MS + 4 * MS)
    slow = GalvatronCostModel(prof, hardware(bw=1e6))  # collectives: forward once, backward + recompute again
    comm = _layer_cost(slow, LayerStrategy(tp=2)).fwd - 3 * MS
    assert comm > 0
    assert _layer_cost(slow, LayerStrategy(tp=2, checkpoint=True)).bwd == pytest.approx(7 * MS + 2 * comm)
    # where the profiler counted which of them a recompute repeats (early stop skips a Megatron block's closing
    # all-reduce: half of them), only that share is repeated; other variants keep repeating all
    counted = base.with_(layer_types=(LayerTypeProfile(lt.name, lt.forward, lt.backward, lt.params,
                                                       lt.activation_bytes, lt.hidden, sharded=measured,
                                                       recompute_comm={"tp2/none": 0.5}),))
    half = GalvatronCostModel(counted, hardware(bw=1e6))
    assert _layer_cost(half, LayerStrategy(tp=2, checkpoint=True)).bwd == pytest.approx(7 * MS + 1.5 * comm)
    assert _layer_cost(half, LayerStrategy(tp=2)).bwd == pytest.approx(5 * MS + comm)  # not checkpointed: no recompute
    sp_comm = _layer_cost(half, LayerStrategy(tp=2, sp="megatron")).fwd - 4 * MS
    assert _layer_cost(half, LayerStrategy(tp=2, sp="megatron", checkpoint=True)).bwd == \
        pytest.approx(10 * MS + 2 * sp_comm)
    assert ModelProfile.from_json(counted.to_json()) == counted
    with pytest.raises(ValueError, match=r"recompute_comm\['tp2/none'\]=1.5.*HINT"):
        LayerTypeProfile(lt.name, lt.forward, lt.backward, lt.params, lt.activation_bytes, lt.hidden,
                         recompute_comm={"tp2/none": 1.5})
    # a checkpointed forward fitted below the plain one (noise, extrapolation) is priced as the plain one:
    # checkpointing never makes a layer cheaper
    low = {"tp2/none": {**measured["tp2/none"], "checkpoint_forward": TimeFit(1 * MS, 0.0)}}
    low_prof = base.with_(layer_types=(LayerTypeProfile(lt.name, lt.forward, lt.backward, lt.params,
                                                        lt.activation_bytes, lt.hidden, sharded=low),))
    ck_low = _layer_cost(GalvatronCostModel(low_prof, hardware(bw=1e30)), LayerStrategy(tp=2, checkpoint=True))
    assert ck_low.fwd == pytest.approx(3 * MS) and ck_low.fwd + ck_low.bwd >= plain.fwd + plain.bwd
    with pytest.raises(ValueError, match="together or neither"):
        LayerTypeProfile(lt.name, lt.forward, lt.backward, lt.params, lt.activation_bytes, lt.hidden,
                         sharded={"tp2/none": {"forward": TimeFit(), "backward": TimeFit(), "recompute": TimeFit()}})


def test_synchronous_collectives_add_instead_of_overlapping() -> None:
    """ZeRO-3: the parameter all-gather before forward either hides under compute or adds to it."""
    s = LayerStrategy(dp=2, zero=3)
    gather = 1 / 2 * 1_000_000 * 2 / 1e8  # all-gather of bf16 params over 2 ranks at 100 MB/s: 10 ms
    fwd_compute = 4 * MS  # b = 4 samples
    hw = hardware(bw=1e8)
    assert _layer_cost(GalvatronCostModel(profile(), hw), s).fwd == pytest.approx(max(fwd_compute, gather))
    sync_hw = HardwareProfile.from_dict({**hw.to_dict(), "async_collectives": False})
    assert _layer_cost(GalvatronCostModel(profile(), sync_hw), s).fwd == pytest.approx(fwd_compute + gather)


def test_native_dp_sync_overlaps_the_last_backward_without_a_pipeline() -> None:
    """Our GradientSync launches each bucket's all-reduce during the last backward (async, gloo too): priced by the
    profiled overlap slowdown, plus the flatten/scale traffic (4 x grads; no copy back) -- except the last bucket,
    which fills only when backward ends and is paid in full: a model whose gradients fit one 25 MiB bucket (here
    4 layers x 2 MB) overlaps nothing. Of 400 MB (15 full buckets and a 6.8 MB rest, each all-reduce shorter than
    the backward that fills the next) the full buckets run beside backward, both slowed, and the rest waits. Under
    a pipeline the schedule owns the backward and the sync runs after it."""
    bwd = 8 * MS  # 2 ms per sample, b = 4
    # 8 MB of gradients in all: one bucket; 400 MB: 16 buckets (a faster link keeps the all-reduce under backward)
    for params, bw in ((1_000_000, 1e9), (50_000_000, 1e11)):
        grads = params * 2.0
        allreduce = 2 * 1 / 2 * grads / bw  # 2 ms / 1 ms
        optimizer = 28.0 * params / 1e10
        copy = 4 * grads / 1e10
        full = 15 if params == 50_000_000 else 0  # full buckets before the last
        rest = (4 * grads - full * GRAD_BUCKET_BYTES) / (4 * grads)  # the last bucket's share of the 4 layers'
        for slowdown, is_async in ((1.0, True), (1.5, True), (1.5, False)):  # CPU profiles: async_collectives False
            hw = HardwareProfile.from_dict({**hardware(bw=bw, slowdown=slowdown).to_dict(), "memory_bandwidth": 1e10,
                                            "async_collectives": is_async})
            native = _layer_cost(GalvatronCostModel(profile(params), hw, runtime="native"), LayerStrategy(dp=2))
            # per layer: the rest after backward, the full buckets' all-reduces beside it (each slows it by 0.5x)
            stretch = (slowdown - 1.0) * full * GRAD_BUCKET_BYTES / (4 * grads) * allreduce
            sync = rest * allreduce + stretch
            assert native.step_extra == pytest.approx(optimizer + copy + sync)
            assert bucketed_sync_exposed(bwd, allreduce, 4, grads, slowdown) == pytest.approx(sync)
            # the two parts: backward slowed beside the full buckets, then the last bucket after it
            assert bucketed_sync_split(bwd, allreduce, 4, grads, slowdown) == pytest.approx((stretch, rest * allreduce))
            # of which inside backward: the hooks moving each gradient into its bucket (half the traffic; the
            # scaling runs after the wait), and backward's slowdown beside the all-reduces
            assert native.in_backward == pytest.approx(copy / 2 + stretch)
            piped = GalvatronCostModel(profile(params), hw, runtime="native").layer_cost(
                0, LayerStrategy(dp=2), StageContext(2, 8, 4, pp=2))
            assert piped.step_extra == pytest.approx(optimizer + allreduce + copy)
            assert piped.in_backward == 0.0  # under a pipeline every copy runs after the schedule
    ideal = _layer_cost(GalvatronCostModel(profile(), hardware(bw=1e9)), LayerStrategy(dp=2))
    assert ideal.step_extra == pytest.approx(0.0)  # hidden under the 8 ms backward (slowdown 1), no optimizer bw


def test_native_zero_gradient_memory_follows_fsdp2() -> None:
    """ZeRO-2/3 units under FSDP2: the backward briefly holds the unsharded gradient and the reduce-scatter input
    it is copied into; with gradient accumulation and no pipeline the unsharded gradient is kept between
    micro-batches (no reduce-scatter before the last one), so it is counted as kept."""
    params, el, g = 1_000_000, 2.0, 2
    cm = GalvatronCostModel(profile(), hardware(), runtime="native")
    ideal = GalvatronCostModel(profile(), hardware())
    z3, z2 = LayerStrategy(dp=g, zero=3), LayerStrategy(dp=g, zero=2)
    one = StageContext(2, 8, 1)
    gathered = 2 * params * el * (1 - 1 / g)  # this layer's and the prefetched layer's parameters
    assert cm.layer_cost(0, z3, one).transient == pytest.approx(gathered + 2 * params * el)
    assert cm.layer_cost(0, z2, one).transient == pytest.approx(2 * params * el)
    assert ideal.layer_cost(0, z3, one).transient == 0.0
    accum, piped = StageContext(2, 8, 4), StageContext(2, 8, 4, pp=2)
    for s in (z2, z3):
        kept = cm.layer_cost(0, s, accum).states - cm.layer_cost(0, s, one).states
        assert kept == pytest.approx(params * el)
        assert cm.layer_cost(0, s, accum).transient == pytest.approx(cm.layer_cost(0, s, one).transient - params * el)
        # a pipeline stage reduce-scatters after every micro-batch's backward: nothing accumulates unsharded
        assert cm.layer_cost(0, s, piped).states == pytest.approx(cm.layer_cost(0, s, one).states)
    assert cm.layer_cost(0, LayerStrategy(dp=g, zero=1), accum).states == \
        pytest.approx(cm.layer_cost(0, LayerStrategy(dp=g, zero=1), one).states)


def test_native_zero_end_memory_follows_fsdp2() -> None:
    """The embedding and head are FSDP2 units like the blocks (parallel/parallelize.py): their ZeRO-2 sharded
    parameter copy and, when accumulating without a pipeline, their unsharded gradient are kept; the head's
    gathered ZeRO-3 parameters and reduce-scatter buffers are alive when backward starts (the peak), the
    embedding's are not. Before, the ends were priced with the textbook bytes only."""
    el, g, n = 2.0, 2, 1_000_000
    prof = profile().with_(head_params=n, embed_params=n)
    native, ideal = GalvatronCostModel(prof, hardware(), runtime="native"), GalvatronCostModel(prof, hardware())
    one, accum, piped = StageContext(2, 8, 1), StageContext(2, 8, 4), StageContext(2, 8, 4, pp=2, stage=0)
    z2, z3 = LayerStrategy(dp=g, zero=2), LayerStrategy(dp=g, zero=3)
    for first, last in ((True, False), (False, True)):
        def extra(s: LayerStrategy, ctx: StageContext) -> float:  # kept + the head's transient at the peak
            a, b = native.end_cost(s, ctx, first, last), ideal.end_cost(s, ctx, first, last)
            assert b.transient == 0.0 and (a.transient == 0.0 or last or ctx.pp > 1)
            return a.states + a.transient - b.states
        held = n * el * (1 - 1 / g) + 2 * n * el if last else 0.0  # the head's gathered copy + its buffers
        assert extra(z2, one) == pytest.approx(n * el / g + (2 * n * el if last else 0.0))
        assert extra(z3, one) == pytest.approx(held)
        assert extra(z2, accum) == pytest.approx(n * el / g + n * el + (n * el if last else 0.0))
        assert extra(z3, accum) == pytest.approx(n * el + (n * el * (1 - 1 / g) + n * el if last else 0.0))
        # a pipeline stage reduce-scatters every micro-batch: nothing accumulates unsharded; its embedding runs
        # while other micro-batches' activations are alive, so its buffers count at the peak too
        assert extra(z2, piped) == pytest.approx(n * el / g + 2 * n * el)
        # tensor-parallel ends: FSDP2 shards each rank's 1/tp slice
        tp2 = LayerStrategy(tp=2, dp=g, zero=2)
        assert extra(tp2, one) == pytest.approx((n / 2) * el / g + (2 * (n / 2) * el if last else 0.0))
        for zero in (0, 1):
            assert extra(LayerStrategy(dp=g, zero=zero), accum) == 0.0
    # the plan's peak counts them once (stage_fixed adds the ends' memory)
    plan = ParallelPlan(world_size=g, layers=(LayerStrategy(dp=g),) * 4, pp=1, global_batch=8, micro_batches=4,
                        embed=z3, head=z3)
    assert native.evaluate(plan).peak_memory_bytes - ideal.evaluate(plan).peak_memory_bytes == pytest.approx(
        n * el + (n * el + n * el * (1 - 1 / g) + n * el))  # embedding's kept gradient + the head's


def test_native_zero3_reduce_scatters_once_per_step_under_accumulation() -> None:
    """Gradient accumulation without a pipeline turns gradient sync off for all but the last micro-batch: a ZeRO-3
    unit gathers in every micro-batch's forward and backward but reduce-scatters only in the last backward
    (FSDP2 ``set_requires_gradient_sync``), so the reduce-scatter is priced once per step, not per micro-batch.
    The last unit's reduce-scatter has no backward left to overlap: each of the 4 layers pays 1/4 of its own in
    full, once per step."""
    hw = hardware(bw=1e8)  # bf16 grads of 1 M params over 2 ranks: 10 ms per all-gather or reduce-scatter
    cm = GalvatronCostModel(profile(), hw, runtime="native")
    z3 = LayerStrategy(dp=2, zero=3)
    one, accum = StageContext(2, 8, 1), StageContext(2, 8, 4)
    bwd, comm = 8 * MS, 10 * MS  # 2 ms per sample, b = 4
    tail = comm / 4
    single = cm.layer_cost(0, z3, one)
    assert single.bwd == pytest.approx(overlapped(bwd, 2 * comm - tail, 1.0))  # gather + reduce-scatter, but the tail
    acc = cm.layer_cost(0, z3, accum)
    assert acc.fwd == pytest.approx(single.fwd)
    assert acc.bwd == pytest.approx(overlapped(bwd, comm, 1.0))  # gather only
    assert acc.step_extra - single.step_extra == \
        pytest.approx(overlapped(bwd, 2 * comm - tail, 1.0) - overlapped(bwd, comm, 1.0))  # the last backward's scatter
    # FSDP2 runs both inside backward (its hooks): the exposed tail, and the last micro-batch's scatter
    assert single.in_backward == pytest.approx(tail)
    assert acc.in_backward == pytest.approx(acc.step_extra - single.step_extra + tail)
    assert single.step_extra == pytest.approx(_layer_cost(GalvatronCostModel(profile(), hardware(bw=1e30),
                                                                              runtime="native"), z3).step_extra + tail)
    piped = cm.layer_cost(0, z3, StageContext(2, 8, 4, pp=2))  # a stage scatters after every micro-batch
    assert piped.bwd == pytest.approx(overlapped(bwd, 2 * comm, 1.0)) and piped.step_extra < single.step_extra


def test_native_zero2_gathers_every_micro_batch_and_reduce_scatters_once_per_step() -> None:
    """FSDP2 re-shards a ZeRO-2 unit after every backward, so it gathers before every micro-batch's forward (beside
    the forward's compute), also while accumulating; the reduce-scatter runs in the last micro-batch's backward
    only (tests/test_parity.py counts both in a 4-rank run). No gather in backward: that is ZeRO-3's."""
    hw = hardware(bw=1e8)  # bf16 grads of 1 M params over 2 ranks: 10 ms per all-gather or reduce-scatter
    cm = GalvatronCostModel(profile(), hw, runtime="native")
    z2 = LayerStrategy(dp=2, zero=2)
    one, accum = StageContext(2, 8, 1), StageContext(2, 8, 4)
    fwd, bwd, comm = 4 * MS, 8 * MS, 10 * MS  # 1 / 2 ms per sample, b = 4
    tail = comm / 4
    single, acc = cm.layer_cost(0, z2, one), cm.layer_cost(0, z2, accum)
    assert single.fwd == pytest.approx(overlapped(fwd, comm, 1.0)) and acc.fwd == pytest.approx(single.fwd)
    assert single.bwd == pytest.approx(overlapped(bwd, comm - tail, 1.0))
    assert acc.bwd == pytest.approx(bwd)  # nothing to reduce before the last micro-batch
    assert acc.step_extra - single.step_extra == pytest.approx(overlapped(bwd, comm - tail, 1.0) - bwd)
    z3 = cm.layer_cost(0, LayerStrategy(dp=2, zero=3), one)
    assert z3.bwd == pytest.approx(overlapped(bwd, 2 * comm - tail, 1.0))  # ZeRO-3 gathers again for backward
    piped = cm.layer_cost(0, z2, StageContext(2, 8, 4, pp=2))  # a stage reduce-scatters after every micro-batch
    assert piped.fwd == pytest.approx(single.fwd) and piped.bwd == pytest.approx(overlapped(bwd, comm, 1.0))
    # the ends too: a ZeRO-2 head accumulating without a pipeline reduce-scatters in the last backward only
    head = LayerStrategy(dp=2, zero=2)
    prof = profile().with_(head_params=1_000_000, head_forward=TimeFit(0.0, 1 * MS / SEQ))  # 4 ms fwd, 8 ms bwd
    ends = GalvatronCostModel(prof, hardware(bw=5e7), runtime="native")  # 20 ms reduce-scatter: not hidden
    h_one, h_acc = ends.end_cost(head, one, False, True), ends.end_cost(head, accum, False, True)
    h_plain = GalvatronCostModel(prof, hardware(bw=1e30), runtime="native").end_cost(head, one, False, True)
    assert h_acc.fwd == pytest.approx(h_one.fwd) and h_acc.bwd == pytest.approx(h_plain.bwd)
    assert h_one.bwd > h_plain.bwd and h_acc.step_extra > h_one.step_extra


def test_measured_end_backwards_replace_the_ratios() -> None:
    """A profile with the ends' backwards measured prices them as measured (sharded like the forward under tp);
    without, the embedding's backward is priced as long as its lookup and the head's at twice its forward."""
    prof = profile().with_(embed_forward=TimeFit(0.0, 1 * MS / SEQ), head_forward=TimeFit(0.0, 2 * MS / SEQ))
    one = StageContext(1, 1, 1)
    alone = LayerStrategy()
    cm = GalvatronCostModel(prof, hardware(), runtime="native")
    assert cm.end_cost(alone, one, True, False).bwd == pytest.approx(1 * MS)  # 1 sample: 1 ms lookup
    assert cm.end_cost(alone, one, False, True).bwd == pytest.approx(4 * MS)
    measured = prof.with_(embed_backward=TimeFit(0.5 * MS, 3 * MS / SEQ), head_backward=TimeFit(0.0, 2.5 * MS / SEQ))
    cm = GalvatronCostModel(measured, hardware(), runtime="native")
    assert cm.end_cost(alone, one, True, False).bwd == pytest.approx(3.5 * MS)
    assert cm.end_cost(alone, one, False, True).bwd == pytest.approx(2.5 * MS)
    assert cm.end_cost(alone, one, True, True).bwd == pytest.approx(6 * MS)
    # tp 2: the embedding's backward scatter-adds every token into half the rows (constant halved), the head's
    # math is split (its per-call constant is not)
    assert cm.end_cost(LayerStrategy(tp=2), one, True, False).bwd == pytest.approx(0.25 * MS + 3 * MS)
    tp_head = measured.with_(head_backward=TimeFit(0.5 * MS, 2 * MS / SEQ))
    head2 = GalvatronCostModel(tp_head, hardware(), runtime="native").end_cost(LayerStrategy(tp=2), one, False, True)
    assert head2.bwd == pytest.approx(0.5 * MS + 1.0 * MS)
    both2 = GalvatronCostModel(tp_head, hardware(), runtime="native").end_cost(LayerStrategy(tp=2), one, True, True)
    assert both2.bwd == pytest.approx(0.25 * MS + 3 * MS + 0.5 * MS + 1.0 * MS)  # one stage: each end its own rule
    assert type(measured).from_json(measured.to_json()) == measured
    assert "head_backward" not in prof.to_dict()  # unmeasured: serialized as before


def test_fsdp_overhead_scaled_by_the_ranks_parameter_share() -> None:
    lt = profile().layer(0)
    over = {"zero3": {"forward": TimeFit(2 * MS, 0.0), "backward": TimeFit(4 * MS, 0.0)},
            "zero2": {"forward": TimeFit(1 * MS, 0.0), "backward": TimeFit(1 * MS, 0.0)}}
    prof = profile().with_(layer_types=(LayerTypeProfile(lt.name, lt.forward, lt.backward, lt.params,
                                                         lt.activation_bytes, lt.hidden, zero_overhead=over),))
    hw = hardware(bw=1e30)
    plain = _layer_cost(GalvatronCostModel(prof, hw, runtime="native"), LayerStrategy(dp=2, zero=3))
    with_tp = _layer_cost(GalvatronCostModel(prof, hw, runtime="native"), LayerStrategy(tp=2, dp=2, zero=3), mb=8)
    base = _layer_cost(GalvatronCostModel(profile(), hw, runtime="native"), LayerStrategy(dp=2, zero=3))
    assert plain.fwd - base.fwd == pytest.approx(2 * MS) and plain.bwd - base.bwd == pytest.approx(4 * MS)
    base_tp = _layer_cost(GalvatronCostModel(profile(), hw, runtime="native"), LayerStrategy(tp=2, dp=2, zero=3))
    assert with_tp.fwd - base_tp.fwd == pytest.approx(1 * MS)  # half the layer's parameters on this rank
    z2 = _layer_cost(GalvatronCostModel(prof, hw, runtime="native"), LayerStrategy(dp=2, zero=2))
    z2_base = _layer_cost(GalvatronCostModel(profile(), hw, runtime="native"), LayerStrategy(dp=2, zero=2))
    # ZeRO-2 too gathers in every micro-batch (FSDP2 re-shards after each backward, also while accumulating):
    # its overhead is a micro-batch's, like ZeRO-3's, not a step's
    assert z2.fwd - z2_base.fwd == pytest.approx(1 * MS) and z2.bwd - z2_base.bwd == pytest.approx(1 * MS)
    assert z2.step_extra == pytest.approx(z2_base.step_extra)
    # the ideal (textbook) runtime has no FSDP2 to pay for
    assert _layer_cost(GalvatronCostModel(prof, hw), LayerStrategy(dp=2, zero=3)).fwd == pytest.approx(
        _layer_cost(GalvatronCostModel(profile(), hw), LayerStrategy(dp=2, zero=3)).fwd)


def test_dtensor_optimizer_overhead_charged_once_per_step_to_dtensor_layers() -> None:
    """A layer whose parameters the native runtime keeps as DTensors (tp > 1, or FSDP2's ZeRO-2/3 over > 1
    rank) pays the measured per-layer optimizer overhead once per step; plain parameters (dp, ZeRO-0/1,
    Ulysses, a one-rank ZeRO-3) do not; tp and ZeRO-3 at once pay the larger; the ideal runtime never."""
    lt = profile().layer(0)
    prof = profile().with_(layer_types=(LayerTypeProfile(lt.name, lt.forward, lt.backward, lt.params,
                                                         lt.activation_bytes, lt.hidden,
                                                         optimizer_overhead={"tp": 3 * MS, "zero": 2 * MS}),))
    hw = hardware()

    def delta(s: LayerStrategy, mb: int = 4, runtime: str = "native") -> float:
        with_, without = (_layer_cost(GalvatronCostModel(p, hw, runtime=runtime), s, mb=mb) for p in (prof, profile()))
        assert (with_.fwd, with_.bwd, with_.states) == (without.fwd, without.bwd, without.states)
        return with_.step_extra - without.step_extra

    assert delta(LayerStrategy(tp=2, dp=1), mb=8) == pytest.approx(3 * MS)
    assert delta(LayerStrategy(dp=2, zero=3)) == pytest.approx(2 * MS)
    assert delta(LayerStrategy(dp=2, zero=2)) == pytest.approx(2 * MS)
    assert delta(LayerStrategy(tp=2, dp=2, zero=3), mb=8) == pytest.approx(3 * MS)
    for plain in (LayerStrategy(dp=2), LayerStrategy(dp=2, zero=1), LayerStrategy(tp=2, dp=1, sp="ulysses"),
                  LayerStrategy(dp=1, zero=3)):
        assert delta(plain, mb=8) == 0.0, plain
    assert delta(LayerStrategy(tp=2, dp=1), mb=8, runtime="ideal") == 0.0
    # an MoE block whose experts (3/4 of its tensors) stay plain at ep = data group: only the rest pays
    from lightning_galv.planner.profiles import MoELayerFacts

    moe = MoELayerFacts(num_experts=2, top_k=1, expert_params=1000, dim=H, expert_tensor_share=0.75)
    moe_prof = profile().with_(layer_types=(LayerTypeProfile(lt.name, lt.forward, lt.backward, lt.params,
                                                             lt.activation_bytes, lt.hidden, moe=moe,
                                                             optimizer_overhead={"zero": 4 * MS}),))
    cm = GalvatronCostModel(moe_prof, hw, runtime="native")
    from lightning_galv.planner.cost import dtensor_step_overhead

    layer = cm.model.layer(0)
    assert dtensor_step_overhead(layer, LayerStrategy(dp=2, zero=3), 2) == pytest.approx(4 * MS)
    assert dtensor_step_overhead(layer, LayerStrategy(dp=2, ep=2, zero=3), 2) == pytest.approx(1 * MS)
    assert dtensor_step_overhead(layer, LayerStrategy(dp=4, ep=2, zero=3), 4) == pytest.approx(4 * MS)
    with pytest.raises(ValueError, match="expert_tensor_share.*HINT"):
        MoELayerFacts(num_experts=2, top_k=1, expert_params=1000, dim=H, expert_tensor_share=1.5)


def test_native_transitions_follow_the_runtime_relayout() -> None:
    """parallel/redistribute.py: forward all-gathers every rank's shard over the stage unless the next
    layer's shard lies inside the one held, backward likewise the other way round; both ways a local slice
    when nested. Golden at 1 GB/s, no latency, 4 ranks, micro-batch 8, 2000 B per sample (bf16, 100 x 10)."""
    from lightning_galv.planner.cost import native_transition_time, shards_nested

    dp4, tp4, tp2dp2 = LayerStrategy(dp=4), LayerStrategy(tp=4), LayerStrategy(tp=2, dp=2)
    strided = LayerStrategy(tp=2, dp=2, tp_consecutive=False)  # shards 0, 1, 0, 1 over ranks 0..3
    assert shards_nested(tp4, dp4) and shards_nested(tp2dp2, dp4) and not shards_nested(dp4, tp4)
    assert not shards_nested(strided, dp4) and shards_nested(tp4, strided)
    hw, sb = hardware(), 2000.0
    gather = 0.75 * 4 * 8 / 4 * sb / 1e9  # all-gather over 4 ranks of 4 quarter-batch shards
    assert native_transition_time(hw, dp4, tp4, sb, 8) == pytest.approx(gather)  # forward only
    assert native_transition_time(hw, tp4, dp4, sb, 8) == pytest.approx(gather)  # backward only
    # tp2 dp2 -> strided tp2 dp2: neither contains the other; the backward gathers 4 half-batch replicas
    both = 0.75 * 4 * 8 / 2 * sb / 1e9
    assert native_transition_time(hw, tp2dp2, strided, sb, 8) == pytest.approx(2 * both)
    cm = GalvatronCostModel(profile(), hw, runtime="native")
    ctx = StageContext(4, 8, 1)
    assert cm.transition_time(dp4, tp4, ctx) == pytest.approx(gather)
    assert cm.transition_time(dp4, LayerStrategy(dp=4, zero=3), ctx) == 0.0
    # the ends: a tp4 model with data-parallel embedding and head pays one gather in and one out
    plan = ParallelPlan.uniform(4, 4, tp4, global_batch=8).with_(embed=dp4, head=dp4)
    assert cm.chunk_boundary_time(plan, 0, ctx) == pytest.approx(2 * gather)
    assert cm.evaluate(plan).breakdown["transitions"] == pytest.approx(2 * gather)
    assert cm.evaluate(plan.with_(embed=tp4, head=tp4)).breakdown["transitions"] == 0.0
    # Galvatron's (ideal) model keeps its one gather between blocks and free ends
    assert GalvatronCostModel(profile(), hw).evaluate(plan).breakdown["transitions"] == 0.0


def test_recompute_peak_counts_after_the_head_is_freed() -> None:
    """Checkpointed layers: the measured recompute peak replaces 'full activations', and it is booked
    against memory from which the head's activations (one micro-batch) are already gone."""
    from lightning_galv.planner.profiles import transient_key

    lt = profile().layer(0)
    acts = {**lt.activation_bytes, transient_key(1, "none"): 3e6}
    prof = profile().with_(layer_types=(LayerTypeProfile(lt.name, lt.forward, lt.backward, lt.params, acts,
                                                         lt.hidden),), head_act_bytes=1e6)
    cm = GalvatronCostModel(prof, hardware())
    c = _layer_cost(cm, LayerStrategy(dp=1, checkpoint=True), mb=2)
    assert c.act == pytest.approx(2 * 1e5) and c.transient == pytest.approx(2 * 3e6 - 2 * 1e5)
    plan = ParallelPlan.uniform(1, 4, LayerStrategy(dp=1, checkpoint=True), global_batch=2)
    got = cm.evaluate(plan).peak_memory_bytes
    states = 4 * 16 * 1_000_000  # blocks (this profile gives embedding and head no parameters)
    fixed = states + 2 * 1e6  # + head activations of the micro-batch (embedding act 0 in this profile)
    assert got == pytest.approx(fixed + 4 * c.act + (c.transient - 2 * 1e6))


def test_vocab_parallel_embedding_golden() -> None:
    """tp=2 embedding, b=2 samples, seq 100, hidden 10, bf16, 1e6 B/s, no latency, no embedding compute: its
    output (2*100*10*2 = 4000 bytes) is all-reduced over the 2 ranks (ring factor 2*(1/2) = 1): 4 ms in the
    forward, nothing in the backward; a tp=1 embedding communicates nothing per micro-batch."""
    cm = GalvatronCostModel(profile(params=0), hardware(bw=1e6))
    ctx = StageContext(stage_size=2, micro_batch=2, micro_batches=1)
    vocab = cm.end_cost(LayerStrategy(tp=2), ctx, True, False)
    assert vocab.fwd == pytest.approx(4e-3) and vocab.bwd == 0.0
    assert cm.end_cost(LayerStrategy(dp=2), ctx, True, False).fwd == 0.0
    # whole plans: only the embedding differs, so the step times differ by exactly that all-reduce
    plan = ParallelPlan.uniform(2, 4, LayerStrategy(dp=2), global_batch=2)
    a = cm.evaluate(plan.with_(embed=LayerStrategy(tp=2), head=LayerStrategy(dp=2)))
    assert a.step_time_s - cm.evaluate(plan).step_time_s == pytest.approx(4e-3)


def test_native_dp_sync_pays_one_latency_per_bucket() -> None:
    """GradientSync all-reduces a group's gradients in 25 MiB buckets, each one collective with one latency: a
    model whose gradients fill a single bucket pays one whole latency for it, shared by its blocks by bytes (at 4
    gloo ranks on 2 cores that latency is milliseconds); a model of many full buckets pays about one per 25 MiB,
    as before. Bandwidth is free here, so what is left is latency."""
    lat = 1e-3
    hw = HardwareProfile.uniform(1, 8, 1e12, intra_bw=1e30, inter_bw=1e30, latency_s=lat, memory_bandwidth=0.0)
    for params in (1_000_000, 50_000_000):  # 4 layers x 2 MB (one bucket), x 100 MB (16 buckets)
        layer_bytes = params * 2.0
        buckets = -(-4 * layer_bytes // GRAD_BUCKET_BYTES)
        cost = _layer_cost(GalvatronCostModel(profile(params), hw, runtime="native"), LayerStrategy(dp=2))
        # one latency per bucket, each beside the backward that fills the next (2.1 ms of it, slowed 1.1x: 0.1
        # latency exposed), but the 15th, filled 0.54 ms before backward ends, runs 0.46 ms past it, and the last
        # waits for the end
        s, stage_bwd = hw.overlap_slowdown, 4 * cost.bwd
        if buckets == 1:
            exposed = lat
        else:
            gap = stage_bwd * (1 - 15 * GRAD_BUCKET_BYTES / (4 * layer_bytes))
            exposed = 14 * (s - 1) * lat + (s - 1) * gap + (lat - gap) + lat
        assert cost.step_extra == pytest.approx(exposed / 4)
    small = _layer_cost(GalvatronCostModel(profile(1_000_000), hw, runtime="native"), LayerStrategy(dp=2))
    assert small.step_extra == pytest.approx(lat / 4)  # 4 such layers: one latency in all


def test_native_embedding_gradient_sync_waits_for_the_end_of_backward() -> None:
    """The embedding registers first, so backward makes its gradient last: its all-reduce bucket (ZeRO-0) or its
    FSDP2 reduce-scatter (ZeRO-2) has nothing left to overlap and is paid in full, whatever the model's size; the
    head's, made first, is priced as a block's (4 layers x 10 MB: a full 25 MiB bucket beside backward, the rest
    after)."""
    from lightning_galv.planner.profiles import TimeFit as T

    prof = profile(50_000_000).with_(embed_params=5_000_000, head_params=5_000_000, embed_forward=T(0.0, 4 * MS / SEQ),
                                     head_forward=T(0.0, 4 * MS / SEQ))
    cm = GalvatronCostModel(prof, hardware(bw=1e11, slowdown=1.5), runtime="native")  # no optimizer bandwidth
    ctx = StageContext(2, 8, 1)
    allreduce = 2 * 1 / 2 * 5_000_000 * 2.0 / 1e11  # bf16 over 2 ranks: 0.1 ms, well under the ends' backward
    zero0 = LayerStrategy(dp=2)
    assert cm.end_cost(zero0, ctx, True, False).step_extra == pytest.approx(allreduce)  # all of it, exposed
    # taken as one of 4 layers of 10 MB, it fills a 25 MiB bucket beside backward (slowed 1.5x: 0.5 x its share
    # of the all-reduce) and the 13.8 MB rest after it
    full = GRAD_BUCKET_BYTES / (4 * 5_000_000 * 2.0)
    assert cm.end_cost(zero0, ctx, False, True).step_extra == pytest.approx((0.5 * full + (1 - full)) * allreduce)
    # ZeRO-2: the reduce-scatter (half an all-reduce's volume) exposed once per step; the all-gather runs before
    # the forward, overlapped with it at slowdown 1.5 (FSDP2 gathers in every micro-batch's forward)
    half = allreduce / 2
    z2, z0 = cm.end_cost(LayerStrategy(dp=2, zero=2), ctx, True, False), cm.end_cost(zero0, ctx, True, False)
    assert z2.step_extra == pytest.approx(half)
    assert z2.fwd - z0.fwd == pytest.approx(0.5 * half) and z2.bwd == pytest.approx(z0.bwd)


def test_native_prefetched_gathers_overlap_compute_on_an_inline_backend() -> None:
    """gloo runs collectives inline, but the native runtime issues FSDP2's prefetched all-gathers asynchronously
    (``_overlap_all_gathers``: unit i+1's during unit i's forward, unit i-1's during unit i's backward), so a
    block's gathers run beside its neighbour's compute at the profiled slowdown, like the bucketed all-reduces;
    the first unit of each direction has nothing before it: each of the 4 layers pays 1/4 of its gathers in
    full. Reduce-scatters stay inline; under a pipeline (each unit its own FSDP2 root: no prefetch) nothing
    changes, and on an async backend the whole collective overlaps as before."""
    inline = HardwareProfile.from_dict({**hardware(bw=1e8, slowdown=1.5).to_dict(), "async_collectives": False})
    cm = GalvatronCostModel(profile(), inline, runtime="native")
    fwd, bwd, comm = 4 * MS, 8 * MS, 10 * MS  # 1 / 2 ms per sample, b = 4; bf16 1 M params over 2 ranks: 10 ms
    first, tail = comm / 4, comm / 4  # the unhidden gather share; the last unit's reduce-scatter share
    one = StageContext(2, 8, 1)
    z3 = cm.layer_cost(0, LayerStrategy(dp=2, zero=3), one)
    assert z3.fwd == pytest.approx(overlapped(fwd, comm - first, 1.5) + first)
    assert z3.bwd == pytest.approx(overlapped(bwd, comm - first, 1.5) + first + comm - tail)
    z2 = cm.layer_cost(0, LayerStrategy(dp=2, zero=2), one)
    assert z2.fwd == pytest.approx(z3.fwd) and z2.bwd == pytest.approx(bwd + comm - tail)  # no gather in backward
    for s in (LayerStrategy(dp=2, zero=3), LayerStrategy(dp=2, zero=2)):  # a pipeline stage: inline as before
        piped = cm.layer_cost(0, s, StageContext(2, 8, 4, pp=2))
        assert piped.fwd == pytest.approx(fwd + comm)
    z3_galvatron = GalvatronCostModel(profile(), inline).layer_cost(0, LayerStrategy(dp=2, zero=3), one)
    assert z3_galvatron.fwd == pytest.approx(fwd + comm)  # Galvatron's runtime: no such prefetch
    asynchronous = GalvatronCostModel(profile(), hardware(bw=1e8, slowdown=1.5), runtime="native")
    assert asynchronous.layer_cost(0, LayerStrategy(dp=2, zero=3), one).fwd == pytest.approx(overlapped(fwd, comm, 1.5))
    # a measured all-gather overlap prices the prefetched gathers (the all-reduces keep theirs); unmeasured (0),
    # the all-reduce's stands in -- the case above
    gathers = GalvatronCostModel(profile(), replace(inline, gather_overlap_slowdown=1.1), runtime="native")
    g3 = gathers.layer_cost(0, LayerStrategy(dp=2, zero=3), one)
    assert g3.fwd == pytest.approx(overlapped(fwd, comm - first, 1.1) + first)
    assert g3.bwd == pytest.approx(overlapped(bwd, comm - first, 1.1) + first + comm - tail)
    assert g3.fwd < z3.fwd and inline.gather_slowdown == 1.5
    dp = gathers.layer_cost(0, LayerStrategy(dp=2), one)
    assert dp.step_extra == pytest.approx(cm.layer_cost(0, LayerStrategy(dp=2), one).step_extra)


def test_phases_move_what_backward_hooks_run_into_forward_backward_without_changing_the_step() -> None:
    """A plan's phase split as a profiler of the running step sees it: fwd+bwd of all micro-batches plus the
    per-step work the runtime's backward hooks do (bucket copies, FSDP2's last reduce-scatters), then the rest.
    The step time is the same sum either way (nothing is priced twice or dropped)."""
    hw = HardwareProfile.from_dict({**hardware(bw=1e9).to_dict(), "memory_bandwidth": 1e10})
    cm = GalvatronCostModel(profile(), hw, runtime="native")
    dp = ParallelPlan.uniform(2, 4, LayerStrategy(dp=2), global_batch=8)
    cost = cm.evaluate(dp)
    fb, after = cost.phases(0, 1)
    copies = 4 * 4 * (1_000_000 * 2.0) / 1e10 / 2  # 4 layers, half of the 4 x grads traffic (ends: no parameters)
    assert cost.stage_in_backward_s == pytest.approx((copies,))
    assert fb == pytest.approx(cost.stage_mb_time_s[0] + copies) and after == pytest.approx(cost.stage_extra_s[0] - copies)
    assert fb + after == pytest.approx(cost.step_time_s)
    piped = cm.evaluate(ParallelPlan.uniform(2, 4, LayerStrategy(), pp=2, micro_batches=2, global_batch=8))
    assert piped.stage_in_backward_s == (0.0, 0.0)
    assert piped.phases(1, 2) == pytest.approx((2 * piped.stage_mb_time_s[1], piped.stage_extra_s[1]))


def test_stage_sync_time_charges_whole_bucket_latencies_of_groups_no_block_shares() -> None:
    """GradientSync runs one collective per bucket of each data group. Each part pays a share of the latencies as
    if its group held the stage's blocks; ends over 4 ranks beside tp4 blocks (whose gradients sync over no
    one) are a 1 MB group of their own and still run one whole all-reduce: the stage adds the latency the ends
    did not pay. A uniform data-parallel plan, whose ends ride in the blocks' bucket, adds nothing. Groups' last
    all-reduces run side by side after backward, so the step waits for the longest, not their sum: blocks over
    2 ranks, whose one bucket the parts paid in full, hide the ends' missing latency; two groups both short of a
    whole latency cost one latency, less what their parts paid. The textbook runtime has no buckets."""
    lat = 1e-3
    hw = HardwareProfile.uniform(1, 8, 1e12, intra_bw=1e30, inter_bw=1e30, latency_s=lat, memory_bandwidth=0.0)
    prof = profile().with_(embed_params=250_000, head_params=250_000)  # bf16: 0.5 MB each, 2 MB per block
    cm = GalvatronCostModel(prof, hw, runtime="native")
    dp4, tp4, tp2dp2 = LayerStrategy(dp=4), LayerStrategy(tp=4), LayerStrategy(tp=2, dp=2)
    ends_paid = 2 * 500_000 / GRAD_BUCKET_BYTES  # each end: its bytes' share of a bucket's latency

    def plan(*layers: LayerStrategy) -> ParallelPlan:
        return ParallelPlan(world_size=4, layers=layers, embed=dp4, head=dp4, global_batch=8)

    ctx = StageContext(4, 8, 1)
    assert cm.stage_sync_time(plan(tp4, tp4, tp4, tp4), 0, ctx) == pytest.approx(lat * (1 - ends_paid))
    no_sync = GalvatronCostModel(prof, hw, runtime="native")
    no_sync.stage_sync_time = lambda *a: 0.0  # type: ignore[method-assign]
    assert cm.evaluate(plan(tp4, tp4, tp4, tp4)).step_time_s - no_sync.evaluate(plan(tp4, tp4, tp4, tp4)).step_time_s \
        == pytest.approx(lat * (1 - ends_paid))
    assert cm.stage_sync_time(plan(dp4, dp4, dp4, dp4), 0, ctx) == 0.0  # one group: the blocks paid its latency
    assert cm.stage_sync_time(plan(tp2dp2, tp2dp2, tp2dp2, tp2dp2), 0, ctx) == 0.0  # the blocks' tail hides the ends'
    # layer 3 alone over its 2-rank group (paid a quarter of its latency), the ends over 4 ranks (paid ends_paid)
    assert cm.stage_sync_time(plan(tp4, tp4, tp4, tp2dp2), 0, ctx) == pytest.approx(lat * (1 - 0.25 - ends_paid))
    assert GalvatronCostModel(prof, hw).stage_sync_time(plan(tp4, tp4, tp4, tp4), 0, ctx) == 0.0


def test_a_plans_only_zero3_unit_pays_its_own_root_and_inline_gathers() -> None:
    """``lone_unit_time``: a ZeRO-2/3 block priced as one of a shared-root model (gathers prefetched but for 1/layers,
    the chained units' overhead) costs, as the plan's only such unit, its gathers inline and the overhead measured
    on one unit alone -- once per plan, at the chunk's edges (``breakdown["transitions"]``). Golden numbers: gathers
    beside compute at slowdown 1.5 save (2 - 1.5) of the 3/4 hidden, in each direction."""
    from dataclasses import replace

    from lightning_galv.planner.cost import overlapped, zero3_gather_time

    lt = profile().layer(0)
    over = {"zero3": {"forward": TimeFit(2 * MS), "backward": TimeFit(3 * MS),
                      "forward_alone": TimeFit(5 * MS), "backward_alone": TimeFit(7 * MS)}}
    prof = profile().with_(layer_types=(replace(lt, zero_overhead=over),))
    hw = replace(hardware(bw=1e9), async_collectives=False, gather_overlap_slowdown=1.5)
    cm = GalvatronCostModel(prof, hw, runtime="native")
    dp, z3 = LayerStrategy(dp=2), LayerStrategy(dp=2, zero=3)

    def plan(layers: list[LayerStrategy], **kw: object) -> ParallelPlan:
        return ParallelPlan(2, tuple(layers), embed=kw.pop("embed", dp), head=kw.pop("head", dp), global_batch=8,
                            **kw)  # type: ignore[arg-type]

    one = plan([dp, dp, z3, dp])
    ctx = StageContext(2, 8, 1)
    g = zero3_gather_time(hw, lt.params * 2.0, 2, 1)  # bf16 parameters over 2 ranks
    c = 4 * MS  # 4 samples per rank, 1 ms each (the forward; backward 8 ms)
    assert 0.75 * g < c  # the hidden gathers fit beside the compute: overlapped() is linear there
    hidden = (overlapped(c, 0.75 * g, 1.5) - c) + (overlapped(2 * c, 0.75 * g, 1.5) - 2 * c)
    want = (5 - 2) * MS + (7 - 3) * MS + 2 * 0.75 * g - hidden
    assert cm.lone_unit_time(one, ctx) == pytest.approx(want)
    assert cm.evaluate(one).breakdown["transitions"] == pytest.approx(want)  # no re-layout in this plan
    # two units share a root; a ZeRO-3 end shares one with the block; a pipeline keeps a root per unit (its
    # schedule's timing as before); the textbook runtime has no FSDP2
    assert cm.lone_unit_time(plan([dp, z3, z3, dp]), ctx) == 0.0
    assert cm.lone_unit_time(plan([dp, dp, z3, dp], head=z3), ctx) == 0.0
    piped = ParallelPlan(4, (dp, dp, z3, dp), embed=dp, head=dp, global_batch=8, pp=2, micro_batches=2)
    assert cm.lone_unit_time(piped, StageContext(2, 4, 2, pp=2)) == 0.0
    assert GalvatronCostModel(prof, hw).lone_unit_time(one, ctx) == 0.0
    # a profile without the lone unit measured still prices its gathers inline
    bare = GalvatronCostModel(profile().with_(layer_types=(replace(lt, zero_overhead={
        "zero3": {"forward": TimeFit(2 * MS), "backward": TimeFit(3 * MS)}}),)), hw, runtime="native")
    assert bare.lone_unit_time(one, ctx) == pytest.approx(2 * 0.75 * g - hidden)
