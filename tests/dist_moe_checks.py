"""MoE checks inside 2 gloo ranks (launched by tests/test_moe_parallel.py).

* An MoE block under tp=2 (Megatron TP), tp=2 + Megatron-SP and Ulysses 2 against the same block in one
  process: output, input gradient, every parameter's full gradient, with the aux-loss gradient injected.
  Attention is split by the block's ``galv_tp_plan`` exactly as in a LLaMA block; the MoE layer is
  ``"replicated"``. Negative control: the same block without the ``"replicated"`` entry under Megatron-SP
  (the MoE then runs on sequence chunks and its plain parameters keep per-chunk gradients).
* Data parallelism over 2 ranks with :class:`AllReduceStatsReducer`: averaged gradients and aux losses
  equal one process on the whole batch. Negative control: the local reducer (per-shard aux losses).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from dist_tp_checks import _cmp, _randomize, _worst  # noqa: E402  (tests/ is on sys.path in the ranks)
from lightning_galv.layout import MeshFactory, RankLayout
from lightning_galv.models.common import Rotary
from lightning_galv.models.moe import AllReduceStatsReducer, MoEBlock, MoEConfig, MoEDecoder
from lightning_galv.parallel.block import apply_block
from lightning_galv.plan import LayerStrategy

BATCH, SEQ = 2, 8
CFG = MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=48, max_seq_len=16,
                num_experts=4, top_k=2, shared_expert_hidden=16, aux_loss_weight=0.5, z_loss_weight=0.1)


class _ChunkedMoEBlock(MoEBlock):
    """Negative control: no ``"replicated"`` entry, so under Megatron-SP the MoE runs on the chunk."""

    galv_tp_plan = {k: v for k, v in MoEBlock.galv_tp_plan.items() if k != "moe"}


def _block(cls: type[MoEBlock] = MoEBlock) -> MoEBlock:
    torch.manual_seed(0)
    block = cls(CFG, Rotary(CFG.dim // CFG.n_heads, CFG.max_seq_len), layer_idx=0)
    _randomize(block, 3)
    return block


def _full_grad(p: torch.Tensor, group: Any) -> torch.Tensor:
    g = p.grad
    assert g is not None
    if isinstance(g, DTensor):
        return g.to_local() if all(pl.is_replicate() for pl in g.placements) else g.full_tensor()
    if group is not None:  # Ulysses: plain per-chunk gradients, summed by the data-parallel code in a run
        g = g.clone()
        dist.all_reduce(g, group=group)
    return g


def moe_block_parity(strategy: LayerStrategy, factory: MeshFactory, cls: type[MoEBlock] = MoEBlock,
                     reducer: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    ref = _block(cls)
    par = copy.deepcopy(ref)
    mesh = factory.mesh(strategy)
    apply_block(par, mesh, strategy)
    group = mesh["tp"].get_group()
    if reducer is not None:
        par.moe.stats_reducer = reducer(group)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(BATCH, SEQ, CFG.dim, generator=g)
    gy = torch.randn(BATCH, SEQ, CFG.dim, generator=g)
    xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yp = ref(xr), par(xp)
    yr.backward(gy)
    yp.backward(gy)
    res = [_cmp(yp, yr, "output"), _cmp(xp.grad, xr.grad, "input grad"),
           _cmp(par.moe.last_aux_loss, ref.moe.last_aux_loss, "aux loss"),
           _cmp(par.moe.last_z_loss, ref.moe.last_z_loss, "z loss")]
    sum_group = group if strategy.ulysses else None
    ref_params = dict(ref.named_parameters())
    n_dtensor = 0
    for name, p in par.named_parameters():
        n_dtensor += isinstance(p, DTensor)
        res.append(_cmp(_full_grad(p, sum_group), ref_params[name].grad, f"grad {name}"))
    out = _worst(res)
    out["n_dtensor_params"] = n_dtensor
    out["moe_dtensor_params"] = sum(isinstance(p, DTensor) for p in par.moe.parameters())
    out["stats_tokens"] = par.moe.last_stats.tokens
    return out


def _dp_model() -> MoEDecoder:
    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(**{**CFG.to_dict(), "moe_every": 1}))
    _randomize(model, 5)
    return model


def dp_parity(local_reducer: bool) -> dict[str, Any]:
    """2-rank data parallelism: each rank a half batch; gradients averaged as the data code does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _dp_model()
    par = copy.deepcopy(ref)
    if not local_reducer:
        par.set_stats_reducer(AllReduceStatsReducer(dist.group.WORLD, grad="sum"))
    tokens = torch.randint(0, CFG.vocab_size, (2 * world, SEQ + 1), generator=torch.Generator().manual_seed(4))
    shard = tokens.chunk(world)[rank]

    def lm(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    lm(ref, tokens).backward()
    lm(par, shard).backward()
    res = []
    for (name, p), q in zip(par.named_parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        res.append(_cmp(g / world, q.grad, f"grad {name}"))
    for i, (a, b) in enumerate(zip(par.moe_layers, ref.moe_layers)):
        res += [_cmp(a.last_aux_loss, b.last_aux_loss, f"aux loss {i}"), _cmp(a.last_z_loss, b.last_z_loss, f"z {i}")]
    out = _worst(res)
    out["router_ok"] = all(r["ok"] for r in res if "router" in r["what"] or "aux" in r["what"])
    return out


def expert_states(mp_dtype: torch.dtype | None) -> dict[str, Any]:
    """ep = data degree under ZeRO-3: a one-rank expert-data group. The experts get no FSDP2 state of their own and
    stay plain, outside the block's state -- unless a mixed-precision policy casts parameters, which the block's
    state would do to the activations but not to ignored experts: then they keep their own (one-rank) states, and
    a forward runs in the policy's dtype."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from lightning_galv.parallel.parallelize import parallelize
    from lightning_galv.plan import ParallelPlan

    world = dist.get_world_size()
    model = _dp_model()
    plan = ParallelPlan.uniform(world, CFG.n_layers, LayerStrategy(dp=world, ep=world, zero=3), global_batch=2 * world)
    policy = MixedPrecisionPolicy(param_dtype=mp_dtype) if mp_dtype is not None else None
    parallelize(model, plan, MeshFactory(RankLayout(world), "cpu", dist.get_rank()), mp_policy=policy)
    experts = [e for layer in model.moe_layers for e in layer.experts if any(True for _ in e.parameters())]
    expert_ids = {id(p) for e in experts for p in e.parameters()}
    dense = [p for blk in model.layers for p in blk.parameters() if id(p) not in expert_ids]
    tokens = torch.randint(0, CFG.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    return {"experts": len(experts),
            "expert_fsdp_states": sum(isinstance(e, FSDPModule) for e in experts),
            "expert_dtensors": sum(isinstance(p, DTensor) for e in experts for p in e.parameters()),
            "dense_dtensors": all(isinstance(p, DTensor) for p in dense) and bool(dense),
            "finite": bool(torch.isfinite(logits.float()).all())}


def run_all() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "these checks are written for 2 ranks"
    factory = MeshFactory(RankLayout(world), "cpu", rank)
    identity = lambda group: AllReduceStatsReducer(group, grad="identity")  # noqa: E731
    out: dict[str, Any] = {
        "tp2": moe_block_parity(LayerStrategy(tp=2), factory),
        "tp2_megatron": moe_block_parity(LayerStrategy(tp=2, sp="megatron"), factory),
        "ulysses2": moe_block_parity(LayerStrategy(tp=2, sp="ulysses"), factory, reducer=identity),
        "negative/megatron_chunked_moe": moe_block_parity(LayerStrategy(tp=2, sp="megatron"), factory,
                                                          cls=_ChunkedMoEBlock),
        "negative/ulysses2_local_aux": moe_block_parity(LayerStrategy(tp=2, sp="ulysses"), factory),
        "dp2_global_aux": dp_parity(local_reducer=False),
        "negative/dp2_local_aux": dp_parity(local_reducer=True),
        "ep2_zero3_states": expert_states(None),
        "ep2_zero3_states_bf16": expert_states(torch.bfloat16),
    }
    return out
