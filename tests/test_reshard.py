"""Checkpoints written under one plan load under another (pp / tp / dp / ZeRO / partition / world size).

Users change plans between runs and the tuner does too. Launch 1 (4 ranks) trains and saves under plans
A and C, and loads them under 4-rank plans B and D; launch 2 (2 ranks) loads them under 2-rank plans.
Weights and optimizer state (momentum buffers) must be identical, key by key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_galv.plan import LayerStrategy as L
from lightning_galv.plan import ParallelPlan
from lightning_galv.testing import run_distributed

CHECKS = str(Path(__file__).parent / "dist_lightning_checks.py") + "::run_many"
SMALL_LAYERS = 3

A = ParallelPlan.uniform(4, SMALL_LAYERS, L(dp=2), pp=2, micro_batches=2, pp_division=(2, 1))        # pp2 x dp2
B = ParallelPlan.uniform(4, SMALL_LAYERS, L(tp=2, dp=2, zero=3))                                  # tp2 x zero3
C = ParallelPlan(4, embed=L(tp=2, dp=2), layers=(L(tp=4, sp="megatron"), L(tp=2, dp=2, zero=1), L(dp=4, zero=2)),
                 head=L(dp=4, zero=1))                                                             # heterogeneous
D = ParallelPlan.uniform(4, SMALL_LAYERS, L(tp=2), pp=2, micro_batches=2, pp_division=(1, 2))      # pp2 x tp2, uneven
E = ParallelPlan.uniform(2, SMALL_LAYERS, L(dp=1), pp=2, micro_batches=2, pp_division=(1, 2))      # 2 ranks, pp2
F = ParallelPlan.uniform(2, SMALL_LAYERS, L(dp=2, zero=1))                                         # 2 ranks, ZeRO-1


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict:
    sharded = str(tmp_path_factory.mktemp("sharded"))
    full = str(tmp_path_factory.mktemp("full"))
    four = run_distributed(CHECKS, 4, ([
        ("save_A", "save_under", dict(plan=A.to_dict(), tmpdir=sharded, full=False)),
        ("save_C", "save_under", dict(plan=C.to_dict(), tmpdir=full, full=True)),
        ("A_to_B", "load_under", dict(plan=B.to_dict(), tmpdir=sharded, full=False)),
        ("C_to_D", "load_under", dict(plan=D.to_dict(), tmpdir=full, full=True)),
    ],), init_process_group=False, timeout=900)[0]
    two = run_distributed(CHECKS, 2, ([
        ("A_to_E", "load_under", dict(plan=E.to_dict(), tmpdir=sharded, full=False)),
        ("C_to_F", "load_under", dict(plan=F.to_dict(), tmpdir=full, full=True)),
    ],), init_process_group=False, timeout=900)[0]
    return {**four, **two}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("pair", ["A_to_B", "A_to_E", "C_to_D", "C_to_F"])
def test_reshard_on_load(states: dict, pair: str) -> None:
    saved, loaded = states[f"save_{pair[0]}"], states[pair]
    assert saved["weights"].keys() == loaded["weights"].keys()
    for k, v in saved["weights"].items():
        assert torch.equal(v, loaded["weights"][k]), k
    assert saved["momentum"].keys() == loaded["momentum"].keys() and saved["momentum"]
    for k, v in saved["momentum"].items():
        assert torch.equal(v, loaded["momentum"][k]), k
    assert loaded["step"] == saved["step"] == 2
    assert loaded["lr"] == saved["lr"]
