"""Rank-side code of benchmarks/moe_callbacks_e2e.py: MoE training steps with and without the MoE callbacks.

Every rank first trains the same MoE decoder in one process for ``pretrain`` steps on the corpus (same
seed and data everywhere, so the weights agree), so that routing has the skew and per-sample locality of a
trained router rather than of a random one. Then the plan is applied and each variant (plain EP, expert
re-layout, sample placement, both) is timed in rotated order per repeat. A step = forward + backward +
gradient sync + SGD update of one global batch, started after a barrier; its time is the max over ranks.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_galv.demo.corpus import DEFAULT_CORPUS, TokenWindows, load_byte_tokens
from lightning_galv.layout import MeshFactory, RankLayout
from lightning_galv.loss import cross_entropy
from lightning_galv.models import MoEConfig, MoEDecoder
from lightning_galv.parallel.expert_relayout import RelayoutController
from lightning_galv.parallel.moe_step import attach_placement, attach_relayout
from lightning_galv.parallel.parallelize import parallelize
from lightning_galv.parallel.sample_placement import PlacementController
from lightning_galv.plan import ParallelPlan


def _windows(seq: int, corpus: str | None = None) -> TokenWindows:
    """Byte-token windows of the shipped corpus (``corpus=None``) or of a local text / JSONL file."""
    return TokenWindows(load_byte_tokens([corpus or DEFAULT_CORPUS]), seq)


def _pretrained(cfg: dict, steps: int, batch: int, seq: int, corpus: str | None = None) -> MoEDecoder:
    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(**cfg))
    data = _windows(seq, corpus)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(data), (batch,), generator=gen)
        w = torch.stack([data[int(i)] for i in idx])  # [batch, seq + 1]
        cross_entropy(model(w[:, :-1]), w[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return model


def run_all(plan_dict: dict, cfg: dict, variants: list[str], gpus_per_node: int, batch_per_rank: int, seq: int,
            steps: int, warmup: int, repeats: int, pretrain: int, corpus: str | None = None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = ParallelPlan.from_dict(plan_dict)
    base = _pretrained(cfg, pretrain, batch_per_rank * world, seq, corpus)
    built = {}
    for name in variants:
        model = copy.deepcopy(base)
        rt = parallelize(model, plan, MeshFactory(RankLayout(world, plan.pp), "cpu", rank),
                         expert_sharding="full" if "fsep" in name else "owner")  # fully sharded experts
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        rt.wrap_optimizer(opt)
        relayout = placement = None
        if "relayout" in name:
            relayout = RelayoutController(attach_relayout(model, plan))
        if "placement" in name:
            placement = PlacementController(attach_placement(model, plan, gpus_per_node))
        built[name] = (model, rt, opt, relayout, placement)
    data = _windows(seq, corpus)
    gen = torch.Generator().manual_seed(1 + rank)
    times: dict[str, list[list[float]]] = {n: [] for n in variants}
    relayout_recs: dict[str, list[dict]] = {n: [] for n in variants}
    placement_steps: dict[str, list[dict]] = {n: [] for n in variants}
    for rep in range(repeats):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for name in order:
            model, rt, opt, relayout, placement = built[name]
            ts = []
            for step in range(warmup + steps):
                idx = torch.randint(0, len(data), (batch_per_rank,), generator=gen)
                w = torch.stack([data[int(i)] for i in idx])  # [b, seq + 1] this rank's shard
                for c in (relayout, placement):
                    if c is not None:
                        c.before_step()
                dist.barrier()
                t0 = time.perf_counter()
                cross_entropy(model(w[:, :-1]), w[:, 1:]).backward()
                rt.sync_gradients()
                opt.step()
                opt.zero_grad()
                t = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if relayout is not None:
                    recs = [r.__dict__ for r in relayout.after_step()]
                    if step >= warmup:
                        relayout_recs[name] += recs
                if placement is not None:
                    st = placement.after_step().__dict__
                    if step >= warmup:
                        placement_steps[name].append(st)
                if step >= warmup:
                    ts.append(float(t))
            times[name].append(ts)
    return {"times": times, "relayout": relayout_recs, "placement": placement_steps}
