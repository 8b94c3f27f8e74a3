"""GalvatronAccounting reproduces Galvatron 2.4.0's own numbers (no judge needed: the reference values are what
Galvatron's search reported for its plan, see shared/galvatron-judge/README.md and tests/data/galvatron/plans)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_galv.compat.galvatron import read_galvatron_hardware, read_model_profile, read_plan
from lightning_galv.plan import LayerStrategy
from lightning_galv.planner.galvatron_accounting import GalvatronAccounting, usable_memory_mb, zero_ratios

DATA = Path(__file__).resolve().parent / "data" / "galvatron"


def accounting(mem: float = 40) -> GalvatronAccounting:
    model = read_model_profile(DATA / "models/gpt_hf/meta_configs/gpt-2.7b.json", DATA / "models/gpt_hf/configs",
                               layout="legacy")
    return GalvatronAccounting(model, read_galvatron_hardware(DATA / "hardware", 1, 8), mem)


def test_galvatron_plan_scores_what_its_search_reported() -> None:
    plan = read_plan(DATA / "plans" / "T06_galvatron_gpt2.7b_1x8_40G.json", 8)
    best = accounting().score(plan).best
    assert best is not None and (best.min_tp, best.max_tp) == (1, 1)
    assert best.time_s == pytest.approx(1.8092703918457038, rel=1e-9)  # Galvatron's search output for this plan
    assert best.usable_mb == 32768 and best.within_budget  # 40 GB less the 20 % allocator reserve


def test_memory_rules() -> None:
    assert usable_memory_mb(40) == (32768, 8192) and usable_memory_mb(16) == (16384, 0)
    z2_one, _ = zero_ratios(1)
    z2_acc, _ = zero_ratios(4)
    # with accumulation ZeRO-2 keeps 2/8 of the states (fp16 grads) unsharded instead of 1/8
    assert z2_acc(8) - z2_one(8) == pytest.approx(1 / 8 - 1 / 8 * (1 / 8 + 0.003))
    acc = accounting()
    plan = read_plan(DATA / "plans" / "T06_galvatron_gpt2.7b_1x8_40G.json", 8)
    one = acc.score(plan.with_(micro_batches=1)).best
    four = acc.score(plan).best
    assert one is not None and four is not None and one.used_mb[0] > four.used_mb[0]  # activations of 64 vs 16 samples
    assert acc.other_memory(plan, 1, False, False, 2, 1)[0] > 1024  # ends + the fixed 1 GB context


def test_refusals() -> None:
    plan = read_plan(DATA / "plans" / "T06_galvatron_gpt2.7b_1x8_40G.json", 8)
    uly = plan.with_(layers=(LayerStrategy(tp=2, dp=4, sp="ulysses", zero=2),) * 32)
    with pytest.raises(ValueError, match="Ulysses.*HINT:"):
        accounting().score(uly)
    with pytest.raises(ValueError, match="global_batch.*HINT:"):
        accounting().score(plan.with_(global_batch=None))


def test_hardware_coefficients_are_validated() -> None:
    """A broken Galvatron hardware file (a NaN or non-positive overlap coefficient, a negative bandwidth) is a
    clear error naming the value, not a silently wrong score."""
    from dataclasses import replace

    hw = read_galvatron_hardware(DATA / "hardware", 1, 8)
    assert hw.overlap_coe > 1.0
    for bad, match in ((dict(overlap_coe=float("nan")), "overlap_coe=nan.*HINT:"),
                       (dict(overlap_coe=0.0), "overlap_coe=0.0.*HINT:"),
                       (dict(comm_coe={**hw.comm_coe, "8": -1.0}), r"comm_coe\['8'\]=-1.0.*HINT:"),
                       (dict(world=0), "world=0.*HINT:")):
        with pytest.raises(ValueError, match=match):
            replace(hw, **bad)
