"""Optimizer steps over parameter groups that mix DTensors and plain tensors.

Why: a hybrid plan leaves some parameters plain (the norm weights of a tensor-parallel block, a data-parallel
embedding, ZeRO-0/1 layers) next to DTensors (tensor-parallel weights, FSDP2 shards), all in the user's one
parameter group. torch's multi-tensor and fused optimizer kernels -- the default for Adam, AdamW and SGD on
CUDA, and what ``foreach=True`` / ``fused=True`` ask for anywhere -- refuse such a list ("got mixed
torch.Tensor and DTensor"); DTensors on different meshes or with different placements may share one call, only
the plain/DTensor mix may not. The parameter groups belong to the user (learning-rate schedulers index them,
checkpoints record them), so every step runs on a split copy of them and the originals are put back.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _split(groups: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]] | None:
    """Groups with each mixed one split in two (DTensors, plain tensors), and for every new group the index of
    the group it came from; None when no group needs splitting. Only optimizers with multi-tensor kernels (a
    ``foreach`` or ``fused`` option) are split: their math is per parameter, so a split changes nothing, while
    an optimizer like L-BFGS treats its one group as a whole."""
    out: list[dict[str, Any]] = []
    origin: list[int] = []
    split = False
    for i, g in enumerate(groups):
        dt = [p for p in g["params"] if isinstance(p, DTensor)]
        if dt and len(dt) < len(g["params"]) and ("foreach" in g or "fused" in g):
            plain = [p for p in g["params"] if not isinstance(p, DTensor)]
            out += [{**g, "params": dt}, {**g, "params": plain}]
            origin += [i, i]
            split = True
        else:
            out.append(g)
            origin.append(i)
    return (out, origin) if split else None


def step_mixed_groups_apart(optimizer: torch.optim.Optimizer) -> None:
    """Patch ``optimizer.step`` (this instance) to step DTensors and plain tensors of a group in separate
    groups; idempotent. Options a step writes into its (copied) group are written back to the user's group."""
    if getattr(optimizer, "_galv_split_groups", False):
        return
    inner = optimizer.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        groups = optimizer.param_groups
        split = _split(groups)
        if split is None:
            return inner(*args, **kwargs)
        parts, origin = split
        optimizer.param_groups = parts
        try:
            return inner(*args, **kwargs)
        finally:
            optimizer.param_groups = groups
            for part, i in zip(parts, origin):
                if part is not groups[i]:
                    for k, v in part.items():
                        if k != "params" and (k not in groups[i] or groups[i][k] is not v):
                            groups[i][k] = v

    # a bound method, as torch's LR schedulers expect when they wrap ``step`` (created after this, too)
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    optimizer._galv_split_groups = True  # type: ignore[attr-defined]
