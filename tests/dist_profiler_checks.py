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

    shape = Llama(cfg).galv_shape(16)
    hw = HardwareProfiler(sizes_bytes=(1 << 12, 1 << 16), repeats=2, progress=False).fit()
    plain = ModelProfiler(block, shape, batch_sizes=(1, 2), repeats=1, progress=False).fit()
    prof = ShardedLayerProfiler(block, shape, hw, batch_sizes=(1, 2), repeats=1, progress=False)
    layer = prof.fit(plain.layer(0))
    return {"hw": hw.to_dict(), "plain": plain.to_dict(), "layer": plain.with_(layer_types=(layer,)).to_dict(),
            "variants": prof.variants(), "moe": moe_sharded_profile(hw)}


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
    return sharded_profile(model, parts, prof, hw, None, False).to_dict()
