"""Mid-fit plan switches (issue 13, item 3), the pure and one-process parts: which plans may replace a running
one, the calibrated re-search that proposes them, and the pristine copy a switch re-parallelizes. The switch
itself, on 4 ranks under the Trainer, is in test_strategy.py (test_switching_plans_mid_fit_is_exact and
test_plan_monitor_replans_mid_fit_and_training_stays_exact)."""

from __future__ import annotations

import pytest
import torch

from lightning_galv.auto import replan_search
from lightning_galv.plan import LayerStrategy as L
from lightning_galv.plan import ModelShape, ParallelPlan, loader_layout
from lightning_galv.planner import GalvatronCostModel, HardwareProfile, ModelProfile, SearchSpace, search
from lightning_galv.planner.calibration import Calibration
from lightning_galv.strategies.switch import PristineCopy, check_switch

SHAPE = ModelShape(8, 1024, 16, 16, 4096, 32000, 512)


def test_a_switch_must_keep_the_loaders_layout() -> None:
    a = ParallelPlan(4, (L(tp=2, dp=2), L(dp=4, zero=3)), embed=L(dp=4), head=L(dp=4))
    b = ParallelPlan(4, (L(dp=4, checkpoint=True), L(tp=4, sp="megatron")), embed=L(tp=2, dp=2), head=L(dp=4, zero=1))
    assert loader_layout(a) == loader_layout(b)
    check_switch(a, b)  # different per-layer strategies, same data-parallel size: allowed
    tp_only = ParallelPlan.uniform(4, 2, L(tp=2, dp=2))  # data-parallel size 2, not 4
    with pytest.raises(ValueError, match=r"data_parallel_size 4 -> 2.*HINT"):
        check_switch(a, tp_only)
    with pytest.raises(ValueError, match=r"global_batch 8 -> 16"):
        check_switch(a.with_(global_batch=8), b.with_(global_batch=16))
    pp2 = ParallelPlan(4, (L(dp=2), L(dp=2)), pp=2, micro_batches=2, embed=L(dp=2), head=L(dp=2))
    with pytest.raises(ValueError, match=r"pp 1 -> 2"):
        check_switch(tp_only, pp2)
    with pytest.raises(ValueError, match=r"only native plans.*HINT"):
        ds = ParallelPlan.uniform(4, 2, L(dp=4, zero=2))
        check_switch(ds, ds.with_(backend="deepspeed"))


def _setup() -> tuple[ModelProfile, HardwareProfile, ParallelPlan]:
    model, hw = ModelProfile.from_shape(SHAPE), HardwareProfile.uniform(1, 64, 80e9)
    best = search(model, hw, 64, 16e9, global_batch=128, top_k=3,
                  space=SearchSpace(pp_degrees=(1,), micro_batches=(1,)))[0]
    return model, hw, best


def test_replan_keeps_the_best_plan_and_moves_off_a_slower_one() -> None:
    """64 simulated ranks. The running plan is the (ideal-runtime) search's best: the native model finds one 2.9 %
    faster (data-parallel ends instead of a tp4 embedding, whose re-layout into the blocks costs a 64-rank
    gather in the backward), below the 10 % bar: no switch. A running plan that recomputes every block moves to
    the plan without checkpointing (+21 %), keeping the loader's layout; with a 25 % bar it stays. With
    collectives calibrated 20x slower no plan of the same loader layout beats the running one."""
    model, hw, best = _setup()
    assert [s.short() for s in best.layers] == ["dp64·zero2"] * 8 and best.embed.short() == "tp4·dp16·zero2"
    same = replan_search(best, model, hw, 16e9, 0.02)
    assert same.plan is None and same.current_s == pytest.approx(10.580e-3, rel=1e-3)
    assert same.best_s == pytest.approx(10.277e-3, rel=1e-3)
    ckpt = best.with_(layers=(L(dp=64, checkpoint=True),) * 8)
    moved = replan_search(ckpt, model, hw, 16e9, 0.02)
    assert moved.plan is not None and loader_layout(moved.plan) == loader_layout(ckpt)
    assert [s.short() for s in moved.plan.layers] == ["dp64·zero2"] * 8
    # (13.03 ms before the bucket queue simulation priced the 268 MB of ZeRO-0 gradients' last 6 MB bucket, not a
    # full 25 MiB one, after backward)
    assert moved.current_s == pytest.approx(12.972e-3, rel=2e-3) and moved.best_s == pytest.approx(10.28e-3, rel=2e-3)
    from lightning_galv.auto import priced_hardware

    cost = GalvatronCostModel(model, priced_hardware(model, hw, 16e9), SearchSpace().default_embed_zero, runtime="native")
    assert cost.evaluate(ckpt).step_time_s == pytest.approx(moved.current_s, rel=1e-9)
    assert replan_search(ckpt, model, hw, 16e9, 0.02, min_gain=0.25).plan is None
    assert "+21%" in moved.describe()
    slow_comm = replan_search(best, model, hw, 16e9, 0.02, Calibration({}, comm_scale=20.0))
    assert slow_comm.plan is None and slow_comm.current_s == pytest.approx(120.8e-3, rel=2e-3)


def test_pristine_copy_holds_no_parameter_memory_and_restores_real_buffers() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            self.register_buffer("table", torch.arange(6.0), persistent=False)  # in no checkpoint
            self.body.register_buffer("rope", torch.linspace(0, 1, 5), persistent=False)

    torch.manual_seed(0)
    net = Net()
    copy = PristineCopy(net)
    assert all(p.device.type == "meta" for c in copy.children.values() for p in c.parameters())
    net.body[0] = torch.nn.Identity()  # what parallelization does to the live model, roughly
    copy.restore_into(net, torch.device("cpu"))
    assert isinstance(net.body[0], torch.nn.Linear) and net.body[0].weight.device.type == "cpu"
    assert torch.equal(net.body.rope, torch.linspace(0, 1, 5))  # a non-persistent buffer keeps its values
    again = PristineCopy.__new__(PristineCopy)
    again.children = copy.children
    again.restore_into(net, torch.device("cpu"))  # the pristine copy is reusable (a second switch)
    assert net.body[2].weight.shape == (2, 8) and net.body[2].weight.requires_grad

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    tied = Tied()
    PristineCopy(tied).restore_into(tied, torch.device("cpu"))
    assert tied.head.weight is tied.emb.weight  # one parameter before and after
