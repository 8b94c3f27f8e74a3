"""Calibration (issue 13): fitted factors recover known ones; applying them corrects inputs, never the originals."""

from __future__ import annotations

import random

import pytest

from lightning_galv.plan import LayerStrategy as L
from lightning_galv.plan import ModelShape, ParallelPlan
from lightning_galv.planner import GalvatronCostModel, HardwareProfile, ModelProfile
from lightning_galv.planner.calibration import Calibration, LayerObservation, layer_observations

SHAPE = ModelShape(4, 1024, 16, 16, 4096, 32000, 512)


def test_fit_recovers_known_compute_and_collective_factors() -> None:
    rng = random.Random(0)
    truth = {"block": 1.3, "moe": 0.8}
    comm = 0.7
    obs = []
    for _ in range(40):
        t = rng.choice(sorted(truth))
        c, k = rng.uniform(0.01, 0.2), rng.uniform(0.0, 0.1)  # plans with different communication shares
        obs.append(LayerObservation(t, c, k, truth[t] * c + comm * k))
    cal = Calibration.fit(obs, memory=[(1e9, 1.1e9), (2e9, 2.1e9)])
    for t, f in truth.items():
        assert cal.compute_scale[t] == pytest.approx(f, rel=2e-2)
    assert cal.comm_scale == pytest.approx(comm, rel=5e-2)
    assert cal.memory_slack_bytes == pytest.approx(1e8)
    # one plan that cannot separate compute from communication: factors stay near the prior split
    flat = [LayerObservation("block", 0.1, 0.1, 0.3) for _ in range(10)]
    degenerate = Calibration.fit(flat)
    assert 0.1 * degenerate.compute_scale["block"] + 0.1 * degenerate.comm_scale == pytest.approx(0.3, rel=0.05)
    assert abs(degenerate.compute_scale["block"] - degenerate.comm_scale) < 0.05


def test_apply_corrects_predictions_and_leaves_the_profiles_alone() -> None:
    model, hw = ModelProfile.from_shape(SHAPE), HardwareProfile.uniform(1, 8, 80e9)
    plan = ParallelPlan.uniform(8, 4, L(tp=2, dp=4), global_batch=32)
    before = GalvatronCostModel(model, hw).evaluate(plan)
    cal = Calibration({model.layer(0).name: 2.0}, comm_scale=3.0, memory_slack_bytes=1e9)
    m2, h2 = cal.apply(model, hw)
    after = GalvatronCostModel(m2, h2).evaluate(plan)
    assert after.step_time_s > 1.5 * before.step_time_s
    assert after.peak_memory_bytes == pytest.approx(before.peak_memory_bytes + 1e9)
    assert GalvatronCostModel(model, hw).evaluate(plan) == before  # originals untouched
    assert m2.layer(0).forward.per_token == 2.0 * model.layer(0).forward.per_token


def test_observations_from_a_measured_step_and_round_trip(tmp_path) -> None:
    model, hw = ModelProfile.from_shape(SHAPE), HardwareProfile.uniform(1, 8, 80e9)
    plan = ParallelPlan(8, (L(dp=8), L(tp=2, dp=4), L(tp=4, dp=2, sp="megatron", checkpoint=True), L(dp=8)))
    obs = layer_observations(plan, model, hw, samples=16, layer_times={"layers.0": 0.5, "layers.2": 0.4})
    assert [o.measured_s for o in obs] == [0.5, 0.4]
    assert obs[0].comm_s == 0.0 and obs[1].comm_s > 0  # dp has no block collectives; tp+sp does
    # checkpointed: forward, backward and the recompute's share of them (all, unless the profiler counted
    # fewer; Megatron-SP's closing reduce-scatter is skipped by early stop: 3 of 4)
    from dataclasses import replace

    from lightning_galv.planner.cost import block_comm_time

    s = plan.layers[2]
    act_bytes = 16 / s.dp * SHAPE.seq_len * SHAPE.hidden * model.act_dtype_bytes
    once = block_comm_time(hw, SHAPE, s, act_bytes)
    assert obs[1].comm_s == pytest.approx(3 * once)
    counted = model.with_(layer_types=(replace(model.layer(0), recompute_comm={"tp4/megatron": 0.75}),))
    three_quarters = layer_observations(plan, counted, hw, samples=16, layer_times={"layers.2": 0.4})[0]
    assert three_quarters.comm_s == pytest.approx(2.75 * once)
    cal = Calibration.fit(obs)
    path = tmp_path / "calibration.json"
    cal.save(path)
    assert Calibration.load(path) == cal
    assert Calibration.load(tmp_path / "missing.json") is None
    with pytest.raises(ValueError, match=r"calibration keys.*HINT"):
        Calibration.from_json('{"compute": 1}')
    with pytest.raises(ValueError, match=r"comm_scale=0.*positive finite.*HINT"):
        Calibration(comm_scale=0.0)
    with pytest.raises(ValueError, match=r"no observations.*HINT"):
        Calibration.fit([])


def test_fit_plans_recovers_factors_from_whole_step_times() -> None:
    """Plans priced with known factors are 'measured'; fitting from their step times alone gets the factors back
    and the calibrated model reproduces every step time."""
    model, hw = ModelProfile.from_shape(SHAPE), HardwareProfile.uniform(1, 8, 80e9)
    truth = Calibration({model.layer(0).name: 1.4}, comm_scale=2.5, memory_slack_bytes=3e8)
    plans = [ParallelPlan.uniform(8, 4, s, global_batch=16) for s in
             (L(dp=8), L(tp=2, dp=4), L(tp=4, dp=2, sp="megatron"), L(tp=8), L(dp=8, zero=3), L(tp=2, dp=4, zero=1))]
    m_true, h_true = truth.apply(model, hw)
    measured = [(p, GalvatronCostModel(m_true, h_true).evaluate(p).step_time_s,
                 GalvatronCostModel(m_true, h_true).evaluate(p).peak_memory_bytes) for p in plans]
    cal = Calibration.fit_plans(GalvatronCostModel, model, hw, measured, ridge=1e-6)
    assert cal.compute_scale[model.layer(0).name] == pytest.approx(1.4, rel=2e-2)
    assert cal.comm_scale == pytest.approx(2.5, rel=2e-2)
    assert cal.memory_slack_bytes == pytest.approx(3e8, rel=1e-6)
    m2, h2 = cal.apply(model, hw)
    for p, t, _ in measured:
        assert GalvatronCostModel(m2, h2).evaluate(p).step_time_s == pytest.approx(t, rel=1e-2)


def test_per_sharding_factors_shrink_toward_their_layer_type() -> None:
    """A factor per measured sharding multiplies its layer type's factor. With a weak pull it recovers a real
    per-sharding slowdown; with a strong pull (``variant_ridge``) it stays at 1 and the type's factor takes the
    common part -- what keeps a sharding seen by one or two noisy plans from overfitting them."""
    from dataclasses import replace

    from lightning_galv.planner.profiles import TimeFit, time_key

    model, hw = ModelProfile.from_shape(SHAPE), HardwareProfile.uniform(1, 8, 80e9)
    lt = model.layer(0)
    half = {k: TimeFit(f.const / 2, f.per_token / 2, f.per_token_ctx / 2)
            for k, f in (("forward", lt.forward), ("backward", lt.backward))}
    lt = replace(lt, sharded={time_key(1, "none"): {"forward": lt.forward, "backward": lt.backward},
                              time_key(2, "none"): half})
    model = model.with_(layer_types=(lt,))
    variant = f"{lt.name}@{time_key(2, 'none')}"
    truth = Calibration({lt.name: 1.3, variant: 1.5})
    plans = [ParallelPlan.uniform(8, 4, s, global_batch=16) for s in
             (L(dp=8), L(dp=8, zero=1), L(dp=8, checkpoint=True), L(tp=2, dp=4), L(tp=2, dp=4, zero=1),
              L(tp=2, dp=4, checkpoint=True))]
    m_true, h_true = truth.apply(model, hw)
    measured = [(p, GalvatronCostModel(m_true, h_true).evaluate(p).step_time_s, None) for p in plans]
    tight = Calibration.fit_plans(GalvatronCostModel, model, hw, measured, ridge=1e-6, variant_ridge=1e-6)
    assert tight.compute_scale[lt.name] * tight.compute_scale[f"{lt.name}@{time_key(1, 'none')}"] == \
        pytest.approx(1.3, rel=2e-2)
    assert tight.compute_scale[lt.name] * tight.compute_scale[variant] == pytest.approx(1.3 * 1.5, rel=2e-2)
    loose = Calibration.fit_plans(GalvatronCostModel, model, hw, measured, ridge=1e-6, variant_ridge=1e6)
    assert all(loose.compute_scale[k] == pytest.approx(1.0, abs=1e-3) for k in loose.compute_scale if "@" in k)
    assert 1.3 < loose.compute_scale[lt.name] < 1.3 * 1.5  # the common part of both shardings


def test_a_calibration_fitted_against_another_cost_model_is_not_applied(tmp_path) -> None:
    """Its memory slack absorbed bytes the old model did not price (e.g. FSDP2's sharded-end buffers before
    COST_MODEL_VERSION 2): applied to a model that prices them now, it would count them twice. Such a file (or
    one from before the field) is left on disk, not applied, and a warning says why and what to do."""
    import json

    from lightning_galv.planner.cost import COST_MODEL_VERSION

    cal = Calibration({"block": 1.2}, comm_scale=1.5, memory_slack_bytes=3e8, observations=4)
    assert cal.model_version == COST_MODEL_VERSION
    path = tmp_path / "calibration.json"
    cal.save(path)
    assert Calibration.load(path) == cal
    legacy = {k: v for k, v in json.loads(path.read_text()).items() if k != "model_version"}
    path.write_text(json.dumps(legacy))
    assert Calibration.from_json(path.read_text()).model_version == 1
    with pytest.warns(UserWarning, match=r"version 1.*not applied.*HINT"):
        assert Calibration.load(path) is None
    assert path.is_file()  # kept: the next monitored run overwrites it
    with pytest.raises(ValueError, match=r"model_version=0.*HINT"):
        Calibration(model_version=0)
