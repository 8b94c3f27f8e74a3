"""Checkpoints written under one plan load under another (pp / tp / dp / ZeRO / partition / world size / ep /
expert sharding).

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
# MoE (blocks 0 and 2, 4 experts): experts saved under one ep load under another, under dense DP, in one process
G = ParallelPlan(4, (L(dp=4, ep=2), L(dp=4), L(dp=4, ep=2)))                                         # ep2
H = ParallelPlan(4, (L(dp=4, ep=4, zero=3), L(tp=2, dp=2), L(dp=4, ep=4, zero=3)))                   # ep4 x zero3
J = ParallelPlan(4, (L(tp=2, dp=2, ep=2, zero=1), L(dp=4), L(tp=2, dp=2, ep=2, zero=1)),
                 embed=L(tp=2, dp=2), head=L(tp=2, dp=2))                                             # ep2, attn tp2
K = ParallelPlan(4, (L(dp=4, ep=4), L(dp=4, zero=2), L(dp=4, ep=4)))                                 # ep4
M = ParallelPlan.uniform(2, SMALL_LAYERS, L(dp=2, zero=2))                                         # 2 ranks, dense DP
N = ParallelPlan(2, (L(dp=2, ep=2), L(dp=2), L(dp=2, ep=2)))                                         # 2 ranks, ep2
P = ParallelPlan.uniform(1, SMALL_LAYERS, L(dp=1))                                                 # one process
# pipeline whose second stage has no expert-parallel layer: a full save must still pick one collective on all
# ranks (it hung on a per-stage answer, found by a random-plan hunt)
Q = ParallelPlan(4, (L(dp=2, ep=2), L(dp=2), L(dp=2, zero=1)), pp=2, micro_batches=2, pp_division=(1, 2))
# Ulysses over strided tp groups, ZeRO-3 / ZeRO-2: FSDP2 shards over the stage's ranks in ascending order (a
# flattened (dp, tp) mesh [0, 2, 1, 3] once stored rows 1 and 2 of these layers swapped; found by a random-plan hunt)
U = ParallelPlan(4, (L(tp=2, dp=2, sp="ulysses", zero=3, tp_consecutive=False), L(dp=4),
                     L(tp=2, dp=2, sp="ulysses", zero=2, tp_consecutive=False)))
MOE = {"kind": "moe", "name": "_moe"}
FSEP = {"expert_sharding": "full"}  # LAER-MoE's fully sharded experts: every expert's rows on every EP rank


def random_pairs(seed: int = 0, n: int = 3) -> list[tuple[str, dict, dict, dict]]:
    """Seeded random valid plans beyond the hand-picked ones above: the checkpoint of a 4-rank plan (LLaMA and MoE
    in turn, sharded or full at random, random expert sharding) is loaded under another random 4-rank plan and
    under a random 2-rank one.

    The plans above are the layouts we thought of; a random-plan hunt found the pipeline hang of plan Q. Any
    pp / tp / sp / ZeRO / ep / partition may meet any other here. Returns (name, save kwargs, 4-rank load
    kwargs, 2-rank load kwargs)."""
    import random

    from lightning_galv.testing import random_plan
    from test_strategy import TRAINER_SHAPES  # the shapes of the modules dist_lightning_checks builds

    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = ("llama", "moe")[i % 2]
        moe = (0, 2) if kind == "moe" else ()
        full = rng.random() < 0.5
        plans = [random_plan(rng, w, TRAINER_SHAPES[kind], moe_layers=moe) for w in (4, 4, 2)]
        common = {"kind": kind, "name": f"_rand{i}", "full": full}

        def sharding(p: ParallelPlan) -> str:  # FSEP only where some layer is expert parallel
            return rng.choice(("owner", "full")) if any(s.ep > 1 for s in p.layers) else "owner"

        save, load4, load2 = ({**common, "plan": p.to_dict(), "global_batch": p.global_batch,
                               "expert_sharding": sharding(p)} for p in plans)
        out.append((f"rand{i}", save, load4, load2))
    return out


RANDOM = random_pairs()


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict:
    sharded = str(tmp_path_factory.mktemp("sharded"))
    full = str(tmp_path_factory.mktemp("full"))
    four = run_distributed(CHECKS, 4, ([
        ("save_A", "save_under", dict(plan=A.to_dict(), tmpdir=sharded, full=False)),
        ("save_C", "save_under", dict(plan=C.to_dict(), tmpdir=full, full=True)),
        ("A_to_B", "load_under", dict(plan=B.to_dict(), tmpdir=sharded, full=False)),
        ("A_to_U", "load_under", dict(plan=U.to_dict(), tmpdir=sharded, full=False)),
        ("save_U", "save_under", dict(plan=U.to_dict(), tmpdir=sharded, full=False, name="_u")),
        ("U_to_B", "load_under", dict(plan=B.to_dict(), tmpdir=sharded, full=False, name="_u")),
        ("C_to_D", "load_under", dict(plan=D.to_dict(), tmpdir=full, full=True)),
        ("save_G", "save_under", dict(plan=G.to_dict(), tmpdir=sharded, full=False, **MOE)),
        ("save_J", "save_under", dict(plan=J.to_dict(), tmpdir=full, full=True, **MOE)),
        ("G_to_H", "load_under", dict(plan=H.to_dict(), tmpdir=sharded, full=False, **MOE)),
        ("J_to_K", "load_under", dict(plan=K.to_dict(), tmpdir=full, full=True, **MOE)),
        ("save_Q", "save_under", dict(plan=Q.to_dict(), tmpdir=full, full=True,
                                      **{**MOE, "name": "_q"})),
        ("Q_to_H", "load_under", dict(plan=H.to_dict(), tmpdir=full, full=True, **{**MOE, "name": "_q"})),
        # fully sharded experts: saved, and loaded from plain EP's checkpoints (sharded and full)
        ("save_R", "save_under", dict(plan=K.to_dict(), tmpdir=sharded, full=False, **{**MOE, "name": "_r"}, **FSEP)),
        ("R_to_H", "load_under", dict(plan=H.to_dict(), tmpdir=sharded, full=False, **{**MOE, "name": "_r"})),
        ("G_to_Kf", "load_under", dict(plan=K.to_dict(), tmpdir=sharded, full=False, **MOE, **FSEP)),
    ],), init_process_group=False, timeout=900)[0]
    two = run_distributed(CHECKS, 2, ([
        ("A_to_E", "load_under", dict(plan=E.to_dict(), tmpdir=sharded, full=False)),
        ("C_to_F", "load_under", dict(plan=F.to_dict(), tmpdir=full, full=True)),
        ("G_to_M", "load_under", dict(plan=M.to_dict(), tmpdir=sharded, full=False, **MOE)),
        ("J_to_N", "load_under", dict(plan=N.to_dict(), tmpdir=full, full=True, **MOE)),
        ("J_to_Nf", "load_under", dict(plan=N.to_dict(), tmpdir=full, full=True, **MOE, **FSEP)),
    ],), init_process_group=False, timeout=900)[0]
    one = run_distributed(CHECKS, 1, ([
        ("G_to_P", "load_under", dict(plan=P.to_dict(), tmpdir=sharded, full=False, **MOE)),
        ("J_to_P", "load_under", dict(plan=P.to_dict(), tmpdir=full, full=True, **MOE)),
        ("Q_to_P", "load_under", dict(plan=P.to_dict(), tmpdir=full, full=True, **{**MOE, "name": "_q"})),
        ("R_to_P", "load_under", dict(plan=P.to_dict(), tmpdir=sharded, full=False, **{**MOE, "name": "_r"})),
    ],), init_process_group=False, timeout=900)[0]
    return {**four, **two, **one}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("pair", ["A_to_B", "A_to_U", "U_to_B", "A_to_E", "C_to_D", "C_to_F", "G_to_H", "G_to_M", "G_to_P", "J_to_K",
                                  "J_to_N", "J_to_P", "Q_to_H", "Q_to_P", "R_to_H", "R_to_P", "G_to_Kf",
                                  "J_to_Nf"])
def test_reshard_on_load(states: dict, pair: str) -> None:
    saved, loaded = states[f"save_{pair[0]}"], states[pair]
    _assert_same_state(saved, loaded)
    if pair[0] in "GJQR":  # every expert of both MoE blocks was saved and came back
        assert sum(".experts." in k and k.endswith("w1.weight") for k in saved["weights"]) == 8


@pytest.fixture(scope="module")
def random_states(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The random pairs' saves and loads: launches of their own (and a timeout of their own)."""
    tmp = str(tmp_path_factory.mktemp("random"))
    four = run_distributed(CHECKS, 4, ([c for name, save, load4, _ in RANDOM for c in (
        (f"save_{name}", "save_under", dict(save, tmpdir=tmp)), (name, "load_under", dict(load4, tmpdir=tmp)))],),
        init_process_group=False, timeout=900)[0]
    two = run_distributed(CHECKS, 2, ([(f"{name}_2r", "load_under", dict(load2, tmpdir=tmp))
                                       for name, _, _, load2 in RANDOM],), init_process_group=False, timeout=900)[0]
    return {**four, **two}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("pair", [f"{name}{suffix}" for name, *_ in RANDOM for suffix in ("", "_2r")])
def test_reshard_random_plans(random_states: dict, pair: str) -> None:
    """A checkpoint of a random 4-rank plan loads under a random 4-rank and a random 2-rank plan, state intact."""
    name = pair.removesuffix("_2r")
    _assert_same_state(random_states[f"save_{name}"], random_states[pair])


# 8 ranks: experts of Ulysses layers over strided tp groups, ZeRO-3 over their expert-data groups (edp [0, 4, 1, 5]
# before the EP groups were ordered: 24 expert tensors loaded into the wrong rows), loaded under plain data parallelism
V = ParallelPlan(8, (L(tp=4, dp=2, sp="ulysses", zero=3, tp_consecutive=False, ep=2), L(dp=8),
                     L(tp=4, dp=2, sp="ulysses", zero=3, tp_consecutive=False, ep=2)))
W = ParallelPlan(8, (L(dp=8, ep=2), L(dp=8), L(dp=8, ep=2)))


@pytest.mark.slow
@pytest.mark.distributed
def test_reshard_experts_of_strided_ulysses_layers_8_ranks(tmp_path: Path) -> None:
    """FSDP2 keeps shard i on group rank i, DTensor (so DCP) puts shard c at mesh coordinate c: the expert-data
    mesh must list its ranks in ascending order (RankLayout.expert_grid) or a sharded checkpoint's experts come
    back permuted under another plan."""
    out = run_distributed(CHECKS, 8, ([
        ("save_V", "save_under", dict(plan=V.to_dict(), tmpdir=str(tmp_path), full=False, **{**MOE, "name": "_v"})),
        ("V_to_W", "load_under", dict(plan=W.to_dict(), tmpdir=str(tmp_path), full=False, **{**MOE, "name": "_v"})),
    ],), init_process_group=False, timeout=900)[0]
    _assert_same_state(out["save_V"], out["V_to_W"])
    assert sum(".experts." in k and k.endswith("w1.weight") for k in out["save_V"]["weights"]) == 8


def test_random_reshard_pairs_are_varied() -> None:
    """What the random pairs draw (a pure check, no processes): both kinds, both formats, plans that differ."""
    assert {s["kind"] for _, s, _, _ in RANDOM} == {"llama", "moe"}
    assert {s["full"] for _, s, _, _ in RANDOM} == {True, False}
    for _, save, load4, load2 in RANDOM:
        assert save["plan"] != load4["plan"] and ParallelPlan.from_dict(load2["plan"]).world_size == 2
    plans = [ParallelPlan.from_dict(d["plan"]) for _, *ds in RANDOM for d in ds]
    assert any(p.pp > 1 for p in plans) and any(s.tp > 1 for p in plans for s in p.layers)
    assert any(s.zero >= 2 for p in plans for s in p.layers) and any(s.ep > 1 for p in plans for s in p.layers)
    assert {d["expert_sharding"] for _, *ds in RANDOM for d in ds} == {"owner", "full"}


def _assert_same_state(saved: dict, loaded: dict) -> None:
    """Weights and momentum identical key by key, step and learning rate restored."""
    assert saved["weights"].keys() == loaded["weights"].keys()
    for k, v in saved["weights"].items():
        assert torch.equal(v, loaded["weights"][k]), k
    assert saved["momentum"].keys() == loaded["momentum"].keys() and saved["momentum"]
    for k, v in saved["momentum"].items():
        assert torch.equal(v, loaded["momentum"][k]), k
    assert loaded["step"] == saved["step"] == 2
    assert loaded["lr"] == saved["lr"]
