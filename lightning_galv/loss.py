"""Losses that work on plain and on vocab-sharded logits.

A LightningModule that computes its loss with :func:`cross_entropy` (instead of ``F.cross_entropy``)
may run under plans with ``vocab_parallel_loss=True``: the vocab-parallel head then hands it only this
rank's ``V/tp`` slice of the logits (a ``Shard(-1)`` DTensor), and the loss is computed without ever
materializing the full ``[b, s, V]`` logits or their gradient. On plain tensors the function *is*
``F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ...)``, so the same module runs unchanged
on one device or under any other plan.

The sharded computation follows Megatron-LM's vocab-parallel cross entropy (Shoeybi et al. 2019,
Sec. 3): every rank reduces its slice to per-token statistics, and only those cross the tp group -
one MAX all-reduce of the row maxima and one SUM all-reduce of the (shifted) sum of exponentials and
the target logit (plus the logit sum when label smoothing is on). The softmax of the local slice is
kept for backward, which then needs no communication of its own. We implement it as an autograd
Function rather than with ``torch.distributed.tensor.parallel.loss_parallel``: it supports label
smoothing, keeps fp32 statistics for bf16 logits, and works on the head's batch layout, which may
differ from the loader's (see :class:`~lightning_galv.parallel.redistribute.PendingRelayout`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

__all__ = ["cross_entropy", "full_logits", "is_vocab_sharded"]

_REDUCTIONS = ("mean", "sum", "none")


def is_vocab_sharded(logits: Any) -> bool:
    """True when ``logits`` is a DTensor sharded over its last (vocabulary) dimension."""
    if not isinstance(logits, DTensor):
        return False
    return any(p.is_shard() and p.dim in (-1, logits.ndim - 1) for p in logits.placements)  # type: ignore[attr-defined]


def _pending(logits: DTensor) -> Any:
    from .parallel.redistribute import PENDING_ATTR, PendingRelayout

    tag = getattr(logits, PENDING_ATTR, None)
    if not isinstance(tag, PendingRelayout):
        raise ValueError("vocab-sharded logits without the head's layout tag: the loss only accepts the head's "
                         "output as returned (an operation on the DTensor, e.g. slicing or .float(), drops the tag "
                         "that says which samples this rank holds). HINT: pass the model's output directly and "
                         "shape the targets instead, or call lightning_galv.loss.full_logits(logits) first.")
    if logits.device_mesh.ndim != 1 or len(logits.placements) != 1:
        raise ValueError(f"vocab-sharded logits on a {logits.device_mesh.ndim}-D mesh with placements "
                         f"{logits.placements}: the loss expects the head's 1-D tp mesh with Shard(-1). HINT: "
                         "use the output of a head parallelized by lightning_galv.")
    return tag


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """Plain full-vocabulary logits in the loader's batch layout (what the head returns by default).

    Differentiable, for the rare loss that needs every logit; it gathers ``b*s*V`` values and so gives up
    the memory saving. Plain tensors are returned unchanged.
    """
    if not is_vocab_sharded(logits):
        return logits
    assert isinstance(logits, DTensor)
    tag = _pending(logits)
    return tag.to_data(logits.full_tensor())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of ``[N, V/tp]`` local logit slices (Megatron-LM, Shoeybi et al. 2019).

    Returns ``[N]`` fp32 losses, identical on every rank of ``group`` (0 for ignored tokens). The
    gradient of the local slice is ``g * (softmax - (1 - eps) * onehot - eps / V)``, all local.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, target: torch.Tensor, start: int, vocab: int,  # type: ignore[override]
                ignore_index: int, eps: float, group: dist.ProcessGroup) -> torch.Tensor:
        x = local.float()
        width = x.shape[-1]
        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = x - row_max.unsqueeze(-1)  # a new tensor: `local` is left untouched
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + width)
        idx = (target - start).clamp(0, width - 1)
        picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine
        stats = [shifted.exp().sum(-1), picked]
        if eps > 0:
            stats.append(shifted.sum(-1))
        stacked = torch.stack(stats)
        dist.all_reduce(stacked, group=group)
        log_z = stacked[0].log()  # log sum_c exp(x_c - max), over the whole vocabulary
        loss = log_z - stacked[1]
        if eps > 0:  # PyTorch's label smoothing: (1 - eps) * nll + eps * mean_c(-log p_c)
            loss = (1.0 - eps) * loss + eps * (log_z - stacked[2] / vocab)
        loss = loss * valid
        softmax = shifted.sub_(log_z.unsqueeze(-1)).exp_()  # reuse the buffer: the only [N, V/tp] tensor kept
        ctx.save_for_backward(softmax, idx, mine, valid)
        ctx.eps, ctx.vocab, ctx.dtype = eps, vocab, local.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        softmax, idx, mine, valid = ctx.saved_tensors
        g = softmax.clone()  # the saved softmax stays intact (retain_graph)
        if ctx.eps > 0:
            g.sub_(ctx.eps / ctx.vocab)
        g.scatter_add_(-1, idx.unsqueeze(-1), (-(1.0 - ctx.eps) * mine.to(g.dtype)).unsqueeze(-1))
        g.mul_((grad * valid).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None, None, None


def _check_args(logits: Any, targets: Any, ignore_index: Any, label_smoothing: Any, reduction: Any) -> None:
    if not isinstance(logits, torch.Tensor) or not torch.is_floating_point(logits):
        raise TypeError(f"logits of type {type(logits).__name__}"
                        f"{' and dtype ' + str(logits.dtype) if isinstance(logits, torch.Tensor) else ''}: "
                        "must be a floating-point tensor [..., vocab]. HINT: pass the model's output.")
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
        raise TypeError(f"targets of type {type(targets).__name__}"
                        f"{' and dtype ' + str(targets.dtype) if isinstance(targets, torch.Tensor) else ''}: "
                        "must be an integer tensor of class indices. HINT: targets.long().")
    if logits.dim() < 2:
        raise ValueError(f"logits of shape {tuple(logits.shape)}: need at least [N, vocab]. HINT: the last "
                         "dimension is the vocabulary.")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: must be one of {_REDUCTIONS}. HINT: reduction='mean'.")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r}: must be a number in [0, 1]. HINT: 0.0 (off) or e.g. 0.1.")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index={ignore_index!r}: must be an int. HINT: -100 (PyTorch's default).")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """Token-level cross entropy of ``logits [..., V]`` against ``targets [...]``.

    On a plain tensor this is exactly ``F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1),
    ignore_index=..., label_smoothing=..., reduction=...)`` (``reduction="none"`` returns the flat
    per-token losses). On the vocab-sharded logits of a head under ``vocab_parallel_loss=True`` it computes
    the same value on ``V/tp`` logits per rank: targets and per-token losses - not logits - are moved
    between the head's and the loader's batch layouts, and the reduction happens in the loader's layout,
    so the result is what ``F.cross_entropy`` on this rank's full logits would give (``mean`` divides by
    the number of non-ignored tokens of this rank's batch shard).
    """
    _check_args(logits, targets, ignore_index, label_smoothing, reduction)
    if not is_vocab_sharded(logits):
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        v = logits.shape[-1]
        return F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1), ignore_index=ignore_index,
                               label_smoothing=float(label_smoothing), reduction=reduction)
    assert isinstance(logits, DTensor)
    tag = _pending(logits)
    vocab = logits.shape[-1]
    local = logits.to_local()  # [b_head, ..., V/tp], differentiable
    if targets.shape[1:] != local.shape[1:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)} for logits of shape {tuple(logits.shape)}: "
                         "the targets must have the logits' shape without the vocabulary dimension. HINT: for "
                         "next-token prediction pass logits of x = batch[:, :-1] and targets batch[:, 1:].")
    head_targets = tag.to_head(targets)
    if head_targets.shape != local.shape[:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)}: after the batch re-layout to the head's "
                         f"layout they have shape {tuple(head_targets.shape)}, the local logits "
                         f"{tuple(local.shape[:-1])}. HINT: pass this rank's loader batch shard as targets.")
    bad = (head_targets != ignore_index) & ((head_targets < 0) | (head_targets >= vocab))
    if bool(bad.any()):
        raise ValueError(f"targets with values {sorted(set(head_targets[bad].tolist()))[:5]}: class indices must "
                         f"lie in [0, {vocab}) or equal ignore_index={ignore_index}. HINT: check the tokenizer's "
                         "vocabulary size against the model's.")
    mesh = logits.device_mesh
    tp, tp_rank = mesh.size(), mesh.get_local_rank()
    width = vocab // tp
    if local.shape[-1] != width:
        raise ValueError(f"vocab-sharded logits with a local slice of {local.shape[-1]} for vocab {vocab} over "
                         f"tp={tp}: slices must be equal. HINT: pad the vocabulary to a multiple of {tp}.")
    flat_t = head_targets.reshape(-1).long()
    per_token = _VocabParallelCrossEntropy.apply(local.reshape(-1, width), flat_t, tp_rank * width, vocab,
                                                 ignore_index, float(label_smoothing), mesh.get_group())
    per_token = tag.to_data(per_token.view(head_targets.shape)).reshape(-1)  # [N] in the loader's layout
    # the dtype F.cross_entropy would return: fp32 under autocast (it is an fp32 autocast op), else the logits'
    dtype = torch.float32 if torch.is_autocast_enabled(local.device.type) else logits.dtype
    if reduction == "none":
        return per_token.to(dtype)
    total = per_token.sum()
    if reduction == "sum":
        return total.to(dtype)
    count = (targets.reshape(-1) != ignore_index).sum()
    return (total / count).to(dtype)
