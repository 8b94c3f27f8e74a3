"""Profiles: fits recover known parameters, JSON round trips, fingerprints, on-disk cache, errors."""

from __future__ import annotations

import pytest

from lightning_galv.plan import ModelShape
from lightning_galv.planner.profiles import (HardwareProfile, LayerTypeProfile, LinkFit, ModelProfile, ProfileCache,
                                             TimeFit, act_key, cache_dir, fingerprint, link_key)

SHAPE = ModelShape(num_layers=4, hidden=256, num_heads=8, num_kv_heads=8, ffn_hidden=1024, vocab_size=1000, seq_len=128)


def test_linkfit_recovers_alpha_beta() -> None:
    pts = [(n, 5e-6 + n / 2e10) for n in (1e5, 1e6, 1e7, 1e8)]
    fit = LinkFit.fit(pts)
    assert fit.latency_s == pytest.approx(5e-6, rel=1e-6)
    assert fit.bandwidth == pytest.approx(2e10, rel=1e-9)


def test_timefit_recovers_affine_and_quadratic_terms() -> None:
    truth = TimeFit(const=1e-4, per_token=2e-7, per_token_ctx=3e-10)
    samples = [(b, s, truth(b, s)) for b in (1, 2, 4) for s in (64, 128, 256)]
    fit = TimeFit.fit(samples)
    assert fit.const == pytest.approx(1e-4, rel=1e-6)
    assert fit.per_token == pytest.approx(2e-7, rel=1e-6)
    assert fit.per_token_ctx == pytest.approx(3e-10, rel=1e-6)


def test_timefit_reads_the_measured_batches_off_its_points() -> None:
    """Per-sample time on CPU depends on the batch (caches), so a line through the measured batches misses them;
    at the sequence length it was measured at, a fit returns each measured time exactly, interpolates between
    two, and continues the nearest segment past the ends (never sloping down); elsewhere the line serves."""
    meas = {1: 4.59e-3, 2: 5.44e-3, 4: 7.76e-3, 8: 12.82e-3}  # an MoE block on one CPU rank, seq 64
    fit = TimeFit.fit([(b, 64, t) for b, t in meas.items()] + [(4, 32, 6.0e-3)])
    for b, t in meas.items():
        assert fit(b, 64) == pytest.approx(t)
    assert abs(fit.line(8, 64) / meas[8] - 1) > 0.005  # the line alone misses a measured batch
    assert fit(3, 64) == pytest.approx((meas[2] + meas[4]) / 2)
    assert fit(16, 64) == pytest.approx(meas[8] + 8 * (meas[8] - meas[4]) / 4)  # the last segment's slope
    assert fit(4, 32) == fit.line(4, 32)  # another sequence length: the line
    assert fit.times(2.0)(4, 64) == pytest.approx(2 * meas[4])
    assert fit.scaled(2.0)(4, 64) == pytest.approx(fit.const + 2 * (meas[4] - fit.const))
    falling = TimeFit.fit([(1, 8, 2.0), (2, 8, 1.0)])  # noise: a segment sloping down is kept inside, flat past it
    assert falling(2, 8) == 1.0 and falling(4, 8) == 1.0
    with pytest.raises(ValueError, match="HINT"):
        TimeFit(points=((64.0, 1.0),), points_seq=64.0)
    with pytest.raises(ValueError, match="HINT"):
        TimeFit(points=((64.0, 1.0), (64.0, 2.0)), points_seq=64.0)


def test_profiles_with_points_round_trip_and_without_them_serialize_as_before() -> None:
    pts = TimeFit.fit([(1, 128, 1e-3), (2, 128, 1.5e-3), (4, 128, 3.5e-3)])
    lt = LayerTypeProfile("block", pts, pts.times(2.0), 1000, {act_key(1, "none", False): 1.0}, 256,
                          sharded={"tp2/none": {"forward": pts, "backward": pts}})
    prof = ModelProfile("m", SHAPE, (lt,), (0,) * 4, head_forward=pts)
    again = ModelProfile.from_json(prof.to_json())
    assert again == prof and again.layer_types[0].sharded["tp2/none"]["forward"](4, 128) == pytest.approx(3.5e-3)
    plain = ModelProfile.from_shape(SHAPE)
    assert "points" not in plain.to_json()  # no measured points: the document is what it always was


def test_timefit_single_batch_is_per_sample_only() -> None:
    fit = TimeFit.fit([(4, 128, 0.004)])
    assert fit.const == 0.0 and fit.per_token == pytest.approx(0.004 / 512)


def test_collective_time_golden() -> None:
    hw = HardwareProfile.uniform(2, 8, 40 * 2**30, intra_bw=100e9, inter_bw=10e9, latency_s=1e-5)
    # ring all-reduce: 2 (g-1)/g * n / bw + latency
    assert hw.collective_time("allreduce", 1e9, 8, 1) == pytest.approx(1e-5 + 2 * 7 / 8 * 1e9 / 100e9)
    # 8 ranks 2 apart span 16 devices: inter-node
    assert hw.collective_time("allgather", 1e9, 8, 2) == pytest.approx(2e-5 + 7 / 8 * 1e9 / 10e9)
    assert hw.collective_time("allreduce", 1e9, 1, 1) == 0.0


def test_hardware_json_round_trip_and_fingerprint() -> None:
    hw = HardwareProfile.uniform(1, 4, 16 * 2**30)
    again = HardwareProfile.from_json(hw.to_json())
    assert again == hw
    assert again.fingerprint() == hw.fingerprint()
    other = HardwareProfile.uniform(1, 4, 32 * 2**30)
    assert other.fingerprint() != hw.fingerprint()


def test_model_json_round_trip() -> None:
    prof = ModelProfile.from_shape(SHAPE)
    again = ModelProfile.from_json(prof.to_json())
    assert again == prof
    assert fingerprint(again.to_dict()) == fingerprint(prof.to_dict())


def test_activation_fallbacks_follow_korthikanti() -> None:
    lt = LayerTypeProfile("b", TimeFit(), TimeFit(), 10, {act_key(1, "none", False): 34.0}, 8)
    assert lt.activation(2, "none", False) == pytest.approx(34.0 * (10 + 12) / 34)
    assert lt.activation(4, "megatron", False) == pytest.approx(34.0 / 4)
    assert lt.activation(1, "none", True) == pytest.approx(2.0)


def test_cache_uses_env_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GALV_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    cache = ProfileCache()
    prof = ModelProfile.from_shape(SHAPE)
    key = fingerprint({"model": SHAPE.to_dict()})
    assert cache.load("model", key) is None
    path = cache.save("model", key, prof)
    assert path.parent == tmp_path / "c"
    assert cache.load("model", key) == prof


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"kind": "ModelProfile", "bogus": 1}'])
def test_corrupt_cache_file_error_names_the_file_and_folder(tmp_path, text: str) -> None:
    cache = ProfileCache(tmp_path / "cache")
    key = fingerprint({"model": SHAPE.to_dict()})
    path = cache.save("model", key, ModelProfile.from_shape(SHAPE))
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        cache.load("model", key)
    msg = str(err.value)
    assert str(path) in msg and str(tmp_path / "cache") in msg and "HINT: delete this file" in msg, msg
    assert msg.count("HINT:") == 1, msg  # the parser's own HINT once made it two


def test_corrupt_calibration_file_error_names_it(tmp_path) -> None:
    from lightning_galv.planner.calibration import Calibration, calibration_path

    path = calibration_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{truncated")
    with pytest.raises(ValueError, match="HINT: delete it") as err:
        Calibration.load(path)
    assert str(path) in str(err.value) and str(path.parent) in str(err.value)


@pytest.mark.parametrize("make", [
    lambda: LinkFit(0.0),
    lambda: HardwareProfile(1, 0, 1.0, {link_key("allreduce", 2, True, True): LinkFit(1e9)}),
    lambda: HardwareProfile(1, 8, 1.0, {"allreduce/2/sideways/intra": LinkFit(1e9)}),
    lambda: HardwareProfile(1, 8, 1.0, {link_key("allreduce", 2, True, True): LinkFit(1e9)}, overlap_slowdown=0.5),
    lambda: ModelProfile.from_shape(SHAPE, precision="int3"),
    lambda: ModelProfile.from_json("{not json"),
])
def test_bad_input_names_value_and_hint(make) -> None:
    with pytest.raises(ValueError, match="HINT:"):
        make()


def test_link_fit_minimizes_relative_error() -> None:
    """Exact alpha-beta points are recovered; one slow large message does not wipe out the latency."""
    from lightning_galv.planner.profiles import LinkFit

    exact = [(x, 50e-6 + x / 2e9) for x in (1e4, 1e6, 1.6e7)]
    fit = LinkFit.fit(exact)
    assert fit.latency_s == pytest.approx(50e-6, rel=1e-6) and fit.bandwidth == pytest.approx(2e9, rel=1e-6)
    skewed = exact[:2] + [(1.6e7, 1.5 * exact[2][1])]  # the 16 MB point 50 % slow (cache spill, noise)
    rel = LinkFit.fit(skewed)
    assert rel.time(1e4) == pytest.approx(exact[0][1], rel=0.25)  # small messages still priced near right


def test_layer_profile_round_trips_measured_sharding() -> None:
    from lightning_galv.planner.profiles import LayerTypeProfile, TimeFit, transient_key

    lt = LayerTypeProfile("block", TimeFit(1e-3, 1e-6), TimeFit(2e-3, 2e-6), 10, {"tp1/none": 5.0,
                          transient_key(2, "megatron"): 7.0}, 4,
                          sharded={"tp2/megatron": {"forward": TimeFit(1e-3), "backward": TimeFit(3e-3)}},
                          zero_overhead={"zero3": {"forward": TimeFit(1e-4), "backward": TimeFit(2e-4)}},
                          optimizer_overhead={"tp": 1e-3, "zero": 2e-3})
    prof = ModelProfile("p", SHAPE, (lt,), (0,) * SHAPE.num_layers)
    back = ModelProfile.from_json(prof.to_json())
    assert back == prof
    assert back.layer(0).sharded_fit("backward", 2, "megatron") == TimeFit(3e-3)
    assert back.layer(0).recompute_peak(2, "megatron") == 7.0
    with pytest.raises(ValueError, match="HINT"):
        LayerTypeProfile("b", TimeFit(), TimeFit(), 1, {"tp1/none": 1.0}, 4, zero_overhead={"zero9": {}})
    two = {"forward": TimeFit(1e-4), "backward": TimeFit(2e-4)}
    for bad in ("zero3/ep1", "zero3/ep2/edp1", "zero1/ep2", "zero3/ep2/", "zero3/edp2"):
        with pytest.raises(ValueError, match="zero_key.*HINT"):
            LayerTypeProfile("b", TimeFit(), TimeFit(), 1, {"tp1/none": 1.0}, 4, zero_overhead={bad: two})
    # expert-parallel keys only on an MoE layer type
    with pytest.raises(ValueError, match="MoE layer type.*HINT"):
        LayerTypeProfile("b", TimeFit(), TimeFit(), 1, {"tp1/none": 1.0}, 4, zero_overhead={"zero3/ep2": two})
    for bad in ({"ep": 1e-3}, {"tp": -1.0}, {"zero": float("nan")}):
        with pytest.raises(ValueError, match="optimizer_overhead.*HINT"):
            LayerTypeProfile("b", TimeFit(), TimeFit(), 1, {"tp1/none": 1.0}, 4, optimizer_overhead=bad)
    # a profile without the measurement serializes as before it existed
    plain = LayerTypeProfile("b", TimeFit(), TimeFit(), 1, {"tp1/none": 1.0}, 4)
    assert "optimizer_overhead" not in ModelProfile("p", SHAPE, (plain,), (0,) * SHAPE.num_layers).to_dict()["layer_types"][0]


def test_attention_time_factor_golden() -> None:
    """FLOPs per token: 2 per active weight + 4 s h for attention, half of it under a causal mask (Narayanan et
    al. SC'21). Golden: h = 256, 786432 weights (the accuracy benchmark's LLaMA block), 128 -> 256 tokens."""
    from lightning_galv.planner.profiles import attention_time_factor

    linear, attn = 2 * 786432, 2 * 256  # per token; attention per token of span (causal)
    assert attention_time_factor(256, 786432, 128, 256) == pytest.approx((linear + attn * 256) / (linear + attn * 128))
    assert attention_time_factor(256, 786432, 128, 256) == pytest.approx(1.04, abs=0.001)
    assert attention_time_factor(256, 786432, 128, 128) == 1.0
    assert attention_time_factor(256, 786432, 128, 64, causal=False) == pytest.approx(
        (linear + 1024 * 64) / (linear + 1024 * 128))


def _measured_layer(moe: bool = False) -> LayerTypeProfile:
    from lightning_galv.planner.profiles import MoELayerFacts, transient_key, zero_key

    pts = lambda ys: TimeFit(1e-4, 1e-6, 0.0, ((256.0, ys[0]), (512.0, ys[1])), 128.0)  # noqa: E731
    return LayerTypeProfile(
        "block", pts((2e-3, 3e-3)), pts((4e-3, 6e-3)), 786432,
        {"tp1/none": 2.0e6, act_key(1, "none", True): 1.3e5, transient_key(2, "megatron"): 3.0e6,
         act_key(2, "megatron", False): 1.1e6}, 256,
        sharded={"tp2/megatron": {"forward": pts((5e-3, 7e-3)), "backward": pts((8e-3, 1e-2))}},
        zero_overhead={zero_key(3): {"forward": pts((1e-3, 1e-3)), "backward": pts((2e-3, 2e-3))}},
        moe=MoELayerFacts(num_experts=8, top_k=2, expert_params=65536, dim=256) if moe else None)


def test_with_seq_len_keeps_token_counts_scales_activations_and_prices_the_attention_span() -> None:
    """A profile carried from 128 to 256 tokens: a measured point is read at the same token count (2 samples at
    128 = 1 sample at 256), block passes grow by the attention factor, FSDP2's overhead and the ends do not,
    activations per sample double; the communication volumes follow from the shape's new sequence length."""
    from lightning_galv.planner.cost import GalvatronCostModel
    from lightning_galv.planner.profiles import attention_time_factor
    from lightning_galv.plan import LayerStrategy, ParallelPlan

    head = TimeFit(0.0, 1e-6, 0.0, ((128.0, 1e-3), (512.0, 3e-3)), 128.0)
    prof = ModelProfile("p", SHAPE, (_measured_layer(),), (0,) * SHAPE.num_layers, precision="fp32",
                        embed_act_bytes=4.0 * 128 * 256, head_act_bytes=9e5, head_forward=head, head_backward=head)
    long = prof.with_seq_len(256)
    lt, lt2 = prof.layer(0), long.layer(0)
    f = attention_time_factor(256, 786432, 128, 256)
    assert long.seq_len == 256 and long.shape.num_layers == SHAPE.num_layers
    assert lt2.forward(1, 256) == pytest.approx(lt.forward(2, 128) * f)  # 256 tokens either way
    assert lt2.backward(2, 256) == pytest.approx(lt.backward(4, 128) * f)
    assert lt2.sharded_fit("backward", 2, "megatron")(2, 256) == pytest.approx(
        lt.sharded_fit("backward", 2, "megatron")(4, 128) * f)
    assert lt2.zero_overhead["zero3"]["forward"](1, 256) == pytest.approx(lt.zero_overhead["zero3"]["forward"](2, 128))
    assert long.head_forward(1, 256) == pytest.approx(prof.head_forward(2, 128))  # per token, no attention
    assert {k: v / 2 for k, v in lt2.activation_bytes.items()} == pytest.approx(dict(lt.activation_bytes))
    assert (long.embed_act_bytes, long.head_act_bytes) == (2 * prof.embed_act_bytes, 2 * prof.head_act_bytes)
    # round trip, and the identity at the profiled length
    assert ModelProfile.from_json(long.to_json()) == long
    assert prof.with_seq_len(128) is prof
    # the cost model sees it: activations and the tp collectives double with the span
    plan = ParallelPlan.uniform(2, SHAPE.num_layers, LayerStrategy(tp=2, sp="megatron"), global_batch=4)
    hw = HardwareProfile.uniform(1, 2, 80e9)
    a, b = GalvatronCostModel(prof, hw).evaluate(plan), GalvatronCostModel(long, hw).evaluate(plan)
    assert b.step_time_s > a.step_time_s and b.peak_memory_bytes > a.peak_memory_bytes


def test_measured_span_share_carries_a_profile_to_other_sequence_lengths() -> None:
    """With the attention span's measured share of the per-token time (``span_share``, ShardedLayerProfiler's
    attention probe), a block carried from 128 to 256 tokens takes 1 + share more per token, to 64 tokens
    1 - share / 2 (a tp variant by its own share of the unsharded span seconds); FSDP2's overhead and the ends by
    token count as before. Golden: share 0.1 -> x1.1 and x0.95 where FLOPs say x1.04 / x0.98. A profile
    without the measurement serializes as before it existed; a share outside [0, 1) is refused."""
    from dataclasses import replace

    from lightning_galv.planner.profiles import attention_time_factor

    lt = replace(_measured_layer(), span_share=0.1)
    assert lt.span_factor(128, 256) == pytest.approx(1.1) and lt.span_factor(128, 64) == pytest.approx(0.95)
    assert lt.span_factor(128, 128) == 1.0
    assert _measured_layer().span_factor(128, 256) == attention_time_factor(256, 786432, 128, 256)
    prof = ModelProfile("p", SHAPE, (lt,), (0,) * SHAPE.num_layers, precision="fp32")
    long, short = prof.with_seq_len(256).layer(0), prof.with_seq_len(64).layer(0)
    assert long.forward(1, 256) == pytest.approx(lt.forward(2, 128) * 1.1)
    # a tp2 variant: the unsharded pass's span seconds over 2 against its own pass at its largest batch (4 samples;
    # no tp1/none variant here, so the unsharded fits): 0.1 * (3e-3 + 6e-3) / (2 * (7e-3 + 1e-2)) = 0.02647
    g = 1 + 0.1 * 9e-3 / (2 * 1.7e-2)
    assert lt.variant_span_factor("tp2/megatron", 128, 256) == pytest.approx(g)
    assert long.sharded_fit("backward", 2, "megatron")(2, 256) == pytest.approx(
        lt.sharded_fit("backward", 2, "megatron")(4, 128) * g)
    assert lt.variant_span_factor("tp1/none", 128, 256) == pytest.approx(1.1)  # unsharded: the share itself
    flops = _measured_layer()  # no measured share: every sharding by the FLOP factor alike
    assert flops.variant_span_factor("tp2/megatron", 128, 256) == flops.span_factor(128, 256)
    assert short.backward(4, 64) == pytest.approx(lt.backward(2, 128) * 0.95)
    assert long.zero_overhead["zero3"]["forward"](1, 256) == pytest.approx(lt.zero_overhead["zero3"]["forward"](2, 128))
    assert long.span_share == 0.1  # a share of the time at the profiled length: carried on unchanged
    assert ModelProfile.from_json(prof.to_json()).layer(0).span_share == 0.1
    assert "span_share" not in ModelProfile("p", SHAPE, (_measured_layer(),), (0,) * SHAPE.num_layers).to_dict()[
        "layer_types"][0]
    for bad in (1.0, -0.1, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match=r"span_share=.*\[0, 1\).*HINT"):
            replace(lt, span_share=bad)


def test_at_width_carries_the_span_share_with_the_attention_work() -> None:
    """The span's work per token grows with the width alone (4 h s FLOPs), the block's by its fits: its share of
    the per-token time is carried as ``share * r * before / after``. Golden, without a matmul rate (every fit by
    the FLOP ratio f): share 0.1 to twice the width -> 0.1 * 2 / f."""
    from dataclasses import replace

    from lightning_galv.planner.profiles import block_flops_per_token

    lt = replace(_measured_layer(), span_share=0.1)
    wide = lt.at_width(512, 4 * 786432, 128)
    f = block_flops_per_token(512, 4 * 786432, 128) / block_flops_per_token(256, 786432, 128)
    assert wide.span_share == pytest.approx(0.1 * 2 / f)
    assert _measured_layer().at_width(512, 4 * 786432, 128).span_share == 0.0


def test_with_seq_len_counts_only_the_experts_a_token_visits() -> None:
    """An MoE block's linear FLOPs per token are its dense weights plus top_k of its E experts."""
    from lightning_galv.planner.profiles import attention_time_factor

    lt = _measured_layer(moe=True)
    assert lt.active_params == 786432 - 6 * 65536
    prof = ModelProfile("p", SHAPE, (lt,), (0,) * SHAPE.num_layers, precision="fp32")
    f = attention_time_factor(256, 786432 - 6 * 65536, 128, 64)
    assert prof.with_seq_len(64).layer(0).forward(4, 64) == pytest.approx(lt.forward(2, 128) * f)
    assert f < attention_time_factor(256, 786432, 128, 64)  # fewer active weights: attention weighs more


@pytest.mark.parametrize("bad", [0, -4, 12.5, "256", True])
def test_with_seq_len_refuses_bad_lengths(bad: object) -> None:
    with pytest.raises(ValueError, match=r"seq_len=.*positive int.*HINT"):
        ModelProfile.from_shape(SHAPE).with_seq_len(bad)  # type: ignore[arg-type]


def test_with_seq_len_refuses_galvatron_end_tables() -> None:
    """Galvatron's end tables are measured per sequence length; no first-order rule is applied to them."""
    from lightning_galv.planner.profiles import EndsProfile

    ends = EndsProfile(model_states={"pp_off": {1: 1e6}}, activation={"pp_off": {1: 1e5}})
    with pytest.raises(ValueError, match="Galvatron.*HINT"):
        ModelProfile.from_shape(SHAPE).with_(ends=ends).with_seq_len(256)


WIDE = ModelShape(num_layers=4, hidden=384, num_heads=12, num_kv_heads=12, ffn_hidden=1536, vocab_size=1000,
                  seq_len=128)


def test_with_width_prices_the_flops_keeps_the_launch_overhead_and_scales_memory() -> None:
    """A profile of a 256-wide block carried to 384 (FFN 4x in both): per-token work times the forward FLOP
    ratio (2 per weight + causal attention), the measured per-call overhead (``const``) kept; FSDP2's overhead
    with the parameters, its constant too (its copies are per byte, not per token); activations and the embedding with the width; the head's logits stay; the new
    parameter counts. Golden numbers worked by hand from the fits of ``_measured_layer``."""
    from lightning_galv.planner.cost import GalvatronCostModel
    from lightning_galv.plan import LayerStrategy, ParallelPlan

    head = TimeFit(0.0, 1e-6, 0.0, ((128.0, 1e-3), (512.0, 3e-3)), 128.0)
    prof = ModelProfile("p", SHAPE, (_measured_layer(),), (0,) * SHAPE.num_layers, precision="fp32",
                        embed_params=256000, head_params=256256, embed_act_bytes=4.0 * 128 * 256,
                        head_act_bytes=9e5, head_forward=head, head_backward=head)
    wide = prof.with_width(WIDE, 1769472)  # 2.25x the weights
    lt, lt2 = prof.layer(0), wide.layer(0)
    f = (2 * 1769472 + 2 * 384 * 128) / (2 * 786432 + 2 * 256 * 128)  # forward FLOPs per token, causal
    assert f == pytest.approx(2.22, abs=1e-4)  # 3637248 / 1638400
    # the point at 256 tokens: 1e-4 s of launch overhead stays, the other 1.9e-3 s grows by f
    assert lt2.forward(2, 128) == pytest.approx(1e-4 + 1.9e-3 * f)
    assert lt2.sharded_fit("backward", 2, "megatron")(4, 128) == pytest.approx(1e-4 + (1e-2 - 1e-4) * f)
    assert lt2.zero_overhead["zero3"]["forward"](2, 128) == pytest.approx(1e-3 * 2.25)  # its constant too
    assert {k: v / 1.5 for k, v in lt2.activation_bytes.items()} == pytest.approx(dict(lt.activation_bytes))
    assert (lt2.params, lt2.hidden, wide.embed_params, wide.head_params) == (1769472, 384, 384000, 384384)
    # the head: three h-wide tensors (3 x 4 B x 128 x 256 = 393216 B of its 9e5 B) grow, the logits' rest stays
    assert wide.embed_act_bytes == 1.5 * prof.embed_act_bytes
    assert wide.head_act_bytes == pytest.approx(9e5 + 393216 * 0.5)
    assert wide.head_forward(4, 128) == pytest.approx(1.5 * prof.head_forward(4, 128))
    assert ModelProfile.from_json(wide.to_json()) == wide
    assert prof.with_width(SHAPE, 786432) is prof
    assert prof.with_width(WIDE, 1769472, embed_params=1, head_params=2).embed_params == 1
    # at the profiled width too: new end counts are taken (not dropped by the no-change shortcut), bad ones refused
    assert prof.with_width(SHAPE, 786432, embed_params=7).embed_params == 7
    with pytest.raises(ValueError, match=r"head_params=-1.*int >= 0.*HINT"):
        prof.with_width(SHAPE, 786432, head_params=-1)
    # the cost model sees it: more to compute, to hold and to send
    plan = ParallelPlan.uniform(2, SHAPE.num_layers, LayerStrategy(tp=2, sp="megatron"), global_batch=4)
    hw = HardwareProfile.uniform(1, 2, 80e9)
    a, b = GalvatronCostModel(prof, hw).evaluate(plan), GalvatronCostModel(wide, hw).evaluate(plan)
    assert b.step_time_s > a.step_time_s and b.peak_memory_bytes > a.peak_memory_bytes


def test_with_width_and_a_matmul_rate_scales_the_matmuls_by_the_weights_and_the_rest_by_the_width() -> None:
    """With the profile's matmul rate, a block's per-token work splits into the weights' matmuls (2 FLOPs per
    weight and token forward, 4 backward, over the tp ranks) -- times the weight ratio (2.25) -- and the rest --
    times the width ratio (1.5); the launch overhead stays. Golden numbers by hand from ``_measured_layer``'s
    fits, the rate chosen so that 256 tokens' forward matmuls take 1.2 ms. Negative control: the FLOP-ratio rule
    without a rate prices the same point 12 % higher (2.22 x of all the work, not 2.25 x / 1.5 x of its parts)."""
    rate = 2 * 786432 * 256 / 1.2e-3
    prof = ModelProfile("p", SHAPE, (_measured_layer(),), (0,) * SHAPE.num_layers, precision="fp32",
                        matmul_flops=rate)
    wide = prof.with_width(WIDE, 1769472)
    lt2 = wide.layer(0)
    # forward at 256 tokens: 2 ms = 0.1 overhead + 1.2 matmuls + 0.7 rest
    assert lt2.forward(2, 128) == pytest.approx(1e-4 + 1.2e-3 * 2.25 + 0.7e-3 * 1.5)
    # backward at 512 tokens: 6 ms = 0.1 + 4.8 (4 FLOPs per weight and token) + 1.1
    assert lt2.backward(4, 128) == pytest.approx(1e-4 + 4.8e-3 * 2.25 + 1.1e-3 * 1.5)
    # tp2: half the matmuls per rank; 10 ms = 0.1 + 2.4 + 7.5
    assert lt2.sharded_fit("backward", 2, "megatron")(4, 128) == pytest.approx(1e-4 + 2.4e-3 * 2.25 + 7.5e-3 * 1.5)
    assert lt2.zero_overhead == prof.with_(matmul_flops=0.0).with_width(WIDE, 1769472).layer(0).zero_overhead
    assert wide.matmul_flops == rate and ModelProfile.from_json(wide.to_json()) == wide
    flop_rule = prof.with_(matmul_flops=0.0).with_width(WIDE, 1769472).layer(0).forward(2, 128)
    assert flop_rule == pytest.approx(1e-4 + 1.9e-3 * 3637248 / 1638400)  # 4.32 ms against the split's 3.85
    assert lt2.forward(2, 128) < 0.9 * flop_rule
    # narrowing: the part that is not matmuls shrinks with the width only, so the split prices more than FLOPs
    narrow_shape = ModelShape(num_layers=4, hidden=128, num_heads=4, num_kv_heads=4, ffn_hidden=512,
                              vocab_size=1000, seq_len=128)
    narrow = prof.with_width(narrow_shape, 196608).layer(0)  # a quarter of the weights
    assert narrow.forward(2, 128) == pytest.approx(1e-4 + 1.2e-3 * 0.25 + 0.7e-3 * 0.5)
    assert narrow.forward(2, 128) > prof.with_(matmul_flops=0.0).with_width(narrow_shape, 196608).layer(0).forward(2, 128)
    # a rate so slow that the matmuls would take longer than the work measured: all of it is matmuls
    slow = prof.with_(matmul_flops=rate / 10).with_width(WIDE, 1769472).layer(0)
    assert slow.forward(2, 128) == pytest.approx(1e-4 + 1.9e-3 * 2.25)
    # serialized without the key when not measured (older profiles read and fingerprint as before)
    assert "matmul_flops" not in prof.with_(matmul_flops=0.0).to_dict() and prof.to_dict()["matmul_flops"] == rate


def test_a_hardware_profile_keeps_an_all_gather_overlap_apart_and_serializes_as_before_without_one() -> None:
    hw = HardwareProfile.uniform(1, 2, 80e9, overlap_slowdown=1.6)
    assert hw.gather_overlap_slowdown == 0.0 and hw.gather_slowdown == 1.6
    assert "gather_overlap_slowdown" not in hw.to_dict()  # older profiles read and fingerprint as before
    measured = HardwareProfile.from_dict({**hw.to_dict(), "gather_overlap_slowdown": 1.1})
    assert measured.gather_slowdown == 1.1 and measured.overlap_slowdown == 1.6
    assert HardwareProfile.from_json(measured.to_json()) == measured and measured.fingerprint() != hw.fingerprint()
    for bad in (0.5, -1.0, float("nan"), float("inf"), True, "1.2"):
        with pytest.raises(ValueError, match=r"gather_overlap_slowdown=.*0 \(not measured.*>= 1.*HINT"):
            HardwareProfile.from_dict({**hw.to_dict(), "gather_overlap_slowdown": bad})


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "1e11"])
def test_a_model_profile_refuses_a_bad_matmul_rate(bad: object) -> None:
    with pytest.raises(ValueError, match=r"matmul_flops=.*finite number >= 0.*HINT"):
        ModelProfile.from_shape(SHAPE).with_(matmul_flops=bad)


@pytest.mark.parametrize("change, match", [
    (dict(num_layers=6), "num_layers=6.*width only.*HINT"),
    (dict(seq_len=256), "seq_len=256.*with_seq_len"),
    (dict(vocab_size=2000), "vocab_size=2000"),
    (dict(ffn_hidden=768), r"ffn_hidden / hidden = 768/384.*10 %.*HINT"),
])
def test_with_width_changes_the_width_only(change: dict, match: str) -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match=match):
        ModelProfile.from_shape(SHAPE).with_width(replace(WIDE, **change), 1769472)


@pytest.mark.parametrize("params", [0, -1, 2.5, True, (1, 2)])
def test_with_width_refuses_bad_parameter_counts(params: object) -> None:
    with pytest.raises(ValueError, match=r"params=.*positive int per layer type.*HINT"):
        ModelProfile.from_shape(SHAPE).with_width(WIDE, params)  # type: ignore[arg-type]


def test_with_width_refuses_moe_blocks_and_galvatron_end_tables() -> None:
    from lightning_galv.planner.profiles import EndsProfile

    moe = ModelProfile("p", SHAPE, (_measured_layer(moe=True),), (0,) * SHAPE.num_layers)
    with pytest.raises(ValueError, match="MoE block.*HINT"):
        moe.with_width(WIDE, 1769472)
    ends = EndsProfile(model_states={"pp_off": {1: 1e6}}, activation={"pp_off": {1: 1e5}})
    with pytest.raises(ValueError, match="Galvatron.*HINT"):
        ModelProfile.from_shape(SHAPE).with_(ends=ends).with_width(WIDE, 1769472)
    with pytest.raises(ValueError, match="must be a ModelShape"):
        ModelProfile.from_shape(SHAPE).with_width({"hidden": 384}, 1)  # type: ignore[arg-type]


def test_scaling_a_fit_keeps_its_launch_overhead_and_never_turns_a_point_negative() -> None:
    """``TimeFit.scaled`` grows the per-token work only; a point measured below the line's overhead (a noisy
    short pass -- the width test's 32-token pass under load) counts as all overhead and keeps its time."""
    fit = TimeFit(1e-3, 1e-6, 0.0, ((32.0, 5e-4), (64.0, 2e-3)), 32.0).scaled(2.0)
    assert [t for t, _ in fit.points] == [32.0, 64.0] and [y for _, y in fit.points] == pytest.approx([5e-4, 3e-3])
    assert (fit.const, fit.per_token) == (1e-3, 2e-6)


def test_link_lookups_are_memoized_per_profile_and_follow_a_replaced_profile() -> None:
    """``HardwareProfile.link`` answers repeated lookups from a memo; the memo is the instance's own, so a profile
    made by ``dataclasses.replace`` with other links answers from those, and it takes no part in equality."""
    from dataclasses import replace

    slow, fast = LinkFit(bandwidth=1e9, latency_s=1e-5), LinkFit(bandwidth=8e9, latency_s=1e-5)
    hw = HardwareProfile(1, 8, 2**30, links={"allreduce/2/consec/intra": slow, "allreduce/8/consec/intra": fast})
    assert hw.link("allgather", 3, True, True) is slow  # the all-reduce's fit at the nearest size (log distance)
    assert hw.link("allgather", 3, True, True) is slow  # again, from the memo
    assert hw.link("allgather", 4, True, True) is fast  # a tie in log distance: the larger group's
    assert hw.link("allreduce", 8, False, True) is fast  # the other rank order when this one is not measured
    again = HardwareProfile(1, 8, 2**30, links=dict(hw.links))
    assert again == hw  # the memo is not part of the profile's value
    other = replace(hw, links={"allreduce/2/consec/intra": fast})
    assert other.link("allgather", 3, True, True) is fast and hw.link("allgather", 3, True, True) is slow
