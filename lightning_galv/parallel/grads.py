"""Gradient norm and clipping over a hybrid-parallel model, equal to one process's.

A parameter of a parallelized model can be a plain tensor (replicated over some ranks) or a DTensor
whose placements mix ``Replicate``, ``Shard``, FSDP2's ``_StridedShard`` (a TP shard re-sharded on the
same dim by ZeRO-2/3) and ``Partial`` (a summand of the true value) on each mesh dim. Two rules keep
the global norm exact whatever the layout:

* **Partial first**: a norm of summands is not the norm of their sum, so any ``Partial`` mesh dim of a
  gradient is reduced to ``Replicate`` before it is measured or clamped.
* **Count every element once**: every rank of a pipeline stage holds one piece of every parameter of
  that stage. A piece is replicated on ``stage_size / pieces`` ranks, where ``pieces`` is the product of
  the mesh sizes of the *sharded* dims (``Shard`` and ``_StridedShard`` alike), times the expert-parallel
  degree for expert parameters (an expert lives on 1/ep of its layer's ranks). Each rank adds its local
  ``sum |g|^p`` divided by that replica count; one all-reduce over the world adds the stages.

Value clipping is element-wise, so it only needs the first rule.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .data_parallel import local

EP_ATTR = "_galv_expert_parallel"  # set by parallel/expert.py on expert parameters: the layer's ep degree


def is_sharded(placement: object) -> bool:
    """True for ``Shard`` and FSDP2's ``_StridedShard`` (whose ``is_shard()`` answers False)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return bool(getattr(placement, "is_shard", lambda: False)()) or isinstance(placement, _StridedShard)


def shard_count(t: torch.Tensor) -> int:
    """Into how many distinct pieces the full tensor is cut across ranks (1 for a plain tensor)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return 1
    mesh = t.device_mesh  # type: ignore[attr-defined]
    n = 1
    for i, pl in enumerate(placements):
        if is_sharded(pl):
            n *= mesh.size(i)
    return n


def resolve_partial(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with every ``Partial`` mesh dim reduced to ``Replicate`` (a collective on that dim)."""
    placements = getattr(grad, "placements", None)
    if placements is None or not any(pl.is_partial() for pl in placements):
        return grad
    from torch.distributed.tensor import Replicate

    wanted = tuple(Replicate() if pl.is_partial() else pl for pl in placements)
    return grad.redistribute(grad.device_mesh, wanted)  # type: ignore[attr-defined]


def _resolved_grads(params: Iterable[nn.Parameter]) -> list[tuple[nn.Parameter, torch.Tensor]]:
    out = []
    for p in params:
        if p.grad is None:
            continue
        g = resolve_partial(p.grad)
        if g is not p.grad:
            p.grad = g
        out.append((p, g))
    return out


def device_of(params: Iterable[nn.Parameter]) -> torch.device:
    for p in params:
        return local(p).device
    return torch.device("cpu")


@torch.no_grad()
def grad_norm(params: list[nn.Parameter], stage_size: int, norm_type: float = 2.0) -> torch.Tensor:
    """Global ``norm_type``-norm of the gradients of ``params`` over every mesh and pipeline stage.

    Collective over the default group: every rank must call it with its stage's parameters, in the
    same order as the other ranks of its stage (``Partial`` resolution communicates per parameter).
    """
    norm_type = float(norm_type)
    if norm_type <= 0 or math.isnan(norm_type):
        raise ValueError(f"norm_type={norm_type}: must be > 0 (or inf). HINT: use 2.0 for the usual L2 norm.")
    total = torch.zeros((), dtype=torch.float64)
    for p, g in _resolved_grads(params):
        copies = stage_size // (shard_count(g) * getattr(p, EP_ATTR, 1))
        t = local(g).detach().to(torch.float64)
        if not t.numel():
            continue
        if math.isinf(norm_type):
            total = torch.maximum(total, t.abs().max().cpu())
        else:
            total += t.abs().pow(norm_type).sum().cpu() / copies
    total = total.to(device_of(params))
    if math.isinf(norm_type):
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return total
    dist.all_reduce(total)
    return total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], stage_size: int, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s rule)."""
    norm = grad_norm(params, stage_size, norm_type)
    coef = float(max_norm) / (float(norm) + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                local(p.grad).mul_(coef)
    return norm


@torch.no_grad()
def clip_grad_value_(params: list[nn.Parameter], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` (element-wise, so shard-local)."""
    clip_value = float(clip_value)
    if clip_value < 0 or math.isnan(clip_value):
        raise ValueError(f"gradient_clip_val={clip_value}: value clipping needs a bound >= 0. "
                         "HINT: e.g. gradient_clip_val=0.5 with gradient_clip_algorithm='value'.")
    for _, g in _resolved_grads(params):
        local(g).clamp_(-clip_value, clip_value)
