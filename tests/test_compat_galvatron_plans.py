"""Galvatron plan JSON both ways: every plan the 2.4.0 sdist ships (and the judge's reference plan) reads and
writes back to the same keys; what Galvatron cannot express is refused or kept in the documented side field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lightning_galv.compat.galvatron import SIDE_FIELD, read_plan, write_plan
from lightning_galv.plan import LayerStrategy, ParallelPlan

DATA = Path(__file__).resolve().parent / "data" / "galvatron"
PLANS = sorted(DATA.glob("models/*/configs/galvatron_config_*.json")) + sorted(DATA.glob("plans/*.json"))
# what Galvatron's runtime reads of a plan (utils/config_utils.py config2strategy, runtime/hybrid_parallel_config.py)
READ_KEYS = ("pp_deg", "tp_sizes_enc", "tp_consecutive_flags", "dp_types_enc", "use_sp", "checkpoint", "global_bsz",
             "chunks", "pp_division", "pipeline_type", "default_dp_type", "vtp", "vsp", "embed_sdp")


def world_of(path: Path) -> int:
    mt = re.search(r"(\d+)nodes_(\d+)gpus_per_node", path.name) or re.search(r"_(\d+)x(\d+)_", path.name)
    assert mt, path.name
    return int(mt.group(1)) * int(mt.group(2))


def test_every_shipped_plan_is_found() -> None:
    assert len(PLANS) == 25, [p.name for p in PLANS]  # 24 in the sdist's configs + the judge's reference plan
    uneven = [p.name for p in PLANS if (lambda d: int(d["global_bsz"]) % int(d["chunks"]))(json.loads(p.read_text()))]
    assert len(uneven) == 2, uneven  # bert-large (128 / 3) and swin: refused below, all others round-trip


def _expected(original: dict, world: int) -> dict:
    """The original plan's keys as Galvatron understands them: its defaults filled in, and flags that mean
    nothing normalized -- ZeRO-3 on a layer without data parallelism."""
    n = len(str(original["tp_sizes_enc"]).split(","))
    pp = int(original["pp_deg"])
    out = {"tp_consecutive_flags": ",".join(["1"] * n), "dp_types_enc": ",".join(["0"] * n),
           "use_sp": ",".join(["0"] * n), "checkpoint": ",".join(["0"] * n), "pipeline_type": "gpipe",
           "default_dp_type": "ddp", "vsp": 0, "embed_sdp": 0}
    out.update({k: v for k, v in original.items() if k in READ_KEYS})
    tps = [int(x) for x in str(out["tp_sizes_enc"]).split(",")]
    sps = [int(x) for x in str(out["use_sp"]).split(",")]
    dts = [int(x) for x in str(out["dp_types_enc"]).split(",")]
    group = [world // pp // t * (t if s else 1) for t, s in zip(tps, sps)]
    out["dp_types_enc"] = ",".join(str(d if g > 1 else 0) for d, g in zip(dts, group))
    if "vtp" not in out:  # read_plan infers it as Galvatron's pre-vtp runtime did
        out["vtp"] = write_plan(read_plan(original, world))["vtp"]
    return {k: str(v) for k, v in out.items()}


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.parent.parent.name + "/" + p.stem)
def test_plan_round_trip(path: Path) -> None:
    original = json.loads(path.read_text())
    world = world_of(path)
    if int(original["global_bsz"]) % int(original["chunks"]):  # Galvatron cuts uneven micro-batches (torch.chunk)
        with pytest.raises(ValueError, match="global_bsz.*chunks.*evenly.*HINT:"):
            read_plan(path, world)
        return
    plan = read_plan(path, world)
    written = write_plan(plan)
    assert set(written) == set(READ_KEYS)  # no key Galvatron does not read
    assert {k: str(v) for k, v in written.items()} == _expected(original, world)
    assert read_plan(written, world) == plan
    assert write_plan(read_plan(written, world)) == written


def test_vsp_embed_sdp_and_default_dp_type_are_read() -> None:
    base = json.loads((DATA / "plans" / "T06_galvatron_gpt2.7b_1x8_40G.json").read_text())
    plan = read_plan(base | {"vtp": 4, "vsp": 1, "embed_sdp": 1, "default_dp_type": "ddp"}, 8)
    assert plan.embed == plan.head == LayerStrategy(tp=4, dp=2, sp="ulysses", zero=3)
    assert all(s.zero == 0 for s in plan.layers)  # ddp
    out = write_plan(plan)
    assert (out["vtp"], out["vsp"], out["embed_sdp"], out["default_dp_type"]) == (4, 1, 1, "ddp")
    one = read_plan(base | {"vtp": 1, "vsp": 1}, 8)  # a 1-way split: nothing at run time, priced apart by Galvatron
    assert one.vocab_sp and not one.embed.ulysses and write_plan(one)["vsp"] == 1
    assert "vocab_sp" not in read_plan(base, 8).to_dict()  # plans without it serialize as before
    assert ParallelPlan.from_dict(one.to_dict()) == one and one != one.with_(vocab_sp=False)
    with pytest.raises(ValueError, match="vocab_sp.*HINT:"):
        one.with_(embed=LayerStrategy(tp=2, dp=4, zero=2), head=LayerStrategy(tp=2, dp=4, zero=2))
    gpipe = read_plan({k: v for k, v in base.items() if k not in ("pipeline_type", "pp_division")}, 8)
    assert gpipe.pipeline_schedule == "gpipe"  # Galvatron's runtime default


def test_megatron_sp_is_a_launch_flag_in_the_side_field() -> None:
    s = LayerStrategy(tp=2, dp=4, sp="megatron", zero=2)
    plan = ParallelPlan.uniform(8, 4, s, global_batch=16, micro_batches=2)
    out = write_plan(plan)
    assert out[SIDE_FIELD]["sequence_parallel"] is True and "--sequence_parallel" in out[SIDE_FIELD]["note"]
    assert "sequence_parallel" not in out  # not a Galvatron plan key
    assert read_plan(out, 8) == plan
    galv_only = {k: v for k, v in out.items() if k != SIDE_FIELD}
    assert read_plan(galv_only, 8, sequence_parallel=True) == plan
    assert read_plan(galv_only, 8).layers[0].sp == "none"
    mixed = plan.with_(layers=(s, s, LayerStrategy(tp=2, dp=4, zero=2), s))
    with pytest.raises(ValueError, match="--sequence_parallel.*HINT:"):
        write_plan(mixed)


def test_what_galvatron_cannot_express_is_refused_or_kept_aside() -> None:
    s = LayerStrategy(tp=2, dp=4, zero=2)
    plan = ParallelPlan.uniform(8, 4, s, global_batch=16, micro_batches=2)
    split = plan.with_(head=LayerStrategy(dp=8, zero=2))
    with pytest.raises(ValueError, match="embedding and the head.*HINT:.*side=True"):
        write_plan(split)
    kept = write_plan(split, side=True)
    assert kept["vtp"] == 2 and kept[SIDE_FIELD]["head"] == LayerStrategy(dp=8, zero=2).to_dict()
    assert read_plan(kept, 8) == split
    vpl = plan.with_(vocab_parallel_loss=True)
    with pytest.raises(ValueError, match="vocab_parallel_loss.*HINT:"):
        write_plan(vpl)
    assert read_plan(write_plan(vpl, side=True), 8) == vpl
    for bad, match in ((plan.with_(layers=(LayerStrategy(tp=2, dp=4, zero=1),) * 4), "ZeRO"),
                       (ParallelPlan.uniform(8, 4, LayerStrategy(dp=8, zero=2), global_batch=16, micro_batches=2,
                                             embed=LayerStrategy(dp=8), head=LayerStrategy(dp=8)), "ZeRO"),
                       (plan.with_(pp=2, pp_division=(1, 1, 1, 1), virtual_stages=2, layers=(LayerStrategy(tp=2, dp=2, zero=2),) * 4,
                                   embed=LayerStrategy(tp=2, dp=2), head=LayerStrategy(tp=2, dp=2),
                                   pipeline_schedule="interleaved_1f1b"), "GPipe and 1F1B"),
                       (plan.with_(embed=LayerStrategy(tp=2, dp=4, sp="megatron", zero=2),
                                   head=LayerStrategy(tp=2, dp=4, sp="megatron", zero=2)), "ends")):
        with pytest.raises(ValueError, match=f"{match}.*HINT:"):
            write_plan(bad)
    with pytest.raises(ValueError, match="side field.*HINT:"):
        read_plan(write_plan(plan) | {SIDE_FIELD: {"sneaky": 1}}, 8)
