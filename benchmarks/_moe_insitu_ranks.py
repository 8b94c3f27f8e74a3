"""Rank side of benchmarks/moe_block_insitu.py: per plan, the model's blocks (MoE or dense) timed inside training
steps and alone."""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from costmodel_accuracy import MODELS
from costmodel_ranks import make_model
from lightning_galv.layout import MeshFactory, RankLayout
from lightning_galv.parallel.parallelize import parallelize
from lightning_galv.plan import ParallelPlan


def _block_clock(blocks: torch.nn.ModuleList, events: list[tuple[str, int, float]]) -> list[Any]:
    """Hooks that stamp each block's forward start/end and backward start (gradient reaches its output) and end
    (gradient of its input computed). A checkpointed block's recompute stamps its forward again: the first stamp
    of each kind per step is the one read."""
    def pre(m: torch.nn.Module, args: tuple) -> None:
        events.append(("f0", id(m), time.perf_counter()))
        if isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(lambda g, m=m: events.append(("b1", id(m), time.perf_counter())))

    def post(m: torch.nn.Module, args: tuple, out: Any) -> None:
        events.append(("f1", id(m), time.perf_counter()))
        o = out[0] if isinstance(out, tuple) else out
        if o.requires_grad:
            o.register_hook(lambda g, m=m: events.append(("b0", id(m), time.perf_counter())))

    return [b.register_forward_pre_hook(pre) for b in blocks] + [b.register_forward_hook(post) for b in blocks]


def _sums(events: list[tuple[str, int, float]]) -> tuple[float, float]:
    first: dict[int, dict[str, float]] = {}
    for kind, mid, t in events:
        first.setdefault(mid, {}).setdefault(kind, t)
    fwd = sum(v["f1"] - v["f0"] for v in first.values())
    bwd = sum(v["b1"] - v["b0"] for v in first.values() if "b0" in v and "b1" in v)
    return fwd, bwd


def measure(plan_dict: dict, steps: int, model_kind: str = "moe") -> dict[str, float]:
    """Medians (seconds) on this rank for the plan ``plan_dict`` (one stage, one micro-batch) of the MoE decoder
    (``model_kind="moe"``), its dense-sized one (``"moe-wide"``) or the dense LLaMA (``"dense"``) of
    costmodel_accuracy.py. ``overlap``: steps as the
    runtime runs them (gradient all-reduce buckets launched from backward hooks); ``after``: the same steps with
    the sync switched off during backward and run after it; ``alone``: each of the model's own (parallelized)
    blocks, fresh random input at the per-rank batch its strategy runs, ``y.backward(ones)``, sync off -- the
    profilers' protocol -- summed over the blocks."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg, seq = MODELS["llama" if model_kind == "dense" else model_kind][:2]
    plan = ParallelPlan.from_dict(plan_dict)
    model = make_model(cfg)
    rt = parallelize(model, plan, MeshFactory(RankLayout(plan.world_size, 1), "cpu", rank))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    rt.wrap_optimizer(opt)
    shard, shards = rt.data_shard
    b = plan.global_batch // shards
    data = torch.randint(0, cfg["vocab_size"], (plan.global_batch, seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = data[shard * b:(shard + 1) * b, :-1], data[shard * b:(shard + 1) * b, 1:]
    events: list[tuple[str, int, float]] = []
    hooks = _block_clock(model.layers, events)
    got: dict[str, list[float]] = {}
    warm = 4
    for i in range(2 * (steps + warm)):  # the two modes interleaved, so drift hits both alike
        mode = ("overlap", "after")[i % 2]
        rt.set_gradient_sync(mode == "overlap")
        dist.barrier()
        events.clear()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        t1 = time.perf_counter()
        rt.set_gradient_sync(True)
        rt.sync_gradients()
        ts = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if i >= 2 * warm:
            fwd, bwd = _sums(events)
            for k, v in (("step", t2 - t0), ("fb", t1 - t0), ("fwd", fwd), ("bwd", bwd), ("sync", ts - t1),
                         ("opt", t2 - ts),
                         ("faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)):
                got.setdefault(f"{mode}_{k}", []).append(v)
    for h in hooks:
        h.remove()
    rt.set_gradient_sync(False)
    got["alone_fwd"], got["alone_bwd"] = [0.0] * steps, [0.0] * steps
    for blk, s in zip(model.layers, plan.layers):
        bb = plan.global_batch // s.dp  # the per-rank batch this block runs: its data-parallel degree's share
        for i in range(steps + warm):
            xi = torch.randn(bb, seq, cfg["dim"], requires_grad=True)
            dist.barrier()
            t0 = time.perf_counter()
            out = blk(xi)
            out = out[0] if isinstance(out, tuple) else out
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            blk.zero_grad(set_to_none=True)
            if i >= warm:  # step i's sample of the sum over blocks
                got["alone_fwd"][i - warm] += t1 - t0
                got["alone_bwd"][i - warm] += t2 - t1
    rt.set_gradient_sync(True)
    return {k: statistics.median(v) for k, v in got.items()}


def measure_all(plans: list[dict], steps: int, model_kind: str = "moe") -> list[dict[str, float]]:
    return [measure(p, steps, model_kind) for p in plans]
