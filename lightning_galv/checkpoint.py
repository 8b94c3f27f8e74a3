"""Sharded (DCP folder) and full (one file) checkpoints for parallelized models.

Keys are the unwrapped model's: TP, FSDP2 and our checkpointing leave module names alone, and
``torch.distributed.checkpoint.state_dict`` gathers DTensors of any mesh into full tensors. ZeRO-1
optimizer state lives on one owner per parameter, so it is consolidated before saving and re-sharded
after loading; a checkpoint therefore never depends on the plan that wrote it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from .parallel.parallelize import ParallelRuntime

META_FILE = "meta.pt"


def _options(full: bool, **kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=True, **kw)


def model_state(model: nn.Module, full: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full))


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, runtime: "ParallelRuntime",
                    full: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    runtime.zero1.consolidate(optimizer)
    try:
        return get_optimizer_state_dict(model, optimizer, options=_options(full))
    finally:
        runtime.zero1.reshard(optimizer)


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def save_sharded(checkpoint: dict[str, Any], path: Path, is_rank_zero: bool) -> None:
    import torch.distributed.checkpoint as dcp

    if path.is_file() and is_rank_zero:
        path.unlink()
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    state = {"state_dict": checkpoint.pop("state_dict")}
    for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = opt_state
    dcp.save(state, checkpoint_id=path)
    if is_rank_zero:
        torch.save(checkpoint, path / META_FILE)


def load(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], runtime: "ParallelRuntime",
         strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
    """Load weights and optimizer states into the parallelized model; return the remaining metadata."""
    with runtime.zero1.unsharded_steps(optimizers):
        return _load(path, model, optimizers, runtime, strict, weights_only)


def _load(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], runtime: "ParallelRuntime",
          strict: bool, weights_only: bool | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if is_sharded(path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        msd = get_model_state_dict(model)
        box = {"state_dict": msd}
        dcp.load(box, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
        set_model_state_dict(model, box["state_dict"], options=_options(False, strict=strict))
        for i, opt in enumerate(optimizers):
            osd = get_optimizer_state_dict(model, opt)
            obox = {f"optimizer_{i}": osd}
            # parameters that never received a gradient have no saved state: allow the partial load
            dcp.load(obox, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
            set_optimizer_state_dict(model, opt, obox[f"optimizer_{i}"])
            runtime.zero1.reshard(opt)
        meta = torch.load(path / META_FILE, weights_only=weights_only if weights_only is not None else False)
        return meta
    if path.is_file():
        checkpoint = torch.load(path, map_location="cpu", mmap=True,
                                weights_only=weights_only if weights_only is not None else False)
        if "state_dict" not in checkpoint:
            raise ValueError(f"checkpoint {str(path)!r}: has no 'state_dict'. HINT: pass a checkpoint written by "
                             "Trainer.save_checkpoint or ModelCheckpoint.")
        set_model_state_dict(model, checkpoint.pop("state_dict"), options=_options(True, strict=strict))
        for opt, osd in zip(optimizers, checkpoint.pop("optimizer_states", [])):
            set_optimizer_state_dict(model, opt, osd, options=_options(True))
            runtime.zero1.reshard(opt)
        return checkpoint
    raise ValueError(f"checkpoint path {str(path)!r}: neither a DCP folder nor a checkpoint file. "
                     "HINT: pass the folder/file ModelCheckpoint wrote (or ckpt_path='last').")
