"""The Optuna tuner (issue 14): real trials on 2 CPU ranks, faults recorded, pruning, resume, calibration."""

from __future__ import annotations

import optuna
import pytest

from lightning_galv.plan import LayerStrategy as L
from lightning_galv.plan import ParallelPlan
from lightning_galv.testing import leftover_ranks
from lightning_galv.tuning import neighbours, tune

MOD, DATA = "tune_factories:tiny_module", "tune_factories:tiny_data"


def _plan(s: L) -> ParallelPlan:
    return ParallelPlan.uniform(2, 2, s, global_batch=8)


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    here = str(Path(__file__).parent)
    monkeypatch.syspath_prepend(here)  # the trial ranks have it on PYTHONPATH (conftest's session environment)


@pytest.mark.slow
@pytest.mark.distributed
def test_faults_pruning_and_constraints_are_recorded_and_the_study_goes_on(tmp_path) -> None:
    # trial_timeout: the hanging trial waits it out; the others (the profile launch too, at conftest's 4-round
    # profile budget) take 2-10 s each on a 2-core VM
    plans = [_plan(L(dp=2)), _plan(L(dp=2, zero=1)), _plan(L(dp=2, checkpoint=True)), _plan(L(dp=2, zero=3)),
             _plan(L(tp=2)), _plan(L(tp=2, sp="ulysses"))]
    res = tune(MOD, DATA, devices=2, n_trials=6, storage=f"sqlite:///{tmp_path}/s.db", study_name="faults",
               candidates=plans, warmup_steps=1, steps=3, trial_timeout=25, extra_callbacks=("tune_factories:faults",),
               memory_budget="8GB", best_plan_path=tmp_path / "best.yaml", verbose=False)
    states = {t["number"]: (t["state"], t["reason"]) for t in res.trials}
    study = optuna.load_study(study_name="faults", storage=f"sqlite:///{tmp_path}/s.db")
    assert [s for s, _ in states.values()] == ["COMPLETE", "COMPLETE", "PRUNED", "FAIL", "COMPLETE", "FAIL"], \
        "\n".join(f"trial {t.number} {t.state.name} {t.user_attrs.get('fail_reason')}\n{t.user_attrs.get('log_tail', '')}"
                  for t in optuna.load_study(study_name="faults", storage=f"sqlite:///{tmp_path}/s.db").trials)
    assert "crash" in states[3][1] and "injected crash" in states[3][1]
    assert states[4][1] == "out of memory"  # completed, constraint violated: never the best
    assert "timeout" in states[5][1]
    study = optuna.load_study(study_name="faults", storage=f"sqlite:///{tmp_path}/s.db")
    assert "injected crash" in study.trials[3].user_attrs["log_tail"]
    assert study.trials[4].user_attrs["constraint"][0] > 0
    assert res.best_plan is not None and res.best_plan.layers[0].zero in (0, 1)
    assert ParallelPlan.load(tmp_path / "best.yaml") == res.best_plan.with_(prediction=None) or \
        ParallelPlan.load(tmp_path / "best.yaml").layers == res.best_plan.layers
    assert leftover_ranks() == 0


@pytest.mark.distributed
def test_a_rank_killed_by_a_signal_before_its_first_step_is_relaunched_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GALV_TEST_ABORT_MARKER", str(tmp_path / "aborted"))
    res = tune(MOD, DATA, devices=2, n_trials=1, storage=f"sqlite:///{tmp_path}/a.db", study_name="abort",
               candidates=[_plan(L(dp=2))], warmup_steps=1, steps=2, trial_timeout=75,
               extra_callbacks=("tune_factories:abort_once",), memory_budget="8GB", verbose=False)
    assert (tmp_path / "aborted").exists()  # the fault did fire
    t = optuna.load_study(study_name="abort", storage=f"sqlite:///{tmp_path}/a.db").trials[0]
    assert t.state.name == "COMPLETE" and res.trials[0]["state"] == "COMPLETE"
    assert "killed by SIGABRT" in t.user_attrs["relaunched_0"]


@pytest.mark.slow
@pytest.mark.distributed
def test_analytic_order_resume_and_calibration(tmp_path) -> None:
    url = f"sqlite:///{tmp_path}/r.db"
    first = tune(MOD, DATA, devices=2, n_trials=2, storage=url, study_name="resume", top_k=3, warmup_steps=1,
                 steps=2, memory_budget="8GB", verbose=False, heartbeat_s=1)
    study = optuna.load_study(study_name="resume", storage=url)
    analytic = [ParallelPlan.from_dict(d) for d in study.user_attrs["analytic"]]
    ran = [ParallelPlan.from_dict(study.user_attrs[f"plan:{t.params['plan_id']}"]) for t in study.trials]
    assert [p.layers for p in ran] == [p.layers for p in analytic[:2]]  # enqueued in the planner's order
    # a tuner killed mid-trial leaves a RUNNING trial behind: fake one with a heartbeat, let it go stale
    import time

    from lightning_galv.tuning.tuner import _register

    pid = _register(study, analytic[2])  # a plan no trial has run yet (a killed tuner's current one)
    study.enqueue_trial({"plan_id": pid})
    stale = study.ask()
    stale.suggest_int("plan_id", 0, 1_000_000)
    study._storage.record_heartbeat(stale._trial_id)
    time.sleep(3)
    second = tune(MOD, DATA, devices=2, n_trials=5, storage=url, study_name="resume", top_k=3, warmup_steps=1,
                  steps=2, memory_budget="8GB", verbose=False, heartbeat_s=1)
    study = optuna.load_study(study_name="resume", storage=url)
    states = [t.state.name for t in study.trials]
    assert states[:2] == ["COMPLETE", "COMPLETE"] and states[2] == "FAIL", states  # kept; the stale one failed
    retried = [t for t in study.trials if t.system_attrs.get("failed_trial") == 2]
    assert len(retried) == 1 and retried[0].state.name in ("COMPLETE", "PRUNED")  # retried once, and it ran
    assert "duplicate_of" not in retried[0].user_attrs and retried[0].params["plan_id"] == pid
    ids = [t.params["plan_id"] for t in study.trials if t.state.name == "COMPLETE"]
    assert len(ids) - len(set(ids)) <= 1  # only the retry repeats a plan
    assert len(second.trials) >= 5 and first.best_plan is not None
    # feedback: the calibrated cost model predicts the measured plans better than the raw one
    from lightning_galv.planner import GalvatronCostModel, HardwareProfile, ModelProfile
    from lightning_galv.tuning.tuner import _calibrate, _registry

    model = ModelProfile.from_json(study.user_attrs["model_profile"])
    hw = HardwareProfile.from_json(study.user_attrs["hardware_profile"])
    cal = _calibrate(study, model, hw)
    m2, h2 = cal.apply(model, hw)
    reg = _registry(study)
    done = [t for t in study.trials if t.state.name == "COMPLETE" and "measured_step_s" in t.user_attrs]

    def err(m, h) -> float:  # what the fit minimizes: squared relative error over the measured plans
        return sum((GalvatronCostModel(m, h, runtime="native").evaluate(
            ParallelPlan.from_dict(reg[t.params["plan_id"]])).step_time_s / t.user_attrs["measured_step_s"] - 1) ** 2
            for t in done)

    assert err(m2, h2) < err(model, hw)


def test_neighbours_change_one_dimension_and_stay_valid() -> None:
    from lightning_galv.plan import ModelShape

    shape = ModelShape(2, 32, 4, 2, 64, 64, 16)
    base = _plan(L(dp=2))
    nbs = neighbours(base, shape)
    assert base not in nbs and len(nbs) == len(set(nbs)) >= 5
    assert any(n.layers[0].tp == 2 for n in nbs) and any(n.layers[0].zero == 3 for n in nbs)
    assert any(n.layers[0].checkpoint for n in nbs) and any(n.head.tp == 2 for n in nbs)
    for n in nbs:
        n.check_model(shape)


def test_galv_tune_refuses_a_config_without_the_factories(tmp_path) -> None:
    from lightning_galv.cli import main

    cfg = tmp_path / "tune.yaml"
    cfg.write_text("devices: 2\n")
    with pytest.raises(SystemExit, match=r"module_factory, data_factory and devices.*HINT"):
        main(["tune", "--config", str(cfg)])


# ---------------------------------------------------------------------------------------------------
# batch-size search (largest_batch)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("curve", ["linear", "convex", "noisy"])
def test_batch_search_brackets_the_boundary_by_measurement(curve: str) -> None:
    """From any start and with any slope hint, the k returned fit, k + 1 was measured not to, and the number
    of probes stays logarithmic in how far the start was off."""
    import math
    import random

    from lightning_galv.tuning.batch import search_units

    rng = random.Random(1)
    for trial in range(200):
        base, per = rng.uniform(100, 400), rng.uniform(0.5, 8)
        limit = rng.choice([1, 7, 64, 5000])
        budget = base + per * rng.uniform(-2, limit * 1.2)
        start = rng.randint(1, limit)
        slope = rng.choice([None, per, per / 3, per * 5])

        def peak(k: int) -> float:
            p = base + per * k
            if curve == "convex":
                p += 0.002 * per * k * k
            if curve == "noisy":  # monotone still: noise smaller than one unit's growth
                p += (hash((k, trial)) % 100) / 100 * per * 0.9
            return p

        k, capped, peaks = search_units(peak, budget, start, limit, slope)
        if k is None:
            assert peaks[1] > budget and not capped
            continue
        assert peaks[k] <= budget
        if capped:
            assert k == limit
        else:
            assert peaks[k + 1] > budget, (k, peaks)
        truth = max((j for j in range(1, limit + 1) if peak(j) <= budget), default=None)
        assert k == truth
        assert len(peaks) <= 6 + 3 * math.ceil(math.log2(abs(start - k) + 2)), (start, k, list(peaks))


def test_batch_search_with_an_accurate_start_takes_two_probes() -> None:
    from lightning_galv.tuning.batch import search_units

    probes: list[int] = []

    def peak(k: int) -> float:
        probes.append(k)
        return 300.0 + 5.0 * k

    assert search_units(peak, 352.0, start=10, limit=100)[0] == 10
    assert probes == [10, 11]


def test_predicted_largest_batch_is_the_cost_models_boundary() -> None:
    from lightning_galv.plan import ModelShape
    from lightning_galv.planner import GalvatronCostModel, HardwareProfile, ModelProfile
    from lightning_galv.tuning.batch import predicted_largest_batch

    model = ModelProfile.from_shape(ModelShape(4, 256, 8, 8, 1024, 1000, 512), framework_bytes=2**28)
    hw = HardwareProfile.uniform(1, 4, 8 * 2**30)
    cost = GalvatronCostModel(model, hw, runtime="native")
    plan = ParallelPlan.uniform(4, 4, L(tp=2, dp=2), pp=1)
    peak = lambda gb: cost.evaluate(plan.with_(global_batch=gb)).peak_memory_bytes  # noqa: E731
    budget = (peak(40) + peak(42)) / 2
    assert predicted_largest_batch(cost, plan, budget, 10_000) == 40
    assert predicted_largest_batch(cost, plan, budget, 20) == 20  # capped
    assert predicted_largest_batch(cost, plan, peak(2) - 1, 10_000) is None


def test_largest_batch_refuses_bad_input_with_a_hint(tmp_path) -> None:
    from lightning_galv.tuning import largest_batch

    plan = _plan(L(dp=2))
    for kwargs, exc, pattern in [
        ({"devices": 4}, ValueError, r"devices=4.*world_size=2.*HINT"),
        ({"devices": 2, "start": 3}, ValueError, r"start=3.*batch unit 2.*HINT"),
        ({"devices": 2, "max_global_batch": 1}, ValueError, r"max_global_batch=1.*HINT"),
        ({"devices": 2, "steps": 0}, ValueError, r"steps=0.*HINT"),
        ({"devices": True}, TypeError, r"devices=True.*HINT"),
        ({"devices": 2, "memory_budget": "lots"}, ValueError, r"memory_budget='lots'.*HINT"),
        ({"devices": 2, "trial_timeout": 0}, ValueError, r"trial_timeout=0.*HINT"),
    ]:
        with pytest.raises(exc, match=pattern):
            largest_batch(MOD, DATA, plan, **kwargs)
    with pytest.raises(TypeError, match=r"plan=dict.*HINT"):
        largest_batch(MOD, DATA, plan.to_dict(), devices=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"factory.*HINT"):
        largest_batch("no_colon", DATA, plan, devices=2)


def test_make_data_resizes_the_users_loader() -> None:
    from torch.utils.data import DataLoader

    from lightning_galv.tuning.trial import make_data

    rebuilt = make_data(DATA, 16)  # a plain DataLoader, rebuilt around the same dataset
    assert isinstance(rebuilt, DataLoader) and rebuilt.batch_size == 16 and len(rebuilt.dataset) == 64
    assert next(iter(rebuilt)).shape == (16, 17)
    assert make_data("tune_factories:wide_data", 5).batch_size == 5  # a factory with batch_size=
    assert make_data(DATA, None).batch_size == 4  # untouched
    with pytest.raises(TypeError, match=r"batch size cannot be set.*HINT"):
        make_data("tune_factories:tiny_module", 4)


def test_galv_tune_batch_size_refuses_a_missing_plan_and_unknown_keys(tmp_path) -> None:
    from lightning_galv.cli import main

    cfg = tmp_path / "tune.yaml"
    cfg.write_text(f"module_factory: {MOD}\ndata_factory: {DATA}\ndevices: 2\nn_trials: 3\n")
    with pytest.raises(SystemExit, match=r"--batch-size: which plan\?.*HINT"):
        main(["tune", "--config", str(cfg), "--batch-size"])
    with pytest.raises(SystemExit, match=r"--plan is only read with --batch-size.*HINT"):
        main(["tune", "--config", str(cfg), "--plan", "p.yaml"])
    cfg.write_text(f"module_factory: {MOD}\ndata_factory: {DATA}\ndevices: 2\nbogus: 1\n")
    _plan(L(dp=2)).save(tmp_path / "p.yaml")
    with pytest.raises(SystemExit, match=r"unknown config keys \['bogus'\].*HINT"):
        main(["tune", "--config", str(cfg), "--batch-size", "--plan", str(tmp_path / "p.yaml")])


@pytest.mark.slow
@pytest.mark.distributed
def test_largest_batch_fits_and_one_unit_more_does_not(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """2 CPU ranks, a model whose memory is mostly per-sample logits. The budget is set between two measured
    peaks (1 and 16 samples per shard), so the boundary lies inside the range searched; the search must
    start from the cost model's prediction, return a batch its own trials measured to fit with one unit
    more measured not to, and log how many trials that took."""
    from lightning_galv.testing import run_distributed
    from lightning_galv.tuning import largest_batch

    mod, data = "tune_factories:wide_module", "tune_factories:wide_data"
    plan = _plan(L(dp=2)).with_(global_batch=None)

    def peak(shard: int) -> float:
        out = run_distributed("lightning_galv.tuning.trial:run_trial", 2,
                              (plan.to_dict(), mod, data, 1, 1, None, (), shard), init_process_group=False,
                              timeout=120)[0]
        assert out["min_shard_batch"] == shard
        return out["peak_bytes"]

    low, high = peak(1), peak(16)
    assert high > low + 32 * 2**20, (low, high)  # ~4 MiB per sample: far above the RSS noise
    budget = (low + high) / 2
    res = largest_batch(mod, data, plan, devices=2, memory_budget=budget, max_global_batch=64, trial_timeout=120)
    by_batch = {t.global_batch: t for t in res.trials}
    assert res.predicted_global_batch is not None and res.trials[0].global_batch == res.predicted_global_batch
    assert not res.capped and 2 < res.global_batch < 32, res.table()
    assert by_batch[res.global_batch].fits and by_batch[res.global_batch].peak_bytes <= budget
    above = by_batch[res.global_batch + plan.batch_unit]
    assert not above.fits and above.peak_bytes > budget, res.table()
    assert res.plan.global_batch == res.global_batch and res.shard_batch == res.global_batch // 2
    assert res.micro_batch == res.global_batch and res.n_trials == len(res.trials) <= 8
    assert f"after {res.n_trials} trials" in capsys.readouterr().out
    assert leftover_ranks() == 0


def test_neighbours_of_an_moe_plan_change_the_expert_parallel_degree_of_the_moe_layers_only() -> None:
    """ep is a neighbour dimension for MoE models: all MoE layers move to one new ep (dividing both their data
    group and their experts), dense layers keep ep=1, everything else is untouched; the cost model prices
    every neighbour (so none is a plan the runtime would refuse); a tp change keeps ep where it still fits."""
    from dataclasses import replace

    from lightning_galv.plan import ModelShape
    from lightning_galv.planner import GalvatronCostModel, HardwareProfile, ModelProfile
    from lightning_galv.planner.profiles import MoELayerFacts

    shape = ModelShape(4, 64, 4, 4, 128, 256, 32)
    model = ModelProfile.from_shape(shape, moe=MoELayerFacts.swiglu(64, num_experts=4, top_k=2, expert_hidden=64),
                                    moe_layers=(1, 3))
    cost = GalvatronCostModel(model, HardwareProfile.uniform(1, 8, 80 * 2**30), runtime="native")
    base = ParallelPlan.uniform(8, 4, L(dp=8), global_batch=16)
    nbs = neighbours(base, model)
    eps = sorted({n.layers[1].ep for n in nbs if n.layers[1].ep > 1})
    assert eps == [2, 4]  # 8 does not divide the 4 experts
    for n in nbs:
        assert n.layers[0].ep == n.layers[2].ep == 1
        cost.evaluate(n)
    ep_moves = [n for n in nbs if n.layers[1].ep > 1]
    assert all(n.layers[1] == n.layers[3] == replace(base.layers[1], ep=n.layers[1].ep) for n in ep_moves)
    assert all(n.layers[0] == base.layers[0] and (n.embed, n.head) == (base.embed, base.head) for n in ep_moves)
    assert not [n for n in neighbours(base, shape) if any(s.ep > 1 for s in n.layers)]  # a shape knows no experts
    ep4 = base.with_(layers=tuple(replace(s, ep=4) if i in (1, 3) else s for i, s in enumerate(base.layers)))
    back = {n.layers[1].ep for n in neighbours(ep4, model)}
    assert {1, 2, 4} <= back  # back down, sideways; ep4 stays where tp2 x dp4 still allows it
    tp2 = [n for n in neighbours(ep4, model) if n.layers[1].tp == 2 and n.layers[1].sp == "none"]
    assert tp2 and tp2[0].layers[1].ep == 4 and tp2[0].layers[0].ep == 1
    tp4 = [n for n in neighbours(ep4, model) if n.layers[1].tp == 4 and n.layers[1].sp == "none"]
    assert tp4 and all(n.layers[1].ep == 1 for n in tp4)  # dp=2 cannot hold ep=4: reset


@pytest.mark.slow
@pytest.mark.distributed
def test_largest_batch_counts_out_of_memory_as_not_fitting_and_raises_on_a_crash() -> None:
    """An out-of-memory error (injected at 4 samples per shard) is "does not fit"; a crash (at 8) is an error."""
    from lightning_galv.tuning import largest_batch

    plan = _plan(L(dp=2))
    res = largest_batch(MOD, "tune_factories:faulty_data", plan, devices=2, memory_budget="64GB", start=6,
                        max_global_batch=64, trial_timeout=120, verbose=False)
    assert res.global_batch == 6 and res.shard_batch == 3 and res.predicted_global_batch is None
    assert [(t.global_batch, t.fits) for t in res.trials] == [(6, True), (8, False)]
    assert res.trials[1].peak_bytes == float("inf")
    with pytest.raises(RuntimeError, match=r"global batch 16 \(8 per shard\) crashed.*not 'does not fit'"
                                           r"(.|\n)*injected crash at batch 8"):
        largest_batch(MOD, "tune_factories:faulty_data", plan, devices=2, memory_budget="64GB", start=16,
                      max_global_batch=64, trial_timeout=120, verbose=False)


def test_the_dataset_bounds_the_batch_search() -> None:
    """64 samples on 2 shards fill 2 steps of at most 16 per shard: the search never asks for more."""
    from lightning_galv.tuning.batch import data_cap

    assert data_cap(DATA, _plan(L(dp=2)), steps=2) == 32
    assert data_cap(DATA, _plan(L(dp=2)), steps=3) == 20  # 32 // 3 = 10 per shard
    assert data_cap(DATA, ParallelPlan.uniform(2, 2, L(tp=2), global_batch=2), steps=4) == 16  # one shard: 64 // 4


def test_journal_storage_gets_heartbeats_stale_trials_fail_and_retry_once_and_duplicates_are_caught(tmp_path) -> None:
    """Journal files have no Optuna heartbeat: the tuner's own one marks a killed worker's trial stale."""
    import time

    from optuna.storages.journal import JournalFileBackend, JournalStorage
    from optuna.trial import TrialState

    from lightning_galv.tuning.tuner import (MAX_PLANS, PLAN_PARAM, _beat, _claim, _earlier_trial_of, _register,
                                             _scheduled, fail_stale_trials)

    def open_study() -> optuna.Study:  # every call: one more worker on the same file
        return optuna.create_study(storage=JournalStorage(JournalFileBackend(str(tmp_path / "j.log"))),
                                   study_name="j", direction="maximize", load_if_exists=True)

    study, other = open_study(), open_study()
    a, b = _plan(L(dp=2)), _plan(L(tp=2))
    pa, pb = _register(study, a), _register(study, b)
    assert pa != pb and _register(study, a) == pa and _register(other, a) == pa  # content ids: workers agree
    study.enqueue_trial({PLAN_PARAM: pa})
    dead = study.ask()
    assert dead.suggest_int(PLAN_PARAM, 0, MAX_PLANS) == pa
    _beat(study._storage, dead._trial_id)  # ... and then its tuner was killed
    study.enqueue_trial({PLAN_PARAM: pb})
    alive = other.ask()
    other_pid = alive.suggest_int(PLAN_PARAM, 0, MAX_PLANS)
    time.sleep(1.5)
    _beat(other._storage, alive._trial_id)  # the other worker is still running its trial
    assert fail_stale_trials(open_study(), grace_s=1.0) == [dead.number]
    trials = study.get_trials()
    assert trials[dead.number].state == TrialState.FAIL and "stale" in trials[dead.number].user_attrs["fail_reason"]
    assert trials[alive.number].state == TrialState.RUNNING and other_pid == pb
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert len(retries) == 1 and retries[0].state == TrialState.WAITING and retries[0].params[PLAN_PARAM] == pa
    retry = study.ask()  # the retry runs: only a failed trial had its plan before
    assert retry.number == retries[0].number and retry.suggest_int(PLAN_PARAM, 0, MAX_PLANS) == pa
    assert _earlier_trial_of(study, retry, pa) is None
    time.sleep(1.5)
    _beat(other._storage, alive._trial_id)
    assert fail_stale_trials(study, grace_s=1.0) == [retry.number]  # the retry went stale too: not retried again
    assert not any(t.system_attrs.get("failed_trial") == retry.number for t in study.get_trials())
    # two workers enqueued the same plan at once: the later trial knows it is a duplicate
    study.enqueue_trial({PLAN_PARAM: pb})
    dup = study.ask()
    assert _earlier_trial_of(study, dup, dup.suggest_int(PLAN_PARAM, 0, MAX_PLANS)) == alive.number
    # the queue was emptied by another worker: ask() opens a fresh trial, which the tuner gives the next plan
    fresh = study.ask()
    assert PLAN_PARAM not in fresh._fixed_params
    pc = _register(study, _plan(L(dp=2, zero=1)))
    _claim(study, fresh, pc, {"plan": "dp2 zero1"})
    assert fresh.suggest_int(PLAN_PARAM, 0, MAX_PLANS) == pc and pc in _scheduled(study)
    assert _earlier_trial_of(study, fresh, pc) is None


@pytest.mark.slow
@pytest.mark.distributed
def test_two_workers_share_a_journal_study_and_measure_each_plan_once(tmp_path) -> None:
    import os
    import subprocess
    import sys

    from lightning_galv.tuning.tuner import PLAN_PARAM

    url = f"journal:{tmp_path}/mw.log"
    # both workers start asking for trials together (each waits, imports done, for the other's ready file): one
    # that imported faster could otherwise take every plan before the other asked (it did, at e4793ff)
    code = ("import os, sys, time\n"
            "from lightning_galv.plan import LayerStrategy as L, ParallelPlan\n"
            "from lightning_galv.tuning import tune\n"
            f"open(os.path.join({str(tmp_path)!r}, 'ready' + sys.argv[1]), 'w').close()\n"
            "t0 = time.monotonic()\n"
            f"while len([f for f in os.listdir({str(tmp_path)!r}) if f.startswith('ready')]) < 2:\n"
            "    if time.monotonic() - t0 > 300:\n"
            "        raise SystemExit('the other worker never got ready (300 s)')\n"
            "    time.sleep(0.05)\n"
            "c = [ParallelPlan.uniform(2, 2, s, global_batch=8) for s in "
            "(L(dp=2), L(tp=2), L(dp=2, zero=1), L(dp=2, zero=2))]\n"
            f"tune({MOD!r}, {DATA!r}, devices=2, n_trials=4, storage={url!r}, study_name='mw', candidates=c, "
            "warmup_steps=1, steps=2, memory_budget='8GB', verbose=False, trial_timeout=240)\n")
    logs = [open(tmp_path / f"worker{i}.log", "w") for i in range(2)]
    workers = [subprocess.Popen([sys.executable, "-c", code, str(i)], stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ))
               for i, f in enumerate(logs)]
    try:
        codes = [w.wait(timeout=900) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    tails = "\n".join((tmp_path / f"worker{i}.log").read_text()[-3000:] for i in range(2))
    assert codes == [0, 0], tails
    study = optuna.load_study(study_name="mw", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(f"{tmp_path}/mw.log")))
    trials = study.get_trials()
    assert all(t.state.is_finished() for t in trials), [t.state for t in trials]
    ran = [t for t in trials if "duplicate_of" not in t.user_attrs]
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in ran), [(t.state, t.user_attrs) for t in ran]
    ids = [t.params[PLAN_PARAM] for t in ran]
    assert len(ids) == len(set(ids)) and len(ids) >= 3, ids  # each plan measured once, by one worker or the other
    assert len({t.user_attrs["worker"] for t in ran}) == 2, tails  # both workers measured plans


def test_the_progress_bar_counts_the_studys_finished_trials_and_shows_the_best(capsys: pytest.CaptureFixture[str]) -> None:
    from optuna.distributions import IntDistribution
    from optuna.trial import TrialState, create_trial

    from lightning_galv.tuning.tuner import PLAN_PARAM, _Progress

    study = optuna.create_study(direction="maximize")
    dist = {PLAN_PARAM: IntDistribution(0, 10)}
    study.add_trial(create_trial(value=3.0, params={PLAN_PARAM: 1}, distributions=dist))  # an earlier session's
    bar = _Progress(True, study, 4)
    assert bar._bar is not None and bar._bar.n == 1
    study.add_trial(create_trial(value=5.0, params={PLAN_PARAM: 2}, distributions=dist))
    study.add_trial(create_trial(state=TrialState.FAIL, params={PLAN_PARAM: 3}, distributions=dist))
    bar.update(study, 4)
    assert bar._bar.n == 3 and "best 5.00 samples/s" in str(bar._bar)
    bar.close()
    assert "galv tune" in capsys.readouterr().err
    assert _Progress(False, study, 4)._bar is None  # verbose=False: silent
