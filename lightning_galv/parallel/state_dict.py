"""State dicts of parallelized models: sharded (DCP folder) and full (one file) checkpoints.

The native runtimes call these with the two pieces of their state that matter here: the ZeRO-1
optimizer-state ownership (``zero1``) and, for pipelines, the driver whose group connects the stages.

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
    from .data_parallel import OptimizerStateSharding

META_FILE = "meta.pt"


def _options(full: bool, **kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    kw.setdefault("cpu_offload", True)
    return StateDictOptions(full_state_dict=full, **kw)


def model_state(model: nn.Module, full: bool, pipeline: Any = None, experts: bool = False) -> dict[str, Any]:
    """``experts``: expert-parallel layers hold different experts on different ranks (gathered for ``full``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if full and (pipeline is not None or experts):
        # every stage (every EP rank) holds other keys: gather their full tensors to global rank 0
        local_sd = get_model_state_dict(model, options=_options(True, cpu_offload=False))
        parts = _gather_parts({k: v.detach().cpu() for k, v in local_sd.items()}, pipeline, experts)
        return {k: v for part in parts for k, v in part.items()} if parts else {}
    return get_model_state_dict(model, options=_options(full))


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, zero1: "OptimizerStateSharding",
                    full: bool, pipeline: Any = None, experts: bool = False) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    zero1.consolidate(optimizer)
    try:
        if full and (pipeline is not None or experts):
            osd = _to_cpu(get_optimizer_state_dict(model, optimizer, options=_options(True, cpu_offload=False)))
            parts = _gather_parts(osd, pipeline, experts)
            if not parts:
                return {}
            merged: dict[str, Any] = {"state": {}, "param_groups": [dict(g) for g in parts[0]["param_groups"]]}
            for g in merged["param_groups"]:
                g["params"] = []
            for part in parts:
                merged["state"].update(part["state"])
                for g, pg in zip(merged["param_groups"], part["param_groups"]):
                    g["params"] += [p for p in pg["params"] if p not in g["params"]]  # replicas repeat keys
            return merged
        # sharded: flattened keys ("param_groups.<fqn>.lr") so each stage's groups survive DCP's
        # de-duplication of equal keys and re-map onto any other plan's parameters
        return get_optimizer_state_dict(model, optimizer, options=_options(full, flatten_optimizer_state_dict=not full))
    finally:
        zero1.reshard(optimizer)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _gather_parts(obj: Any, pipeline: Any, experts: bool) -> list[Any] | None:
    """Collect every piece of the model on global rank 0 (None elsewhere): one object per pipeline stage,
    or -- with expert parallelism, where ranks of one stage hold different experts -- one per rank."""
    if experts:
        out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out
    ranks = pipeline.group_ranks
    dst = ranks[0]
    out = [None] * len(ranks) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=pipeline.group)
    return out if dist.get_rank() == 0 else None


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


def load(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], zero1: "OptimizerStateSharding",
         strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
    """Load weights and optimizer states into the parallelized model; return the remaining metadata."""
    with zero1.unsharded_steps(optimizers):
        return _load(path, model, optimizers, zero1, strict, weights_only)


def _load(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], zero1: "OptimizerStateSharding",
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
            flat = _options(False, flatten_optimizer_state_dict=True)
            osd = get_optimizer_state_dict(model, opt, options=flat)
            obox = {f"optimizer_{i}": osd}
            # parameters that never received a gradient have no saved state: allow the partial load
            dcp.load(obox, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
            set_optimizer_state_dict(model, opt, obox[f"optimizer_{i}"], options=flat)
            zero1.reshard(opt)
        meta = torch.load(path / META_FILE, weights_only=weights_only if weights_only is not None else False)
        return meta
    if path.is_file():
        checkpoint = torch.load(path, map_location="cpu", mmap=True,
                                weights_only=weights_only if weights_only is not None else False)
        if "state_dict" not in checkpoint:
            raise ValueError(f"checkpoint {str(path)!r}: has no 'state_dict'. HINT: pass a checkpoint written by "
                             "Trainer.save_checkpoint or ModelCheckpoint.")
        # a full checkpoint holds every key; this rank loads those its (pipeline stage's) model has, so a
        # checkpoint written under one plan loads under any other
        own = set(get_model_state_dict(model))
        msd = {k: v for k, v in checkpoint.pop("state_dict").items() if k in own}
        set_model_state_dict(model, msd, options=_options(True, strict=strict))
        for opt, osd in zip(optimizers, checkpoint.pop("optimizer_states", [])):
            osd = {"state": {k: v for k, v in osd["state"].items() if k in own},
                   "param_groups": [{**g, "params": [p for p in g["params"] if p in own]} for g in osd["param_groups"]]}
            set_optimizer_state_dict(model, opt, osd, options=_options(True))
            zero1.reshard(opt)
        return checkpoint
    raise ValueError(f"checkpoint path {str(path)!r}: neither a DCP folder nor a checkpoint file. "
                     "HINT: pass the folder/file ModelCheckpoint wrote (or ckpt_path='last').")
