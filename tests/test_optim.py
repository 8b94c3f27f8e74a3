"""Optimizer steps over groups that mix DTensors and plain tensors (parallel/optim.py), on one gloo rank.

The multi-rank proof is in test_parity.py (``adam_foreach_*``, ``adamw_fused_*``, ``sgd_foreach_*`` and the
random plans' optimizers): those train like one process. Here: the mix really crashes torch's multi-tensor and
fused kernels, the split step equals the per-tensor loop, the user's groups and schedulers are untouched, and
an optimizer without multi-tensor kernels (L-BFGS) is left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from lightning_galv.parallel.optim import _split, step_mixed_groups_apart


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
    step_mixed_groups_apart(opt)
    step_mixed_groups_apart(opt)  # idempotent
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
    step_mixed_groups_apart(opt)
    zero1 = OptimizerStateSharding()
    zero1.add(mixed[1:], [0], dist.group.WORLD)  # this rank owns the plain parameters
    zero1.wrap(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    opt.step()
    sched.step()  # warns if the optimizer's step was not seen
    assert opt.param_groups[0]["lr"] == 5e-3 and getattr(opt, "_opt_called", False)
