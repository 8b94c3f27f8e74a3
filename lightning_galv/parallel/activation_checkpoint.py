"""Per-layer activation checkpointing.

The block's ``forward`` is replaced (on the instance) by a non-reentrant ``torch.utils.checkpoint``
call around the original. Unlike ``checkpoint_wrapper`` this leaves the module tree and therefore the
state-dict keys untouched, and the block's own module hooks (FSDP2's all-gather of the block, the layout
re-distribution) stay outside the recomputed region, so a recompute does not repeat their collectives. It
does repeat the block's tensor/sequence-parallel collectives up to the last tensor the backward needs
(non-reentrant early stop: not a Megatron block's closing all-reduce); the sharded-layer profiler measures
that share for the cost model (``LayerTypeProfile.recompute_comm``). Hooks of modules *inside* the block --
the FSDP2 states of routed experts under ZeRO-2/3 -- are inside the region. The recompute runs with the
keyed-dropout coordinates and call counts of the original forward (:mod:`lightning_galv.models.dropout`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..models.dropout import replay, snapshot


def _recompute_with_same_coords() -> tuple[Any, Any]:
    """The recompute (in backward, possibly after other micro-batches ran) sees the keyed-dropout
    coordinates and call counts of the original forward, so it redraws the same masks."""
    return nullcontext(), replay(snapshot())


def apply_checkpointing(block: nn.Module) -> None:
    if getattr(block, "_galv_checkpointed", False):
        return
    inner = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=_recompute_with_same_coords, **kwargs)

    block.forward = forward  # type: ignore[method-assign]
    block._galv_checkpointed = True  # type: ignore[attr-defined]
