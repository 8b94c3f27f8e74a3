"""Automatic mode: profile (or load cached profiles) -> search -> one plan, identical on every rank.

Hardware is profiled by all ranks together (collectives need everyone); the model is profiled and
the plan searched on rank 0 only, then broadcast, because per-rank timings differ slightly and every
rank must apply the same plan.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .models.protocol import ModelParts
from .plan import LayerStrategy, ParallelPlan

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(value: str | int | float) -> float:
    """``"20GB"`` -> 2e10, ``"512MiB"`` -> 536870912, numbers pass through."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"memory_budget={value}: must be > 0. HINT: e.g. memory_budget='20GB'.")
        return float(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory_budget={value!r}: not a size. HINT: write e.g. '20GB', '512MiB' or a byte count.")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def device_memory(device: torch.device) -> float:
    """Capacity per rank: the GPU's memory, or on CPU this machine's RAM shared by its local ranks."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return float(psutil.virtual_memory().total) / max(1, local)


def auto_plan(model: nn.Module, parts: ModelParts, world_size: int, device: torch.device,
              memory_budget: str | int | float | None = None, global_batch: int | None = None,
              verbose: bool = True) -> ParallelPlan:
    """Search a plan for ``model`` on this machine (pipeline degree 1 until stages are supported)."""
    from .planner import ProfileCache, SearchSpace, search
    from .profiling import HardwareProfiler, ModelProfiler

    budget = parse_bytes(memory_budget) if memory_budget is not None else device_memory(device)
    rank = dist.get_rank()
    n_layers = len(parts.blocks)
    if not parts.understood or parts.shape is None:
        # no protocol: only data parallelism applies; shard when replicas would not fit
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        zero = 3 if 4 * params > budget else 0  # weights + grads + 2 Adam moments
        plan = ParallelPlan.uniform(world_size, n_layers, LayerStrategy(dp=world_size, zero=zero))
        _say(verbose and rank == 0, f"auto plan (model without the block protocol): {plan.layers[0].short()}")
        return plan
    cache = ProfileCache()
    hw = HardwareProfiler(sizes_bytes=(1 << 14, 1 << 18), repeats=2, device_memory_bytes=budget, cache=cache,
                          progress=verbose).fit() if world_size > 1 else None
    box: list[Any] = [None]
    if rank == 0:
        block = parts.blocks[0]
        shape = parts.shape
        profile = ModelProfiler(lambda: copy.deepcopy(block).float(), shape, batch_sizes=(1, 2),
                                repeats=2, cache=cache, progress=verbose).fit()
        if hw is None:
            from .planner import HardwareProfile

            hw = HardwareProfile.uniform(1, 1, budget)
        space = SearchSpace(pp_degrees=(1,), micro_batches=(1,))
        gb = global_batch or 2 * world_size
        result = search(profile, hw, world_size, budget, global_batch=gb, top_k=3, space=space)
        best = result[0].with_(global_batch=None)
        _say(verbose, f"auto plan ({result.stats.get('seconds', 0):.2f}s search):\n{result.explanation}")
        box[0] = best.to_dict()
    dist.broadcast_object_list(box, src=0)
    return ParallelPlan.from_dict(box[0])


def _say(enabled: bool, msg: str) -> None:
    if enabled:
        print(f"[lightning_galv] {msg}", flush=True)
