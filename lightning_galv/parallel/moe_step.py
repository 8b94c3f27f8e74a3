"""Attaching the per-step MoE callbacks' runtime to a parallelized model (issue 12).

Both callbacks act through one dispatcher per expert-parallel MoE layer,
:class:`~.sample_placement.PlacingDispatcher` (a :class:`~.expert_relayout.RelayoutDispatcher` that can also
relocate samples), installed over the plain EP dispatcher by whichever callback attaches first: that is what
makes them compose. This module holds that installation and the two ``attach_*`` entry points, so that the
two runtime modules do not import each other.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from ..models.moe import MoELayer
from .expert import AllToAllDispatcher, moe_layers
from .expert_relayout import RelayoutDispatcher, _register_flat
from .sample_placement import PlacingDispatcher, group_topology, placement_runs

__all__ = ["attach_relayout", "attach_placement", "step_dispatcher"]


def attach_placement(model: nn.Module, plan: Any, gpus_per_node: int,
                     policy: Any = None) -> list[PlacingDispatcher]:
    """Replace the EP dispatchers of the MoE layers of every placement run that this process holds.

    ValueError with a HINT for a dense model, a plan without expert parallelism, capacity-factor routing
    (not exact under placement) and EP groups that straddle nodes unevenly."""
    layers = {m.layer_idx: m for m in model.modules() if isinstance(m, MoELayer)}
    shape_fn = next((m.galv_moe_shape for m in model.modules() if callable(getattr(m, "galv_moe_shape", None))), None)
    if shape_fn is None and not layers:
        raise ValueError(f"{type(model).__name__} has no MoE layer: sample placement cuts the all-to-all traffic of "
                         "MoE layers. HINT: drop SamplePlacement for a dense model, or use an MoE model.")
    moe_ids = set(shape_fn().moe_layers) if shape_fn is not None else set(layers)
    if not any(plan.layers[i].ep > 1 for i in moe_ids):
        raise ValueError("no MoE layer of the plan uses expert parallelism (ep > 1): without an all-to-all there "
                         "is no traffic to cut. HINT: give the MoE layers ep>=2, e.g. LayerStrategy(dp=4, ep=4).")
    out: list[PlacingDispatcher] = []
    for run in placement_runs(plan, moe_ids):
        for pos, i in enumerate(run):
            layer = layers.get(i)
            if layer is None:
                continue  # another pipeline stage holds it
            if layer.capacity_factor is not None:
                raise ValueError(f"MoE layer {i}: capacity_factor={layer.capacity_factor} drops tokens by their "
                                 "position on a rank, so moving samples would change which tokens are dropped. "
                                 "HINT: sample placement needs dropless routing (capacity_factor=None).")
            pd = step_dispatcher(layer)
            if pd.places_samples:
                raise ValueError(f"MoE layer {i} already places samples. HINT: add SamplePlacement once.")
            ranks = dist.get_process_group_ranks(pd.group)
            pd.enable_placement(group_topology(ranks, gpus_per_node), first=pos == 0, restore=pos == len(run) - 1,
                                policy=policy)
            out.append(pd)
    return out


def _require_expert_modules(layer: MoELayer) -> None:
    """The MoE callbacks move and replicate experts as modules: refuse a layer whose experts are fused tensors."""
    if not isinstance(layer.experts, nn.ModuleList):
        raise ValueError(f"MoE layer {layer.layer_idx} ({type(layer).__name__}) keeps its experts fused in "
                         f"{type(layer.experts).__name__}: expert relayout and sample placement need one module per "
                         "expert. HINT: drop the ExpertRelayout / SamplePlacement callbacks for this model (its expert "
                         "parallelism itself works).")


def step_dispatcher(layer: MoELayer) -> PlacingDispatcher:
    """The layer's per-step dispatcher, installed over its plain EP dispatcher on first use (shared by the
    expert re-layout and the sample placement callbacks, so that they compose)."""
    _require_expert_modules(layer)
    d = layer.dispatcher
    if isinstance(d, PlacingDispatcher):
        return d
    if type(d) is not AllToAllDispatcher:
        raise ValueError(f"MoE layer {layer.layer_idx} uses {type(d).__name__}: the MoE callbacks build on the plain "
                         "expert-parallel dispatcher. HINT: do not combine them with another dispatcher.")
    pd = PlacingDispatcher(d.group, d.size, d.rank, layer)
    layer.dispatcher = pd
    return pd



def attach_relayout(model: nn.Module, plan: Any = None) -> list[tuple[MoELayer, RelayoutDispatcher]]:
    """Put a :class:`RelayoutDispatcher` (plain EP until a layout is set) on every EP MoE layer of ``model``
    held by this process (under a pipeline a stage may hold none: an empty list).

    Refuses, with a ValueError naming the reason and a HINT, a dense model and a ``plan`` (when given) in which
    no layer has expert parallelism (nothing to re-lay-out); the plan decides so that every rank, whatever its
    pipeline stage, answers the same."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    is_moe = bool(layers) or any(callable(getattr(m, "galv_moe_shape", None)) for m in model.modules())
    if not is_moe:
        raise ValueError(f"{type(model).__name__} has no MoE layer: expert re-layout balances the experts of MoE "
                         "layers. HINT: drop the MoE callbacks for a dense model, or use an MoE model (kind='moe').")
    if plan is not None and not any(s.ep > 1 for s in plan.layers):
        raise ValueError("no layer of the plan uses expert parallelism (ep > 1): with every expert on every rank "
                         "there is nothing to re-lay-out. HINT: give the MoE layers ep>=2 in the plan, e.g. "
                         "LayerStrategy(dp=4, ep=4).")
    out: list[tuple[MoELayer, RelayoutDispatcher]] = []
    for layer in layers:
        if not isinstance(layer.dispatcher, AllToAllDispatcher):
            continue  # ep = 1 here: every expert local
        _require_expert_modules(layer)
        d = step_dispatcher(layer)
        _fsdp_flat(layer, d)
        out.append((layer, d))
    return out


def _fsdp_flat(layer: MoELayer, d: RelayoutDispatcher) -> None:
    """Experts sharded by FSDP2 (ZeRO-2/3): give each a ``galv_flat`` forward method, which the dispatcher
    reads them through (``parallel/expert_relayout.py``)."""
    from torch.distributed.fsdp import FSDPModule

    experts = [m for m in layer.experts if any(True for _ in m.parameters())]
    if any(isinstance(m, FSDPModule) for m in experts):
        for m in experts:
            _register_flat(m)
        d.fsdp_experts = True


def read_experts_through_fsdp(block: nn.Module) -> None:
    """After FSDP2 sharded the fully sharded experts of ``block`` over their expert-data group: the dispatchers
    read them through FSDP2 (``parallel/parallelize.py``, ``expert_sharding="full"``)."""
    for layer in moe_layers(block):
        if isinstance(layer.dispatcher, RelayoutDispatcher):
            _fsdp_flat(layer, layer.dispatcher)


def apply_fsep(block: nn.Module, mesh: Any, strategy: Any, name: str) -> list[nn.Module]:
    """:func:`~lightning_galv.parallel.expert.apply_ep` with LAER-MoE's fully sharded experts
    (``parallelize(expert_sharding="full")``): every MoE layer of ``block`` keeps all experts, sharded over the
    EP group of ``mesh`` (``("edp", "ep")``). Returns the expert modules (reduced over ``mesh["edp"]``)."""
    from .expert import check_ep

    local: list[nn.Module] = []
    for layer in check_ep(block, strategy, name):
        local += shard_experts_fully(layer, mesh["ep"], name)
    return local


def shard_experts_fully(layer: MoELayer, ep_mesh: Any, name: str) -> list[nn.Module]:
    """LAER-MoE's fully sharded expert parallelism (FSEP) for one MoE layer: keep *every* expert, each parameter
    a DTensor ``Shard(0)`` over the EP group (rows ``q`` on rank ``q``), so parameters, gradients and optimizer
    state take 1/ep of the experts' bytes per rank as under plain EP, but any rank can materialize any expert
    from all ranks alike. Installs the per-step dispatcher (``parallel/sample_placement.py``), which materializes
    every layout -- plain EP's static one too -- before the experts run. Returns the expert modules (their
    gradients are reduced over the expert-data group like plain EP's)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    try:
        _require_expert_modules(layer)
    except ValueError as exc:
        raise ValueError(f"block {name}: expert_sharding='full' shards experts module by module. {exc} Or keep "
                         "expert_sharding='owner'.") from None
    group, size, rank = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()
    for e, m in enumerate(layer.experts):
        for path, p in list(m.named_parameters()):
            if p.dim() == 0:
                raise ValueError(f"block {name}: expert {e} parameter {path!r} is a scalar: fully sharded experts "
                                 "cut every parameter on its first dim. HINT: expert_sharding='owner'.")
            owner_path, _, leaf = path.rpartition(".")
            holder = m.get_submodule(owner_path) if owner_path else m
            d = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)  # replicated in: no comm
            holder.register_parameter(leaf, nn.Parameter(d, requires_grad=p.requires_grad))
        m._galv_ep_in_placements = True  # read by parallel/expert.py mark_expert_params
    d = PlacingDispatcher(group, size, rank, layer)
    d.sharded = True
    layer.dispatcher = d
    return list(layer.experts)
