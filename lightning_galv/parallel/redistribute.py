"""Activation re-layout between layers whose strategies differ (the heart of per-layer plans).

Between blocks an activation is a plain local tensor ``[local_batch, seq, hidden]``: rank ``r`` holds
batch shard ``i`` of ``n`` equal shards (``(i, n) = layout.batch_shard(strategy, r)``), replicated over
the ranks of its tp group. When block ``k+1`` shards the batch differently from block ``k`` the
activation must be re-laid-out, and its gradient must flow back exactly.

Forward: gather the shards over the stage (one copy of each), take the shard the next layer wants; when
the wanted shard lies inside the one already held, this is a local slice with no communication.
Backward: every rank holds the *full* gradient of its shard (the boundary contract of
``parallel.tensor``), so replicas are identical: gather the gradient shards, take one replica of each
and slice out the shard this rank fed forward. Taking one replica (rather than summing) is what keeps
a tp group's identical copies from being counted tp times. When the shard this rank fed forward lies
inside the one whose gradient it holds (the layout got coarser: dp4 -> tp4, the loader's dp4 -> tp2 dp2),
that is again a local slice: gathering would only bring copies of what every rank already has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..layout import RankLayout
from ..plan import LayerStrategy


@dataclass(frozen=True)
class BatchLayout:
    """Which batch shard each rank of a stage holds: ``owner[i]`` = shard index of stage-local rank i."""

    shards: int
    owner: tuple[int, ...]

    @classmethod
    def of(cls, layout: RankLayout, s: LayerStrategy, stage: int) -> "BatchLayout":
        ranks = layout.stage_ranks(stage)
        return cls(s.dp, tuple(layout.batch_shard(s, r)[0] for r in ranks))

    def first_holder(self, shard: int) -> int:
        return self.owner.index(shard)


def _gather_full(local: torch.Tensor, src: BatchLayout, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All shards of ``src`` concatenated along dim 0 (one replica each) -> ``[B, ...]``."""
    parts = [torch.empty_like(local) for _ in src.owner]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat([parts[src.first_holder(i)] for i in range(src.shards)], dim=0)


def _take(full: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
    size = full.shape[0] // shards
    return full[shard * size:(shard + 1) * size]


def _nested(src: BatchLayout, dst: BatchLayout) -> bool:
    """True when on *every* rank the dst shard lies inside the src shard (a decision all ranks share,
    so either all of them communicate or none does)."""
    if dst.shards % src.shards:
        return False
    k = dst.shards // src.shards
    return all(d // k == s for s, d in zip(src.owner, dst.owner))


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, src: BatchLayout, dst: BatchLayout, me: int,  # type: ignore[override]
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.src, ctx.dst, ctx.me, ctx.group = src, dst, me, group
        ctx.batch = x.shape[0] * src.shards
        want = dst.owner[me]
        if _nested(src, dst):
            # every rank's wanted (finer) shard is inside the one it holds: slice locally, no communication
            k = dst.shards // src.shards
            return _take(x, want % k, k).clone()
        # clone: a slice would be a view of the whole gathered batch (kept alive, and FSDP2 warns when a
        # wrapped unit's output is a view); the copy is one shard and frees the gathered batch
        return _take(_gather_full(x, src, group), want, dst.shards).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if _nested(ctx.dst, ctx.src):  # this rank's src shard lies inside the dst shard it has the gradient of
            k = ctx.src.shards // ctx.dst.shards
            return _take(grad, ctx.src.owner[ctx.me] % k, k).clone(), None, None, None, None
        full = _gather_full(grad.contiguous(), ctx.dst, ctx.group)  # [B, ...] one replica per shard
        return _take(full, ctx.src.owner[ctx.me], ctx.src.shards).contiguous(), None, None, None, None


def redistribute(x: torch.Tensor, src: BatchLayout, dst: BatchLayout, stage_rank: int,
                 group: dist.ProcessGroup | None) -> torch.Tensor:
    """Move ``x`` from batch layout ``src`` to ``dst`` (identity when they are equal)."""
    if src == dst:
        return x
    if x.shape[0] * src.shards % dst.shards:
        raise ValueError(f"batch of {x.shape[0] * src.shards} samples: cannot split into {dst.shards} "
                         "equal shards for the next layer. HINT: make the global batch (per micro-batch) a "
                         "multiple of every layer's dp degree.")
    if not x.requires_grad or not torch.is_floating_point(x):
        with torch.no_grad():
            return _Redistribute.apply(x, src, dst, stage_rank, group)
    return _Redistribute.apply(x, src, dst, stage_rank, group)


def add_input_redistribution(module: nn.Module, src: BatchLayout, dst: BatchLayout, stage_rank: int,
                             group: dist.ProcessGroup | None) -> None:
    """Re-lay-out the first positional input of ``module`` before it runs."""
    if src == dst:
        return

    def hook(_mod: nn.Module, args: tuple) -> tuple:
        if not args:
            return args
        return (redistribute(args[0], src, dst, stage_rank, group), *args[1:])

    module.register_forward_pre_hook(hook, prepend=True)  # before TP/FSDP input hooks


PENDING_ATTR = "_galv_pending_relayout"  # set on vocab-sharded head logits (see PendingRelayout)


@dataclass(frozen=True)
class PendingRelayout:
    """A batch re-layout that vocab-sharded logits still owe the loss.

    Vocab-sharded logits cannot be moved to the loader's batch layout: the ranks of the head's tp group
    hold *different* vocabulary slices of the same samples, while the loader's layout may give those
    ranks different samples, and a per-token loss needs every slice of a sample inside one tp group.
    So the head leaves its logits in its own batch layout and tags them with this record; the loss
    (:func:`lightning_galv.loss.cross_entropy`) moves the small tensors instead - the targets from the
    loader's layout to the head's (``to_head``), and the per-token losses back (``to_data``, exact in
    backward like every other re-layout) - before reducing them in the loader's layout. ``src is None``
    means the two layouts coincide.
    """

    src: BatchLayout | None = None  # the head's batch layout
    dst: BatchLayout | None = None  # the loader's batch layout
    stage_rank: int = 0
    group: Any = None

    def to_data(self, x: torch.Tensor) -> torch.Tensor:
        """Head layout -> loader layout (differentiable)."""
        if self.src is None or self.dst is None:
            return x
        return redistribute(x, self.src, self.dst, self.stage_rank, self.group)

    def to_head(self, x: torch.Tensor) -> torch.Tensor:
        """Loader layout -> head layout."""
        if self.src is None or self.dst is None:
            return x
        return redistribute(x, self.dst, self.src, self.stage_rank, self.group)


def add_output_redistribution(module: nn.Module, src: BatchLayout, dst: BatchLayout, stage_rank: int,
                              group: dist.ProcessGroup | None) -> None:
    """Re-lay-out the (tensor) output of ``module`` after it runs.

    Plain tensors are moved at once. Output already tagged with a :class:`PendingRelayout` (vocab-sharded
    logits from a head under ``vocab_parallel_loss``) is left where it is and its tag records the move,
    which the loss performs on the targets and per-token losses instead.
    """
    if src == dst:
        return

    def hook(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        if isinstance(getattr(out, PENDING_ATTR, None), PendingRelayout):
            setattr(out, PENDING_ATTR, PendingRelayout(src, dst, stage_rank, group))
            return out
        return redistribute(out, src, dst, stage_rank, group)

    module.register_forward_hook(hook)
