"""Rank-side checks for the profilers (launched by tests/test_profilers.py through lightning_galv.testing)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_galv.models import Llama, LlamaConfig
from lightning_galv.models.common import Rotary
from lightning_galv.models.llama import LlamaBlock
from lightning_galv.profiling import HardwareProfiler, ModelProfiler
from lightning_galv.profiling.profilers import ShardedLayerProfiler

CFG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)


def sharded_profile() -> dict[str, Any]:
    """Hardware profile, ModelProfiler layer, and the ShardedLayerProfiler's completion of it."""
    cfg = LlamaConfig(**CFG)

    def block() -> torch.nn.Module:
        torch.manual_seed(0)
        return LlamaBlock(cfg, Rotary(cfg.dim // cfg.n_heads, cfg.max_seq_len))

    from torch.distributed import distributed_c10d as c10d

    shape = Llama(cfg).galv_shape(16)
    groups0 = len(c10d._world.pg_map)
    hw = HardwareProfiler(sizes_bytes=(1 << 12, 1 << 16), repeats=2, progress=False).fit()
    after_hw = len(c10d._world.pg_map) - groups0
    plain = ModelProfiler(block, shape, batch_sizes=(1, 2), repeats=1, progress=False).fit()
    prof = ShardedLayerProfiler(block, shape, hw, batch_sizes=(1, 2), repeats=1, progress=False)
    layer = prof.fit(plain.layer(0))
    return {"groups_left": (after_hw, len(c10d._world.pg_map) - groups0), "hw": hw.to_dict(), "plain": plain.to_dict(), "layer": plain.with_(layer_types=(layer,)).to_dict(),
            "variants": prof.variants(), "together_bandwidth": prof.optimizer_bandwidth,
            "matmul_flops": prof.matmul_flops,
            "moe": moe_sharded_profile(hw), "slowest_pass": slowest_pass(shape, hw)}


def slowest_pass(shape: Any, hw: Any) -> list[list[float]]:
    """``_time_interleaved`` over a module whose forward sleeps 0.2 s on rank 0 in round 1 and on rank 1 in round 2
    (0.01 s otherwise; round 0 warms up), and another that sleeps 0.03 s on rank 1 only: each rank's own median
    is fast, the slowest rank's per round is slow in two rounds of three."""
    import time

    rank = torch.distributed.get_rank()

    class Sleepy(torch.nn.Module):
        def __init__(self, delays: list[float]) -> None:
            super().__init__()
            self.delays, self.w = delays, torch.nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(self.delays.pop(0))
            return x * self.w

    spiky = Sleepy([0.01, 0.2, 0.01, 0.01] if rank == 0 else [0.01, 0.01, 0.2, 0.01])
    steady = Sleepy([0.03 if rank == 1 else 0.01] * 4)
    prof = ShardedLayerProfiler(lambda: torch.nn.Linear(4, 4), shape, hw, batch_sizes=(1,), repeats=3,
                                progress=False)
    return [list(t) for t in prof._time_interleaved([(spiky, 1), (steady, 1)])]


def moe_sharded_profile(hw: HardwareProfiler | Any) -> dict[str, Any]:
    """Automatic mode's profile of a small MoE decoder (block kinds, then each as the runtime shards it):
    the MoE layer type must also carry fits measured under expert parallelism."""
    from lightning_galv.auto import profile_model, sharded_profile
    from lightning_galv.models import MoEConfig, MoEDecoder
    from lightning_galv.models.protocol import find_parts

    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                 max_seq_len=16, num_experts=4, top_k=2, expert_hidden=48, moe_every=2))
    parts = find_parts(model)
    prof = profile_model(model, parts)
    out = sharded_profile(model, parts, prof, hw, None, False).to_dict()
    return {**out, "alone_bandwidth": prof.optimizer_bandwidth}


def moe_zero_blocks() -> dict[str, Any]:
    """The MoE block under ZeRO-2/3 as the ShardedLayerProfiler builds it for every ep (4 ranks, 4 experts), one
    forward and backward each: per key, what FSDP2 manages -- the block's own state and mesh, each local
    expert's own state (mesh size, None when it has none) and whether expert parameters are sharded."""
    import copy

    from torch.distributed.fsdp import FSDPModule

    from lightning_galv.models import MoEConfig, MoEDecoder
    from lightning_galv.models.protocol import find_parts
    from lightning_galv.parallel.expert import ExpertPlaceholder, moe_layers
    from lightning_galv.planner.profiles import HardwareProfile, LayerTypeProfile, TimeFit
    from lightning_galv.profiling.profilers import moe_facts

    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                 max_seq_len=16, num_experts=4, top_k=2, expert_hidden=48, moe_every=1))
    blk = find_parts(model).blocks[0]
    lt = LayerTypeProfile("moe", TimeFit(), TimeFit(), sum(p.numel() for p in blk.parameters()), {"tp1/none": 1.0},
                          32, moe=moe_facts(blk))
    from dataclasses import replace

    # collectives inline, as gloo runs them (the runtime then prefetches the next unit's gathers asynchronously)
    hw = replace(HardwareProfile.uniform(1, 4, 24e9, intra_bw=1e9, latency_s=1e-5), async_collectives=False)
    prof = ShardedLayerProfiler(lambda: copy.deepcopy(blk), model.galv_shape(16), hw, batch_sizes=(2,), repeats=1,
                                progress=False)
    out: dict[str, Any] = {}
    from lightning_galv.profiling.profilers import ZERO_CHAIN_UNITS

    from lightning_galv.profiling.profilers import ALONE_SUFFIX

    for key, chain, comm in prof._zero_blocks(lt):
        if key.endswith(ALONE_SUFFIX):  # one block alone: its own root, managing its parameters
            assert isinstance(chain, FSDPModule) and chain._get_fsdp_state()._fsdp_param_group is not None, key
            block = chain
        else:
            units = list(chain.units)  # the blocks, each its own FSDP2 unit under the chain's shared root
            assert len(units) == ZERO_CHAIN_UNITS and isinstance(chain, FSDPModule), key
            assert chain._get_fsdp_state()._fsdp_param_group is None, key  # the root manages no parameter itself
            block = units[0]
        layer = moe_layers(block)[0]
        experts = [e for e in layer.experts if not isinstance(e, ExpertPlaceholder)]
        y = chain(torch.randn(2, 16, 32, requires_grad=True))
        y.backward(torch.ones_like(y))
        out[key] = {
            "block_mesh": (block._get_fsdp_state()._fsdp_param_group.mesh_info.mesh.size()
                           if isinstance(block, FSDPModule) else None),
            "experts": [e._get_fsdp_state()._fsdp_param_group.mesh_info.mesh.size() if isinstance(e, FSDPModule)
                        else None for e in experts],
            "experts_sharded": sorted({hasattr(p, "to_local") for e in experts for p in e.parameters()}),
            "expert_grads": all(p.grad is not None for e in experts for p in e.parameters()),
            # a gradient on the sharded parameters = reduce-scattered (the /nosync twins keep theirs unsharded)
            "sharded_grads": sorted({p.grad is not None for p in chain.parameters() if hasattr(p, "to_local")}),
            # the chain's second unit gathered beside the first's compute (forward; ZeRO-3 backward too)
            "prefetched": list(prof._prefetched[key]),
            "comm": list(comm(2)),
        }
    return out
