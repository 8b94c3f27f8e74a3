"""Apply a :class:`ParallelPlan` to a model, in one documented order.

Order, and why:

1. **Replicated start** - broadcast every parameter and buffer from rank 0 so replicas agree even if
   the user forgot to seed (shards are cut from identical tensors).
2. **Tensor / sequence parallelism** per unit (``apply_block`` for blocks, which picks Megatron TP,
   TP + Megatron-SP or Ulysses from the strategy; vocab-parallel embedding and head): turns weights into
   DTensors on the unit's ``tp`` mesh dim; must precede FSDP, which then shards the DTensors further on
   the ``dp`` dim.
3. **Activation checkpointing** per block: wraps the block's own forward only, so the hooks added next
   stay outside the recomputed region.
4. **Layout re-distribution hooks** between units whose batch sharding differs (and from/to the data
   loader's layout at the model's input and output).
5. **Data parallelism / ZeRO** per unit: FSDP2 for ZeRO-2/3 (registered last so its pre-forward
   all-gather runs after our re-distribution), gradient sum + ZeRO-1 ownership for the rest. Without a
   pipeline the units' FSDP2 states then get one shared root on the innermost module containing them
   (``apply_shared_root``: one state context, backward prefetch across units; on CPU asynchronous
   prefetched all-gathers and a forward prefetch of the next unit), which manages no parameters; a unit
   of several modules (final norm + head) then shares one state.

Everything is collected into a runtime (``parallel/runtime.py``) that the strategy drives: a
:class:`~.runtime.ParallelRuntime`, or a :class:`~.pipeline.PipelineRuntime` when ``pp > 1``. Plans with
``backend="deepspeed"`` skip all of the above: the DeepSpeed engine applies ZeRO itself, so
``parallelize`` hands back a :class:`~.deepspeed.DeepSpeedRuntime` that creates the engine when the
optimizers are known.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..layout import MeshFactory, RankLayout
from ..models.dropout import keyed_dropout_, set_coords
from ..models.protocol import ModelParts, find_parts
from ..plan import LayerStrategy, ParallelPlan
from . import grads
from .block import apply_block
from .activation_checkpoint import apply_checkpointing
from .data_parallel import (DEFAULT_BUCKET_BYTES, GradientSync, OptimizerStateSharding, apply_fsdp, apply_shared_root,
                            shared_root_container)
from .redistribute import BatchLayout, add_input_redistribution, add_output_redistribution
from .runtime import ParallelRuntime, Runtime, Unit
from .tensor import apply_tp_embedding, apply_tp_head


def _dropout_rows_hook(shard: int, shards: int, first: bool = False) -> Any:
    """Record which batch shard this unit holds, for the keyed dropout inside it (and after it, e.g. GPT-2's
    embedding dropout runs after the token embedding's forward). ``first``: the unit starts a pipeline chunk's
    forward, where samples are where the loader put them -- a sample placement left over from a forward that
    did not reach its run's last MoE layer (an error, an interrupted forward) must not outlive it."""
    def hook(module: nn.Module, args: tuple) -> None:
        if first:
            set_coords(shard=shard, shards=shards, placement=None, row_source=None)
        else:
            set_coords(shard=shard, shards=shards)
    return hook


def model_units(parts: ModelParts, plan: ParallelPlan, root: nn.Module,
                chunks: list[int] | None = None) -> list[Unit]:
    """In flow order: embed (+ every parameter outside blocks/head), blocks, head (final norm + output),
    restricted to the pipeline ``chunks`` this rank holds (all layers when ``chunks`` is None)."""
    assert plan.embed is not None and plan.head is not None
    n_chunks = plan.pp * plan.virtual_stages
    chunks = list(range(n_chunks)) if chunks is None else chunks
    units: list[Unit] = []
    for c in chunks:
        if c == 0 and parts.embedding is not None:
            units.append(Unit("embed", [parts.embedding], plan.embed, chunk=c))
        units += [Unit(f"layers.{i}", [parts.blocks[i]], plan.layers[i], chunk=c) for i in plan.stage_layers(c)]
        head_mods = [m for m in (parts.final_norm, parts.head) if m is not None]
        if c == n_chunks - 1 and head_mods:
            units.append(Unit("head", head_mods, plan.head, chunk=c))
    owned = {id(p) for u in units for p in u.parameters()}
    rest = [p for p in root.parameters() if id(p) not in owned]
    if rest:
        if units and units[0].name == "embed":
            units[0].extra += rest
        else:
            units.insert(0, Unit("embed", [], plan.embed, extra=rest))
    return units


def check_plan_for_model(plan: ParallelPlan, parts: ModelParts) -> None:
    if parts.check_plan is not None:  # what the model itself cannot run (models/protocol.py)
        parts.check_plan(plan)
    if len(plan.layers) != len(parts.blocks):
        raise ValueError(f"plan with {len(plan.layers)} layer strategies: the model has {len(parts.blocks)} blocks. "
                         "HINT: give one LayerStrategy per block (ParallelPlan.uniform(world, num_layers, ...)).")
    if not parts.understood:
        bad = [s.short() for s in plan.all_strategies() if s.tp > 1]
        if bad:
            raise ValueError(f"tensor/sequence parallel strategies {sorted(set(bad))}: the model does not implement "
                             "the lightning_galv block protocol, so its projections cannot be split. HINT: use "
                             "tp=1 (DP/ZeRO/checkpointing work on any model) or expose galv_blocks/galv_tp_plan "
                             "(see lightning_galv.models.protocol).")
    elif parts.shape is not None:
        plan.check_model(parts.shape)
    from .expert import check_ep

    for name, s in (("embed", plan.embed), ("head", plan.head)):
        if s.ep > 1:
            raise ValueError(f"{name} strategy ep={s.ep}: expert parallelism applies to MoE layers only. "
                             f"HINT: keep ep=1 for the {name}.")
    for i, s in enumerate(plan.layers):
        check_ep(parts.blocks[i], s, f"layers.{i}")  # ep on a dense block, or not dividing the experts


def _apply_expert_data_parallel(unit: Unit, factory: MeshFactory, runtime: ParallelRuntime, plan: ParallelPlan,
                                mp_policy: Any | None) -> tuple[list[nn.Parameter], set[nn.Parameter]]:
    """DP / ZeRO of a unit's local experts over their expert-data group; returns the unit's other parameters
    and the expert parameters the unit's own FSDP2 state must ignore.

    Under ZeRO-2/3 each expert gets its own FSDP2 state on the expert-data mesh *before* the block's
    (a nested ``fully_shard`` keeps its parameters out of the outer one, which would otherwise shard
    experts that differ between EP ranks as if they were replicas). Not when that group is one rank (ep equal
    to the data degree, the usual EP layout): there is nothing to shard or reduce, and a one-rank FSDP2 state
    per expert still copies every expert in and out of flat buffers and runs its hooks around every forward
    and backward -- 4 ranks, ep4·zero3 MoE decoder: steps 15 % slower than with the experts left plain. They
    then stay plain tensors, outside the block's state (``ignored_params``), and take the ZeRO-0/1 path
    (on a one-rank group :class:`GradientSync` only scales their gradients), which holds the same bytes. Unless a mixed-precision
    policy casts parameters: the block's state would cast the activations but not ignored experts' weights."""
    from .expert import mark_expert_params

    s = unit.strategy
    edp = factory.expert_mesh(s)["edp"]
    expert_params = [p for m in unit.experts for p in m.parameters()]
    expert_ids = {id(p) for p in expert_params}
    others = [p for p in unit.parameters() if id(p) not in expert_ids]
    ignored: set[nn.Parameter] = set()
    casts = mp_policy is not None and mp_policy.param_dtype is not None
    if s.zero >= 2 and (edp.size() > 1 or casts):
        for m in unit.experts:
            apply_fsdp(m, edp, s, plan.data_parallel_size, mp_policy)
        runtime.fsdp_units += unit.experts
    else:
        edp_ranks = edp.mesh.flatten().tolist()
        runtime.grad_sync.add(expert_params, edp.get_group(), len(edp_ranks))
        if s.zero == 1:
            runtime.zero1.add([p for p in expert_params if p.requires_grad], edp_ranks, edp.get_group())
        if s.zero >= 2:
            ignored = set(expert_params)
    mark_expert_params(unit.experts, s.ep)
    return others, ignored


def _sharded_modules(unit: Unit) -> list[nn.Module]:
    """The modules of a ZeRO-2/3 unit that get an FSDP2 state (those holding parameters); none under ZeRO-0/1."""
    if unit.strategy.zero < 2:
        return []
    return [m for m in unit.modules if any(True for _ in m.parameters())]


@torch.no_grad()
def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Make parameters and buffers identical on every rank (rank ``src`` wins)."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta"]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        dist.broadcast(flat, src=src)
        offset = 0
        for t in ts:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def parallelize(model: nn.Module, plan: ParallelPlan, factory: MeshFactory, *,
                mp_policy: Any | None = None, sync_init: bool = True,
                grad_bucket_bytes: int = DEFAULT_BUCKET_BYTES, expert_sharding: str = "owner") -> Runtime:
    """Apply ``plan`` to ``model`` in place (order in the module docstring) and return its runtime.

    ``grad_bucket_bytes``: size of the ZeRO-0/1 gradient all-reduce buckets (DDP's ``bucket_cap_mb``).
    ``expert_sharding``: how ep > 1 layers hold their experts -- ``"owner"`` (plain EP: each expert whole on
    one rank of the EP group) or ``"full"`` (every expert sharded over the EP group, LAER-MoE's FSEP;
    ``parallel/expert_relayout.py``)."""
    layout, rank = factory.layout, factory.rank
    from .expert import check_expert_sharding

    check_expert_sharding(expert_sharding)
    if plan.backend == "deepspeed":  # the engine shards the model itself, once the optimizer exists
        from .deepspeed import DeepSpeedRuntime

        return DeepSpeedRuntime(plan, rank, layout.world_size)
    parts = find_parts(model)
    check_plan_for_model(plan, parts)
    keyed_dropout_(model)  # masks from global coordinates: the same under every plan (models/dropout.py)
    factory.build_all(plan)
    if sync_init:
        broadcast_module(model)  # 1. replicated start
    stage = layout.stage_of(rank)
    stages = None
    if plan.pp > 1:  # keep only this stage's chunks (placeholders elsewhere, names unchanged)
        from .pipeline import owned_chunks, split_model

        stages = split_model(model, parts, plan, stage)
        units = model_units(parts, plan, model, owned_chunks(plan, stage))
    else:
        units = model_units(parts, plan, model)

    # 2. tensor / sequence parallelism
    for unit in units:
        s = unit.strategy
        if s.tp == 1:
            continue
        mesh = factory.mesh(s)
        if unit.name == "embed":
            apply_tp_embedding(parts.embedding, mesh, s)  # type: ignore[arg-type]
        elif unit.name == "head":
            apply_tp_head(parts.final_norm, parts.head, mesh, s,  # type: ignore[arg-type]
                          vocab_parallel_loss=plan.vocab_parallel_loss)
        else:
            apply_block(unit.modules[0], mesh, s)

    # 2b. MoE layers: router statistics over the layer's data group (plan-independent aux losses), and
    #     expert parallelism (this rank's experts, all-to-all dispatch)
    from .expert import GlobalRouterStats, apply_ep, moe_layers

    for unit in units:
        if not unit.name.startswith("layers.") or not moe_layers(unit.modules[0]):
            continue
        s = unit.strategy
        data_mesh = factory.data_mesh(s)
        for layer in moe_layers(unit.modules[0]):
            layer.stats_reducer = GlobalRouterStats(data_mesh.get_group(), data_mesh.size(), plan.data_parallel_size)
        if s.ep > 1:
            if expert_sharding == "full":  # LAER-MoE's FSEP: every expert sharded over the EP group
                from .moe_step import apply_fsep

                unit.experts = apply_fsep(unit.modules[0], factory.expert_mesh(s), s, unit.name)
            else:
                unit.experts = apply_ep(unit.modules[0], factory.expert_mesh(s), s, unit.name)

    # 3. activation checkpointing
    for unit in units:
        if unit.strategy.checkpoint and unit.name.startswith("layers."):
            apply_checkpointing(unit.modules[0])

    # 4. layout re-distribution between units, and from/to the data loader's layout (which is also the
    #    layout activations cross pipeline stages in)
    stage_rank = rank - stage * layout.stage_size
    pure_dp = factory.world_mesh(LayerStrategy(dp=layout.stage_size))
    group = pure_dp["dp"].get_group()
    data_s = layout.data_strategy(plan)
    data_layout = BatchLayout.of(layout, data_s, stage)
    for chunk in sorted({u.chunk for u in units}):
        chunk_units = [u for u in units if u.chunk == chunk and u.modules]  # loose-only units have no input
        prev = data_layout
        for i, unit in enumerate(chunk_units):
            cur = BatchLayout.of(layout, unit.strategy, stage)
            add_input_redistribution(unit.modules[0], prev, cur, stage_rank, group)
            unit.modules[0].register_forward_pre_hook(_dropout_rows_hook(*layout.batch_shard(unit.strategy, rank),
                                                                         first=i == 0))
            prev = cur
        last = chunk_units[-1]
        exit_mod = parts.head if (last.name == "head" and parts.head is not None) else last.modules[-1]
        add_output_redistribution(exit_mod, prev, data_layout, stage_rank, group)

    # 5. data parallelism / ZeRO
    runtime_cls = ParallelRuntime
    if stages is not None:
        from .pipeline import PipelineRuntime

        runtime_cls = PipelineRuntime
    runtime = runtime_cls(plan, layout, factory, rank, units, data_s,
                          GradientSync(plan.data_parallel_size, bucket_bytes=grad_bucket_bytes),
                          OptimizerStateSharding())
    # without a pipeline the units' FSDP2 states share one root (5b); pipelines keep a root per unit
    root = shared_root_container(model, [m for u in units for m in _sharded_modules(u)]) if stages is None else None
    unit_fsdp_mods: list[nn.Module] = []  # the units' own FSDP2 modules (experts' states nest inside them)
    runtime.grad_sync.set_flow_order(p for u in units for p in u.parameters())  # buckets launch in backward order
    for unit in units:
        s = unit.strategy
        data_mesh = factory.data_mesh(s)
        params = unit.parameters()
        ignored: set[nn.Parameter] = set()
        if unit.experts:  # expert parameters: their own (expert-data) group, sharded there first under ZeRO-2/3
            # when it has two or more ranks (else plain, ``ignored`` by the unit's state)
            params, ignored = _apply_expert_data_parallel(unit, factory, runtime, plan, mp_policy)
            if expert_sharding == "full" and s.zero >= 2:  # FSEP dispatchers read the shards through FSDP2
                from .moe_step import read_experts_through_fsdp

                read_experts_through_fsdp(unit.modules[0])
        fsdp_mods = _sharded_modules(unit)
        if fsdp_mods:
            if root is not None and len(fsdp_mods) > 1:
                # one state for the unit (final norm + head): one all-gather and one reduce-scatter instead
                # of one per module; a state over several modules cannot be a root, so only under a shared one
                apply_fsdp(fsdp_mods, data_mesh, s, plan.data_parallel_size, mp_policy, ignored)
            else:
                for m in fsdp_mods:
                    apply_fsdp(m, data_mesh, s, plan.data_parallel_size, mp_policy, ignored)
            runtime.fsdp_units += fsdp_mods
            unit_fsdp_mods += fsdp_mods
            params = list(unit.extra)  # loose parameters stay replicated
        group_ranks = data_mesh.mesh.flatten().tolist()
        runtime.grad_sync.add(params, data_mesh.get_group(), len(group_ranks))
        if s.zero == 1:
            runtime.zero1.add([p for p in params if p.requires_grad], group_ranks, data_mesh.get_group())

    if root is not None:  # 5b. one FSDP2 root over the units' states, managing no parameters
        apply_shared_root(root, unit_fsdp_mods, pure_dp["dp"])
        runtime.fsdp_root = root

    runtime.params = list(model.parameters())
    if stages is None:  # a pipeline's backward runs once per micro-batch inside its schedule: reduce after it
        runtime.grad_sync.overlap_backward()
    if stages is not None:
        from .pipeline import PipelineDriver

        pp_mesh = pure_dp["pp"]
        device = grads.device_of(model.parameters())
        runtime.pipeline = PipelineDriver(plan, stages, pp_mesh.get_group(), pp_mesh.mesh.flatten().tolist(), device)
    return runtime
