"""Galvatron interop on Galvatron's own reference files (shipped in tests/data/galvatron, Apache-2.0):
profiles, plan round trips, same-plan agreement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_galv.compat.galvatron import (read_hardware_profile, read_meta_config, read_model_profile, read_plan,
                                             write_plan)
from lightning_galv.plan import LayerStrategy, ParallelPlan
from lightning_galv.planner.cost import GalvatronCostModel
from lightning_galv.planner import SearchSpace, search

REF = Path(__file__).resolve().parent / "data" / "galvatron"
CONFIGS = REF / "gpt" / "configs"
GiB = 2**30


def model(name: str):
    return read_model_profile(REF / "gpt" / "meta_configs" / f"{name}.json", CONFIGS)


def test_meta_config_and_model_profile_numbers() -> None:
    shape = read_meta_config(REF / "gpt" / "meta_configs" / "gpt-1.5b.json")
    assert (shape.num_layers, shape.hidden, shape.num_heads, shape.seq_len) == (48, 1600, 32, 1024)
    prof = model("gpt-1.5b")
    lt = prof.layer(0)
    assert lt.forward(1, 1024) == pytest.approx(0.5981169303258261e-3)  # layertype_0, ms per sample
    assert lt.backward(1, 1024) == pytest.approx(2 * 0.5981169303258261e-3)  # Galvatron's 2x assumption
    assert lt.params == int(119.087890625 * 2**20 / 4)
    assert lt.activation(1, "none", False) == pytest.approx(58.20361328125 * 2**20)
    assert lt.activation(8, "none", False) == pytest.approx(21.02252197265625 * 2**20)
    assert lt.activation(1, "none", True) == pytest.approx(3.619140625 * 2**20)
    # whole-model forward (layernum[12]_bsz4 = 41.48 ms) minus 12 layers x 4 samples: embedding + head
    other = 41.484313583374025 / 4 - 12 * 0.5981169303258261
    assert prof.ends.forward(1, 1024) == pytest.approx(other * 1e-3)
    # split in halves between the ends, as Galvatron's OtherTimeCostModel gives each end stage half
    assert prof.embed_forward(1, 1024) == pytest.approx(other * 1e-3 / 2)
    assert prof.head_forward(1, 1024) == pytest.approx(other * 1e-3 / 2)
    assert prof.per_sample_only


def test_hardware_profile_numbers() -> None:
    hw = read_hardware_profile(REF / "hardware", 2, 8)
    assert hw.overlap_slowdown == pytest.approx(1.125552573612729)
    assert hw.links["allreduce/16/consec/inter"].bandwidth == pytest.approx(44.682e9)
    assert hw.links["allreduce/8/consec/intra"].bandwidth == pytest.approx(155.658e9)
    assert hw.links["allreduce/2/strided/inter"].bandwidth == pytest.approx(8.13007e9)
    assert hw.p2p["inter"].bandwidth == pytest.approx(7.65998e9)
    a2a = hw.links["alltoall/8/consec/intra"]  # fitted from sp_time (1-node file, as Galvatron does)
    assert 0.05e-3 < a2a.latency_s < 0.2e-3 and 100e9 < a2a.bandwidth < 400e9
    with pytest.raises(ValueError, match="HINT:"):
        read_hardware_profile(REF / "hardware", 4, 8)


EXAMPLE_PLANS = sorted(CONFIGS.glob("galvatron_config_*_example.json"))


def test_reference_plans_present() -> None:
    # an empty glob would silently parametrize nothing: the shipped reference has five example plans
    assert len(EXAMPLE_PLANS) == 5, f"expected Galvatron's example plans under {CONFIGS}"


@pytest.mark.parametrize("path", EXAMPLE_PLANS, ids=lambda p: p.stem)
def test_plan_json_round_trip(path: Path) -> None:
    original = json.loads(path.read_text())
    nodes = int(path.stem.split("_")[3][0])
    plan = read_plan(path, world_size=8 * nodes)
    name = path.stem.split("_")[2]
    plan.check_model(read_meta_config(REF / "gpt" / "meta_configs" / f"{name}.json")) if plan.embed.tp == 1 else None
    written = write_plan(plan)
    for key, value in original.items():
        assert str(written[key]) == str(value), key
    assert read_plan(written, world_size=8 * nodes) == plan


def test_read_plan_semantics() -> None:
    plan = read_plan(CONFIGS / "galvatron_config_gpt-2.7b_1nodes_8gpus_per_node_40GB_bf16_example.json", 8)
    assert plan.pp == 2 and plan.pp_division == (16, 16) and plan.micro_batches == 4 and plan.global_batch == 64
    assert plan.layers[0] == LayerStrategy(tp=2, dp=2, zero=3)  # dp_types_enc 1 = sharded data parallel
    assert plan.layers[9] == LayerStrategy(tp=1, dp=4, zero=3)
    assert plan.pipeline_schedule == "1f1b"
    with pytest.raises(ValueError, match="HINT:"):
        read_plan({"pp_deg": 3, "tp_sizes_enc": "1", "global_bsz": 8, "chunks": 1}, 8)
    with pytest.raises(ValueError, match="HINT:"):
        write_plan(ParallelPlan.uniform(2, 2, LayerStrategy(dp=2, zero=1), global_batch=2))


@pytest.mark.parametrize("name,nodes,batch,pp,tp,m,galv", [
    ("gpt-1.5b", 2, 144, 1, 1, 3, 0.861), ("gpt-2.7b", 1, 64, 1, 1, 4, 1.81), ("gpt-2.7b", 2, 64, 1, 1, 2, 0.905),
    ("gpt-1.5b", 2, 448, 2, 2, 112, 3.08), ("gpt-2.7b", 2, 320, 2, 2, 80, 5.22)])
def test_same_plan_within_15_percent_of_galvatron(name, nodes, batch, pp, tp, m, galv) -> None:
    prof, hw = model(name), read_hardware_profile(REF / "hardware", nodes, 8)
    world = 8 * nodes
    s = LayerStrategy(tp=tp, dp=world // pp // tp, zero=2)
    emb = s if pp > 1 else LayerStrategy(dp=world, zero=2)
    plan = ParallelPlan.uniform(world, prof.num_layers, s, pp=pp, micro_batches=m, global_batch=batch, embed=emb, head=emb)
    cost = GalvatronCostModel(prof, hw).evaluate(plan)
    assert abs(cost.step_time_s - galv) / galv < 0.15
    assert cost.peak_memory_bytes < 40 * GiB
    ours = search(prof, hw, world, 40 * GiB, global_batch=batch, top_k=1,
                  space=SearchSpace(max_tp=8, max_pp=8, vocab_padding=True) if pp == 1 else
                  SearchSpace.three_d(max_tp=8, max_pp=8, schedules=("1f1b",), vocab_padding=True))[0]
    assert ours.prediction.step_time_s <= cost.step_time_s * (1 + 1e-9)  # never slower than Galvatron's plan


def test_batch_sweep_not_fooled_by_per_sample_profiles() -> None:
    prof, hw = model("gpt-2.7b"), read_hardware_profile(REF / "hardware", 1, 8)
    space = SearchSpace(max_tp=8, max_pp=2, sp_modes=("none",), zero_stages=(0, 2, 3), schedules=("1f1b",))
    sweep = search(prof, hw, 8, 40 * GiB, global_batch=[8, 16, 32, 64], top_k=3, space=space)
    small = search(prof, hw, 8, 40 * GiB, global_batch=8, top_k=1, space=space)[0]
    assert sweep[0].global_batch > 8
    assert sweep[0].prediction.throughput > small.prediction.throughput
    assert "per-sample" in sweep.explanation
