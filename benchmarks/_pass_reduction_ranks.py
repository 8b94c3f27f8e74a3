"""Rank side of benchmarks/pass_reduction.py: one block's passes next to four blocks run back to back."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from costmodel_accuracy import CFG, GLOBAL_BATCH, SEQ
from costmodel_ranks import dense_cfg


def passes(rounds: int) -> dict[str, list]:
    """Per round (after one that warms up), every rank's (forward, backward) seconds of one LLaMA block of the
    accuracy benchmark's model, timed as the ShardedLayerProfiler times a variant (a fresh input, all ranks
    starting together after a barrier, backward from a ones gradient), and every rank's forward and backward
    seconds through all of the model's blocks back to back (what a data-parallel step's forward and backward
    run between its collectives), at the per-rank batch of data parallelism over the world. Returned on rank 0:
    ``single[rank][round] = (fwd, bwd)``, ``chain[rank][round] = (fwd, bwd)``."""
    from lightning_galv.models import LlamaConfig
    from lightning_galv.models.common import Rotary
    from lightning_galv.models.llama import LlamaBlock

    torch.set_num_threads(1)
    world = dist.get_world_size()
    cfg = LlamaConfig(**dense_cfg(CFG))
    torch.manual_seed(0)
    rot = Rotary(cfg.dim // cfg.n_heads, cfg.max_seq_len)
    blocks = [LlamaBlock(cfg, rot) for _ in range(cfg.n_layers)]
    b = GLOBAL_BATCH // world

    def timed(mods: list[torch.nn.Module]) -> tuple[float, float]:
        x = torch.randn(b, SEQ, cfg.dim, requires_grad=True)  # [b, s, h]
        dist.barrier()
        t0 = time.perf_counter()
        y = x
        for m in mods:
            y = m(y)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        t2 = time.perf_counter()
        for m in mods:
            m.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1

    single, chain = [], []
    for r in range(rounds + 1):
        s, c = timed(blocks[:1]), timed(blocks)
        if r:
            single.append(s)
            chain.append(c)
    mine = torch.tensor([single, chain], dtype=torch.float64)  # [2, rounds, 2]
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return {"single": [e[0].tolist() for e in every], "chain": [e[1].tolist() for e in every],
            "blocks": cfg.n_layers, "batch": b}
