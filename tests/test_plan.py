"""Plans as data: validation, round trips, describe(); bad input fails fast with a HINT (no processes)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from lightning_galv import GalvatronStrategy
from lightning_galv.errors import bad_value
from lightning_galv.layout import RankLayout
from lightning_galv.models import Llama, LlamaConfig, find_parts
from lightning_galv.parallel.parallelize import check_plan_for_model
from lightning_galv.plan import LayerStrategy as L
from lightning_galv.plan import ModelShape, ParallelPlan, parse_plan

HETERO = ParallelPlan(4, embed=L(tp=2, dp=2), layers=(L(tp=4, sp="megatron"), L(tp=2, dp=2, checkpoint=True),
                                                      L(tp=2, dp=2, sp="ulysses"), L(dp=4, zero=3)),
                      head=L(dp=4, zero=2))


def test_round_trip_yaml_json(tmp_path) -> None:
    for p in (HETERO, ParallelPlan.uniform(8, 6, L(tp=2, dp=2), pp=2, micro_batches=4, global_batch=32),
              HETERO.with_(head=L(tp=2, dp=2), vocab_parallel_loss=True)):
        assert ParallelPlan.from_yaml(p.to_yaml()) == p
        assert ParallelPlan.from_json(p.to_json()) == p
        for suffix in (".yaml", ".json"):
            path = tmp_path / f"plan{suffix}"
            p.save(path)
            assert ParallelPlan.load(path) == p
            assert parse_plan(str(path)) == p


def test_frozen_and_derived() -> None:
    with pytest.raises(Exception):
        HETERO.pp = 2  # type: ignore[misc]
    assert HETERO.data_parallel_size == 4
    assert HETERO.batch_unit == 4
    assert HETERO.layers[2].data_group == 4 and HETERO.layers[2].tensor_parallel == 1
    text = HETERO.describe()
    assert "tp+sp4" in text and "ulysses2·dp2" in text and "dp4·zero3" in text


def test_uniform_plan_edges_drop_sequence_parallelism() -> None:
    p = ParallelPlan.uniform(4, 2, L(tp=4, sp="ulysses", zero=2))
    assert p.embed == L(dp=4, zero=2) and p.head == L(dp=4, zero=2)
    p = ParallelPlan.uniform(4, 2, L(tp=2, dp=2, sp="megatron"))
    assert p.embed == L(tp=2, dp=2)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(world_size=4, layers=(L(tp=2, dp=1),)), "tp*dp must equal"),
    (dict(world_size=6, layers=(L(dp=3),), pp=4), "pp must divide"),
    (dict(world_size=4, layers=(L(dp=4),) * 3, pp_division=(1, 1)), "needs 1 positive layer counts"),
    (dict(world_size=4, layers=(L(dp=2),) * 3, pp=2, pp_division=(1, 1)), "must sum to the number of layers"),
    (dict(world_size=4, layers=(L(dp=2),) * 4, pp=2, micro_batches=1), "at least as many micro-batches"),
    (dict(world_size=4, layers=(L(dp=4),), global_batch=6), "must be divisible"),
    (dict(world_size=4, layers=(L(dp=4),), pipeline_schedule="zb"), "pipeline_schedule"),
    (dict(world_size=4, layers=(L(tp=2, dp=2),), backend="deepspeed"), "pure data-parallel"),
])
def test_bad_plans(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match="HINT") as e:
        ParallelPlan(**kwargs)
    assert needle in str(e.value)


@pytest.mark.parametrize("kwargs", [dict(tp=0), dict(sp="ring", tp=2), dict(zero=4), dict(sp="megatron")])
def test_bad_layer_strategies(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="HINT"):
        L(**kwargs)


def test_one_error_format() -> None:
    """Plans, profiles, the search space and Galvatron files all raise through ``errors.bad_value``."""
    err = bad_value("pp=3", "must divide world_size 8", "pick pp from [1, 2, 4, 8].")
    assert isinstance(err, ValueError)
    assert str(err) == "'pp=3': must divide world_size 8. HINT: pick pp from [1, 2, 4, 8]."
    with pytest.raises(ValueError) as e:
        ParallelPlan(world_size=6, layers=(L(dp=3),), pp=4)
    assert str(e.value) == ("'world_size=6, pp=4': pp must divide the world size. "
                            "HINT: pick pp from the divisors of 6: [1, 2, 3, 6].")


def test_wrong_types_are_type_errors() -> None:
    with pytest.raises(TypeError, match="HINT"):
        L(tp="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="HINT"):
        ParallelPlan.from_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="vocab_parallel_loss='yes'.*HINT"):
        HETERO.with_(vocab_parallel_loss="yes")


def test_vocab_parallel_loss_in_plan() -> None:
    plan = HETERO.with_(head=L(tp=2, dp=2), vocab_parallel_loss=True)
    assert plan.to_dict()["vocab_parallel_loss"] is True and plan != plan.with_(vocab_parallel_loss=False)
    assert "(vocab-parallel loss)" in plan.describe() and "(vocab-parallel loss)" not in HETERO.describe()
    assert ParallelPlan.from_dict({k: v for k, v in HETERO.to_dict().items() if k != "vocab_parallel_loss"}) == HETERO


def test_malformed_plan_files(tmp_path) -> None:
    bad_yaml = tmp_path / "a.yaml"
    bad_yaml.write_text("world_size: 4\nlayers: [tp: 2\n")
    with pytest.raises(ValueError, match="HINT"):
        ParallelPlan.load(bad_yaml)
    bad_json = tmp_path / "b.json"
    bad_json.write_text("{not json")
    with pytest.raises(ValueError, match="HINT"):
        ParallelPlan.load(bad_json)
    unknown = tmp_path / "c.json"
    unknown.write_text(json.dumps({"world_size": 4, "layers": [{"tp": 1, "dp": 4, "tpp": 2}]}))
    with pytest.raises(ValueError, match="tpp"):
        ParallelPlan.load(unknown)
    with pytest.raises(ValueError, match="does not exist"):
        ParallelPlan.load(tmp_path / "missing.yaml")


def test_model_checks_name_the_divisor() -> None:
    shape = ModelShape(num_layers=1, hidden=64, num_heads=8, num_kv_heads=2, ffn_hidden=128, vocab_size=250,
                       seq_len=64)
    with pytest.raises(ValueError, match=r"num_kv_heads=2.*HINT"):
        ParallelPlan(4, (L(tp=4),)).check_model(shape)
    with pytest.raises(ValueError, match=r"vocab_size=250"):
        ParallelPlan(4, (L(dp=4),), embed=L(tp=4)).check_model(shape)
    with pytest.raises(ValueError, match="the model has 1 layers"):
        ParallelPlan(4, (L(dp=4),) * 2).check_model(shape)


class _Opaque(nn.Module):
    """A model without the block protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))


def test_tp_on_a_model_without_protocol_is_refused() -> None:
    parts = find_parts(_Opaque())
    assert not parts.understood and len(parts.blocks) == 3
    check_plan_for_model(ParallelPlan.uniform(4, 3, L(dp=4, zero=3, checkpoint=True)), parts)  # DP is fine
    with pytest.raises(ValueError, match="block protocol.*HINT"):
        check_plan_for_model(ParallelPlan.uniform(4, 3, L(tp=2, dp=2)), parts)


def test_protocol_parts_of_reference_model() -> None:
    m = Llama(LlamaConfig(n_layers=2))
    parts = find_parts(m)
    assert parts.understood and len(parts.blocks) == 2 and parts.head is m.output
    assert parts.shape is not None and parts.shape.num_layers == 2


def test_rank_layout_consecutive_and_strided() -> None:
    lay = RankLayout(8, pp=2)
    assert lay.grid(L(tp=2, dp=2), stage=1) == [[4, 5], [6, 7]]
    assert lay.grid(L(tp=2, dp=2, tp_consecutive=False), stage=1) == [[4, 6], [5, 7]]
    assert lay.tp_group(L(tp=2, dp=2, tp_consecutive=False), 5) == [5, 7]
    assert lay.batch_shard(L(tp=2, dp=2), 6) == (1, 2)


def test_expert_grid_is_ascending_in_every_dimension_and_keeps_the_groups() -> None:
    """Every layout up to 64 ranks (pp 1/2/4, tp, strided or consecutive, Ulysses or not, each ep): the EP
    groups are runs of ``ep`` consecutive ranks of the data group (dp ranks of one tp index, or the whole stage
    row-major for Ulysses), the edp groups the ranks at one position of every EP group -- and every EP and edp
    group lists its ranks in ascending order, as its process group numbers them (DTensor and DCP go by the
    mesh coordinate, FSDP2 by the group rank: they must agree). World 8, Ulysses tp4 x dp2 strided, ep2 had
    the edp group [0, 4, 1, 5]."""
    cases = 0
    for world in (2, 4, 8, 16, 32, 64):
        for pp in (p for p in (1, 2, 4) if world % p == 0):
            n = world // pp
            for tp in (t for t in (1, 2, 4, 8, 16) if n % t == 0):
                for cons in (True, False):
                    for ulysses in ((False, True) if tp > 1 else (False,)):
                        dp = n // tp
                        for ep in (e for e in (2, 4, 8, 16) if (dp * tp if ulysses else dp) % e == 0):
                            s = L(tp=tp, dp=dp, tp_consecutive=cons, sp="ulysses" if ulysses else "none", ep=ep)
                            lay = RankLayout(world, pp)
                            grid = lay.expert_grid(s)
                            for stage in range(pp):
                                g = lay.grid(s, stage)
                                datas = ([[r for row in g for r in row]] if ulysses else
                                         [[row[t] for row in g] for t in range(tp)])
                                blocks = [grid[stage]] if ulysses else grid[stage]
                                assert len(blocks) == len(datas)
                                for data, groups in zip(datas, blocks):
                                    want = {frozenset(data[i:i + ep]) for i in range(0, len(data), ep)}
                                    assert {frozenset(x) for x in groups} == want, (world, pp, s.short())
                                    edp = [list(col) for col in zip(*groups)]
                                    for one in (*groups, *edp):
                                        assert one == sorted(one), (world, pp, s.short(), groups)
                            cases += 1
    assert cases > 400
    assert RankLayout(8).expert_grid(L(tp=4, dp=2, sp="ulysses", tp_consecutive=False, ep=2)) == \
        [[[0, 2], [1, 3], [4, 6], [5, 7]]]


def test_strategy_argument_errors() -> None:
    with pytest.raises(ValueError, match="HINT"):
        GalvatronStrategy(plan=HETERO, tp=2)
    with pytest.raises(ValueError, match="HINT"):
        GalvatronStrategy(sp="megatron")  # sp without a tp group
    with pytest.raises(ValueError, match="HINT"):
        GalvatronStrategy(start_method="thread")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="vocab_parallel_loss=1.*HINT"):
        GalvatronStrategy(vocab_parallel_loss=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="routing_skew.*HINT"):
        GalvatronStrategy(routing_skew={1: 1.2})  # ep 1 has no EP group
    with pytest.raises(ValueError, match="routing_skew.*HINT"):
        GalvatronStrategy(routing_skew={2: 0.8})  # the busiest rank holds at least the mean
    with pytest.raises(ValueError, match="routing_skew.*given plan.*HINT"):
        GalvatronStrategy(plan=HETERO, routing_skew={2: 1.2})  # only the search prices it
    assert GalvatronStrategy(routing_skew={4: 1.4, 2: 1.2})._routing_skew == {2: 1.2, 4: 1.4}


def _trainer_error(**kw) -> str:
    import lightning.pytorch as pl

    from lightning_galv.demo.module import CausalLM

    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, max_steps=1,
                             **kw)
        trainer.fit(CausalLM(n_layers=1), torch.utils.data.DataLoader(torch.zeros(4, 9, dtype=torch.long), batch_size=2))
    assert time.monotonic() - start < 30  # fails fast, no hang
    return str(e.value)


def test_world_size_mismatch_fails_fast() -> None:
    msg = _trainer_error(strategy=GalvatronStrategy(plan=ParallelPlan.uniform(4, 1)))
    assert "world_size=4" in msg and "HINT" in msg


def test_unsupported_precision_fails_fast() -> None:
    msg = _trainer_error(strategy=GalvatronStrategy(plan=ParallelPlan.uniform(1, 1)), precision="16-true")
    assert "16-true" in msg and "HINT" in msg
