"""Rank-side code of ``benchmarks/overhead.py``: Trainer fits with our strategy and Lightning's, timed.

All fits run in ONE gloo launch, one after another, so every configuration sees the same machine state
and start-up costs are paid once; each pair (ours, Lightning's) alternates its order every round.
A fit's step time is measured from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward,
gradient sync, optimizer step); per step the slowest rank counts, the first ``warmup`` steps are dropped.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import lightning_galv  # noqa: F401  (registers the strategy)
from lightning_galv import GalvatronStrategy, LayerStrategy, ParallelPlan
from lightning_galv.demo.module import CausalLM

MODEL = dict(kind="llama", vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=8, ffn_hidden=768,
             max_seq_len=128, optimizer="adamw", lr=1e-3)


class Tokens(Dataset):
    def __init__(self, n: int, seq: int) -> None:
        self.data = torch.randint(0, MODEL["vocab_size"], (n, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class StepTimer(L.Callback):
    """Wall time and this process's CPU time of every training step.

    CPU time is recorded too because the machine is shared: other processes stretch wall time by tens
    of percent, while the CPU a rank itself burns per step is much less sensitive to them.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._t0 = self._c0 = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self._t0)
        self.cpu.append(time.process_time() - self._c0)


class FSDP2LM(CausalLM):
    """Lightning's recipe for ModelParallelStrategy + FSDP2: ``fully_shard`` per block, then the root."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=True)


class TPLM(CausalLM):
    """Lightning's recipe for ModelParallelStrategy + TP: ``parallelize_module`` with a Megatron plan."""

    def configure_model(self) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh["tensor_parallel"]
        parallelize_module(self.model, mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        })
        for block in self.model.layers:
            parallelize_module(block, mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            })


def _setup(name: str, world: int) -> tuple[Any, type[CausalLM], int]:
    """(strategy, module class, data-parallel shards) of one configuration."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    n = MODEL["n_layers"]
    if name == "ours_dp":
        return GalvatronStrategy(plan=ParallelPlan.uniform(world, n)), CausalLM, world
    if name == "lightning_ddp":
        return "ddp", CausalLM, world
    if name == "ours_zero3":
        return GalvatronStrategy(plan=ParallelPlan.uniform(world, n, LayerStrategy(dp=world, zero=3))), CausalLM, world
    if name == "lightning_fsdp2":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), FSDP2LM, world
    if name == "ours_tp":
        return GalvatronStrategy(plan=ParallelPlan.uniform(world, n, LayerStrategy(tp=world))), CausalLM, 1
    if name == "lightning_tp":
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world), TPLM, 1
    raise ValueError(f"configuration {name!r}: unknown. HINT: see PAIRS in benchmarks/overhead.py.")


def fit_once(name: str, world: int, steps: int, global_batch: int) -> tuple[list[float], list[float]]:
    """(wall time per step, slowest rank; CPU time per step, summed over ranks)."""
    os.environ["WORLD_SIZE"] = str(world)  # a previous Trainer's teardown removes it
    strategy, cls, shards = _setup(name, world)
    torch.manual_seed(0)
    module = cls(**MODEL)
    data = Tokens(steps * global_batch, MODEL["max_seq_len"])
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, callbacks=[timer],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, precision="32-true")
    trainer.fit(module, DataLoader(data, batch_size=global_batch // shards))
    t = torch.tensor(timer.times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    c = torch.tensor(timer.cpu, dtype=torch.float64)
    dist.all_reduce(c)
    return t.tolist(), c.tolist()


def bench(pairs: list[tuple[str, str]], rounds: int, steps: int, warmup: int, global_batch: int) -> dict[str, Any]:
    world = int(os.environ["WORLD_SIZE"])
    wall: dict[str, list[list[float]]] = {}
    cpu: dict[str, list[list[float]]] = {}
    for r in range(rounds):
        for ours, theirs in pairs:
            for name in ((ours, theirs) if r % 2 == 0 else (theirs, ours)):
                w, c = fit_once(name, world, steps, global_batch)
                wall.setdefault(name, []).append(w[warmup:])
                cpu.setdefault(name, []).append(c[warmup:])
                dist.barrier()
    out = {}
    for name, runs in wall.items():
        ts = [t for run in runs for t in run]
        cs = [t for run in cpu[name] for t in run]
        out[name] = {"median": statistics.median(ts), "n": len(ts), "cpu_median": statistics.median(cs),
                     "round_medians": [statistics.median(x) for x in runs]}
    return out
