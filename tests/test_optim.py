"""Optimizer steps over DTensor parameters, alone or mixed with plain tensors (parallel/optim.py), on one
gloo rank.

The multi-rank proof is in test_parity.py (``adam_foreach_*``, ``adamw_fused_*``, ``sgd_foreach_*`` and the
random plans' optimizers over tensor-parallel, FSDP2 and fully sharded expert DTensors, uneven shards
included): those train like one process. Here: elementwise optimizers step DTensors on their local shards with
the same bits as DTensor's own ops and without a single DTensor op, their state stays DTensors of the
parameter's layout (checkpoints), other optimizers and mismatched gradient layouts keep DTensor's path, the mix
really crashes torch's multi-tensor and fused kernels, the split step equals the per-tensor loop, the user's
groups and schedulers are untouched, and an optimizer without multi-tensor kernels (L-BFGS) is left alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from lightning_galv.parallel.optim import ELEMENTWISE, _split, step_on_local_shards


def _params() -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(mixed: a DTensor weight beside plain ones, the same values all plain) with equal gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(6, 4, generator=g), torch.randn(4, generator=g), torch.randn(3, 4, generator=g)]
    grads = [torch.randn(v.shape, generator=g) for v in values]
    mixed = [torch.nn.Parameter(distribute_tensor(values[0].clone(), mesh, [Shard(0)])),
             torch.nn.Parameter(values[1].clone()), torch.nn.Parameter(values[2].clone())]
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    for p, q, gr in zip(mixed, plain, grads):
        p.grad = distribute_tensor(gr.clone(), mesh, [Shard(0)]) if hasattr(p, "placements") else gr.clone()
        q.grad = gr.clone()
    return mixed, plain


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


KERNELS: dict[str, Callable[[list, dict], torch.optim.Optimizer]] = {
    "adam_foreach": lambda ps, kw: torch.optim.Adam(ps, lr=1e-2, foreach=True, **kw),
    "adamw_fused": lambda ps, kw: torch.optim.AdamW(ps, lr=1e-2, fused=True, **kw),
    "sgd_foreach": lambda ps, kw: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, foreach=True, **kw),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_mixed_groups_crash_the_kernels_and_step_apart_like_the_loop(one_rank_group: None, kernel: str) -> None:
    mixed, plain = _params()
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        KERNELS[kernel](mixed, {}).step()  # what a CUDA user's default Adam met before the runtime split the groups
    mixed, plain = _params()
    opt = KERNELS[kernel](mixed, {})
    step_on_local_shards(opt)
    step_on_local_shards(opt)  # idempotent
    ref = KERNELS[kernel](plain, {})
    sched, ref_sched = (torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in (opt, ref))
    groups, lr0 = opt.param_groups, opt.param_groups[0]["lr"]
    for _ in range(3):
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
    assert opt.param_groups is groups and len(groups) == 1 and groups[0]["params"] == mixed
    assert groups[0]["lr"] == ref.param_groups[0]["lr"] == lr0 / 8  # the scheduler still drives the user's group
    for p, q in zip(mixed, plain):
        torch.testing.assert_close(_local(p.detach()), q.detach(), rtol=1e-6, atol=1e-7)
    assert set(opt.state) == set(mixed)  # state stays keyed by the user's parameters


def test_only_mixed_groups_of_multi_tensor_optimizers_are_split(one_rank_group: None) -> None:
    mixed, plain = _params()
    adam = torch.optim.Adam([{"params": mixed}, {"params": plain, "lr": 0.5}], foreach=True)
    parts, origin = _split(adam.param_groups)  # type: ignore[misc]
    assert origin == [0, 0, 1] and [len(g["params"]) for g in parts] == [1, 2, 3]
    assert parts[2] is adam.param_groups[1] and parts[0]["lr"] == parts[1]["lr"] == 1e-3
    assert _split(torch.optim.Adam(plain, foreach=True).param_groups) is None
    assert _split(torch.optim.LBFGS(mixed).param_groups) is None  # one group as a whole: not ours to split


def test_schedulers_wrap_the_patched_steps(one_rank_group: None) -> None:
    """torch's LR schedulers re-wrap ``optimizer.step`` as a bound method: a scheduler made after the runtime
    patched the step (this split, ZeRO-1's owner step) must still work and count the steps."""
    from lightning_galv.parallel.data_parallel import OptimizerStateSharding

    mixed, _ = _params()
    opt = torch.optim.Adam(mixed, lr=1e-2, foreach=True)
    step_on_local_shards(opt)
    zero1 = OptimizerStateSharding()
    zero1.add(mixed[1:], [0], dist.group.WORLD)  # this rank owns the plain parameters
    zero1.wrap(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    opt.step()
    sched.step()  # warns if the optimizer's step was not seen
    assert opt.param_groups[0]["lr"] == 5e-3 and getattr(opt, "_opt_called", False)


class _DTensorOps(torch.overrides.TorchFunctionMode):
    """Counts torch calls that take a DTensor argument (each one goes through DTensor's dispatcher); reading an
    attribute such as ``.grad`` or metadata such as ``.stride()`` is not such a call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
        self.calls += getattr(func, "__name__", "") not in ("__get__", "stride", "size", "dim") and any(isinstance(a, DTensor) for a in flat)
        return func(*args, **kwargs)


ELEMENTWISE_CASES: dict[str, Callable[[list], torch.optim.Optimizer]] = {
    "sgd_nesterov_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, foreach=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.01),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-1, lr_decay=0.01),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
}


def _dtensor_params(seed: int = 0) -> list[torch.nn.Parameter]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(6, 4, generator=g), mesh, [Shard(0)])),
            torch.nn.Parameter(distribute_tensor(torch.randn(5, generator=g), mesh, [Replicate()])),
            torch.nn.Parameter(torch.randn(3, 2, generator=g))]  # a plain one beside them


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    from torch.distributed.tensor import DTensor

    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        full = torch.randn(p.shape, generator=g)
        p.grad = (DTensor.from_local(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)


@pytest.mark.parametrize("case", sorted(ELEMENTWISE_CASES))
def test_elementwise_optimizers_step_local_shards_bit_for_bit(one_rank_group: None, case: str) -> None:
    """Three steps on the shards equal three steps through DTensor's ops bit for bit, run no DTensor op, and
    leave state keyed by the user's parameters with DTensors of each parameter's layout wherever DTensor's own
    step keeps DTensors (scalars such as Adam's step count stay plain in both)."""
    from torch.distributed.tensor import DTensor

    ours, ref = _dtensor_params(), _dtensor_params()
    # the reference: DTensor's own ops, DTensors and the plain tensor in groups of their own (fused kernels
    # refuse the mix); the math is per parameter either way
    opt, ref_opt = ELEMENTWISE_CASES[case](ours), ELEMENTWISE_CASES[case]([{"params": ref[:2]}, {"params": ref[2:]}])
    assert type(opt) in ELEMENTWISE
    step_on_local_shards(opt)
    counter = _DTensorOps()
    for step in range(3):
        _set_grads(ours, step)
        _set_grads(ref, step)
        with counter:
            opt.step()
        ref_opt.step()
    assert counter.calls == 0
    for p, q in zip(ours, ref):
        assert torch.equal(_local(p.detach()), _local(q.detach()))
        assert set(opt.state[p]) == set(ref_opt.state[q])
        for k, v in ref_opt.state[q].items():
            mine = opt.state[p][k]
            assert type(mine) is type(v), (k, type(mine), type(v))
            if isinstance(v, DTensor):
                assert mine.placements == v.placements and mine.shape == v.shape
            assert torch.equal(_local(mine), _local(v)) if isinstance(v, torch.Tensor) else mine == v
    assert set(opt.state) == set(ours)
    sd = copy.deepcopy(opt.state_dict())  # what a checkpoint records; a fresh optimizer resumes from it identically
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    fresh = ELEMENTWISE_CASES[case](fresh_params)
    step_on_local_shards(fresh)
    fresh.load_state_dict(sd)
    for o, ps in ((opt, ours), (fresh, fresh_params)):
        _set_grads(ps, 3)
        o.step()
    for p, q in zip(ours, fresh_params):
        assert torch.equal(_local(p.detach()), _local(q.detach()))


def test_other_optimizers_and_mismatched_gradients_keep_dtensor_steps(one_rank_group: None) -> None:
    """A subclass may change the math and a Partial gradient's local values are not the shard's gradient:
    both step through DTensor's ops, and still equal the plain loop. A closure runs once, before the shards."""
    from torch.distributed.tensor import DTensor, Partial

    class MySGD(torch.optim.SGD):
        pass

    params = _dtensor_params()
    opt = MySGD(params, lr=0.1, momentum=0.9)
    step_on_local_shards(opt)
    _set_grads(params, 0)
    counter = _DTensorOps()
    with counter:
        opt.step()
    assert counter.calls > 0 and isinstance(opt.state[params[0]]["momentum_buffer"], DTensor)

    ours, ref = _dtensor_params(), _dtensor_params()
    opt, ref_opt = torch.optim.Adam(ours, lr=1e-2), torch.optim.Adam(ref, lr=1e-2)
    step_on_local_shards(opt)
    for ps in (ours, ref):
        _set_grads(ps, 0)
        g = ps[1].grad
        ps[1].grad = DTensor.from_local(g.to_local(), g.device_mesh, [Partial()])  # one rank: same values
    counter = _DTensorOps()
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        return torch.tensor(2.0)

    with counter:
        loss = opt.step(closure)
    ref_opt.step()
    assert loss.item() == 2.0 and len(calls) == 1
    assert counter.calls > 0  # the Partial-gradient parameter took DTensor's path
    for p, q in zip(ours, ref):
        assert torch.equal(_local(p.detach()), _local(q.detach()))


def test_closure_optimizers_keep_their_closure_and_failed_steps_leave_no_trace(one_rank_group: None) -> None:
    """L-BFGS evaluates its closure several times per step: the patch hands it the closure (it crashed when the
    patch ran the closure itself; L-BFGS takes no DTensors, its one ``cat`` of all gradients refuses a mix). A step that raises leaves the user's groups, the gradients and the state as
    they were: no shard keys behind."""
    _, plain = _params()
    mixed = [torch.nn.Parameter(p.detach().clone()) for p in plain]  # plain too: L-BFGS flattens all in one cat
    target = [torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) for p in plain]
    opt, ref = torch.optim.LBFGS(mixed, lr=0.5, max_iter=4), torch.optim.LBFGS(plain, lr=0.5, max_iter=4)
    step_on_local_shards(opt)
    calls = []

    def closure_of(ps: list, count: bool) -> Callable[[], torch.Tensor]:
        def closure() -> torch.Tensor:
            calls.append(count)
            for p in ps:
                p.grad = None
            loss = sum(((_local(p) - t) ** 2).sum() for p, t in zip(ps, target))
            loss.backward()
            return loss
        return closure

    loss = opt.step(closure_of(mixed, True))
    ref_loss = ref.step(closure_of(plain, False))
    assert calls.count(True) > 1 and torch.equal(loss.detach(), ref_loss.detach())
    for p, q in zip(mixed, plain):
        torch.testing.assert_close(_local(p.detach()), q.detach(), rtol=1e-6, atol=1e-7)

    from torch.distributed.tensor import DTensor

    ours = _dtensor_params()
    opt = torch.optim.Adam(ours, lr=1e-2)
    step_on_local_shards(opt)
    _set_grads(ours, 0)
    opt.step()
    before = {p: {k: _local(v).clone() for k, v in opt.state[p].items()} for p in ours}
    groups = opt.param_groups
    _set_grads(ours, 1)
    hook = opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    hook.remove()
    assert opt.param_groups is groups and groups[0]["params"] == ours and set(opt.state) == set(ours)
    for p in ours:
        assert all(torch.equal(_local(opt.state[p][k]), v) for k, v in before[p].items())
        assert p.grad is not None and isinstance(p.grad, DTensor) == isinstance(p, DTensor)
