"""Rank-side code of benchmarks/moe_ep.py: MoE training steps under dp-only and expert-parallel plans.

Every plan is applied to the same MoE decoder (same seed); the plans are timed in rotated order in each
repeat, so slow drifts of this shared machine spread over all of them. A step = forward + backward +
gradient sync + SGD update of one global batch, started after a barrier; its time is the max over ranks.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_galv.layout import MeshFactory, RankLayout
from lightning_galv.models import MoEConfig, MoEDecoder
from lightning_galv.parallel.parallelize import parallelize
from lightning_galv.plan import ParallelPlan


def _model(cfg: dict) -> MoEDecoder:
    torch.manual_seed(0)
    return MoEDecoder(MoEConfig(**cfg))


def _bytes_off_rank(model: MoEDecoder, dim: int, itemsize: int) -> tuple[int, int]:
    """(all-to-all bytes this rank sent to other ranks in the last forward, rows it kept) over its MoE layers.

    Dispatch and combine move the same rows (combine in the other direction), and the backward repeats
    both: a training step moves 4x the dispatch volume."""
    sent = kept = 0
    for layer in model.moe_layers:
        st = layer.last_stats
        if st is None or st.send_splits is None:
            continue
        table = st.source_expert_counts
        me = [i for i, row in enumerate(table) if list(row) == list(st.tokens_per_expert)][0]
        sent += (sum(st.send_splits) - st.send_splits[me]) * dim * itemsize
        kept += st.send_splits[me]
    return sent, kept


def run_all(plans: dict[str, dict], cfg: dict, batch_per_rank: int, seq: int, steps: int, warmup: int,
            repeats: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    built = {}
    for name, plan_dict in plans.items():
        plan = ParallelPlan.from_dict(plan_dict)
        model = _model(cfg)
        rt = parallelize(model, plan, MeshFactory(RankLayout(world, plan.pp), "cpu", rank))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        rt.wrap_optimizer(opt)
        params = sum(p.numel() for p in model.parameters())  # this rank's share (local experts only)
        built[name] = (model, rt, opt, params)
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[list[float]]] = {n: [] for n in plans}
    a2a: dict[str, tuple[int, int]] = {}
    names = list(plans)
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            model, rt, opt, _ = built[name]
            per_step = []
            for i in range(warmup + steps):
                x = torch.randint(0, cfg["vocab_size"], (batch_per_rank, seq + 1), generator=gen)
                dist.barrier()
                t0 = time.perf_counter()
                logits = model(x[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
                loss.backward()
                rt.sync_gradients()
                opt.step()
                opt.zero_grad()
                dt = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i >= warmup:
                    per_step.append(float(dt))
            times[name].append(per_step)
            a2a[name] = _bytes_off_rank(model, cfg["dim"], 4)
    out = {}
    for name in plans:
        sent, kept = a2a[name]
        tot = torch.tensor([float(sent)])
        dist.all_reduce(tot)
        out[name] = {"times": times[name], "a2a_bytes_fwd_dispatch_per_rank": float(tot) / world,
                     "params_local": built[name][3]}
    return out
