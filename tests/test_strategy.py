"""Trainer end to end on 4 gloo ranks: parity through Lightning, resume, evaluation, precision, auto mode.

One launch runs every check (a launch costs ~20 s of start-up on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_galv.plan import LayerStrategy as L
from lightning_galv.plan import ParallelPlan
from lightning_galv.testing import run_distributed

CHECKS = str(Path(__file__).parent / "dist_lightning_checks.py") + "::run_many"
TOL = 1e-5

HETERO = ParallelPlan(
    4, embed=L(tp=2, dp=2),
    layers=(L(tp=4, sp="megatron"), L(tp=2, dp=2, checkpoint=True), L(dp=4, zero=3)),
    head=L(dp=4, zero=1)).to_dict()
TP_ZERO1 = ParallelPlan.uniform(4, 3, L(tp=2, dp=2, zero=1)).to_dict()
ULYSSES_ZERO2 = ParallelPlan.uniform(4, 3, L(tp=2, dp=2, sp="ulysses", zero=2)).to_dict()
PP2 = ParallelPlan(4, pp=2, micro_batches=2, pp_division=(2, 1), embed=L(dp=2),
                   layers=(L(tp=2), L(dp=2, zero=3), L(dp=2, zero=1)), head=L(dp=2)).to_dict()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    cases = [
        ("hetero_accum_clip", "fit_compare", dict(plan=HETERO, accumulate=2, clip=0.05)),
        ("tp_zero1", "fit_compare", dict(plan=TP_ZERO1)),
        ("auto", "fit_auto", {}),
        ("resume_sharded", "fit_resume", dict(plan=HETERO, tmpdir=tmp, full=False)),
        ("resume_full", "fit_resume", dict(plan=ULYSSES_ZERO2, tmpdir=tmp, full=True)),
        ("eval_reuse", "fit_then_eval", dict(plan=HETERO)),
        ("bf16_mixed", "fit_precision", dict(plan=HETERO, precision="bf16-mixed")),
        ("bf16_true", "fit_precision", dict(plan=TP_ZERO1, precision="bf16-true")),
        ("unseeded_init", "unseeded_init", dict(plan=HETERO)),
        ("pp2_accum_clip", "fit_compare", dict(plan=PP2, accumulate=2, clip=0.05)),
        ("pp2_resume", "fit_resume", dict(plan=PP2, tmpdir=tmp + "/pp", full=False)),
        ("pp2_eval_reuse", "fit_then_eval", dict(plan=PP2)),
        ("pp2_bf16_mixed", "fit_precision", dict(plan=PP2, precision="bf16-mixed")),
    ]
    env = {"GALV_CACHE_DIR": str(tmp_path_factory.mktemp("profiles"))}
    return run_distributed(CHECKS, 4, (cases,), init_process_group=False, timeout=1200, env=env)[0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["hetero_accum_clip", "tp_zero1", "pp2_accum_clip"])
def test_fit_parity(results: dict, name: str) -> None:
    r = results[name]
    assert r["keys_equal"]
    assert r["loss_err"] < TOL, r
    assert r["weight_err"] < TOL, r


@pytest.mark.slow
@pytest.mark.distributed
def test_auto_plan_trains_exactly(results: dict) -> None:
    r = results["auto"]
    plan = ParallelPlan.from_dict(r["plan"])
    assert plan.world_size == 4 and r["predicted"]
    assert r["loss_err"] < TOL and r["weight_err"] < TOL, r


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["resume_sharded", "resume_full", "pp2_resume"])
def test_resume_exact(results: dict, name: str) -> None:
    r = results[name]
    assert r["keys_match"], "checkpoint keys must equal the unwrapped LightningModule's state_dict keys"
    assert r["global_step"] == 6 and r["n_resumed_losses"] == 3
    assert r["lr"] == pytest.approx(0.2 * 0.5 ** 2)  # StepLR(3, 0.5) after 6 steps: the scheduler was restored
    assert r["loss_err"] < 1e-6, r
    assert r["weight_err"] < 1e-6, r


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["eval_reuse", "pp2_eval_reuse"])
def test_trainer_reuse_for_eval(results: dict, name: str) -> None:
    r = results[name]
    assert r["val_err"] < TOL and r["test_err"] < TOL, r
    assert r["pred_equal"] and r["n_pred"] > 0, r  # equal to the reference rows of this shard, in order


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16(results: dict) -> None:
    assert results["bf16_mixed"]["loss_err"] < 2e-2, results["bf16_mixed"]
    assert results["pp2_bf16_mixed"]["loss_err"] < 2e-2, results["pp2_bf16_mixed"]
    assert results["bf16_mixed"]["dtypes"] == ["torch.float32"]  # mixed: fp32 master weights
    assert results["bf16_true"]["loss_err"] < 5e-2, results["bf16_true"]
    assert results["bf16_true"]["dtypes"] == ["torch.bfloat16"]


@pytest.mark.slow
@pytest.mark.distributed
def test_replicas_identical_after_setup(results: dict) -> None:
    assert results["unseeded_init"]["err"] == 0.0
