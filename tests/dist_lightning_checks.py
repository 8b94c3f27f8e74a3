"""Trainer-level checks run inside gloo ranks (processes launched externally, like torchrun).

Each rank also trains the single-process reference itself with a plain torch loop on the same
samples, so every number the Trainer produces is compared with an exact single-device run.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning_galv  # noqa: F401  (registers the strategy)
from lightning_galv import GalvatronStrategy, ParallelPlan
from lightning_galv.module import CausalLM

SMALL = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, max_seq_len=16)


class Windows(Dataset):
    def __init__(self, n: int, seq: int = 16, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 64, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"].detach().clone()
        dist.all_reduce(loss)
        self.losses.append(float(loss) / dist.get_world_size())


def make_module(kind: str = "llama", seed: int = 0, **extra: Any) -> CausalLM:
    torch.manual_seed(seed)
    cfg = dict(SMALL)
    if kind == "llama":
        cfg.update(n_kv_heads=2, ffn_hidden=64)
    cfg.update(extra)
    return CausalLM(kind=kind, optimizer="sgd", lr=0.2, momentum=0.9, **cfg)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for k, p in model.named_parameters()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference's scale (floored at 0.01, see dist_runtime_checks)."""
    return float((a - b).abs().max() / max(float(b.abs().max()), 0.01))


def reference(module: CausalLM, data: torch.Tensor, steps: int, global_batch: int, accumulate: int = 1,
              clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = module.configure_optimizers()
    losses = []
    for step in range(steps):
        total = 0.0
        for k in range(accumulate):
            i = (step * accumulate + k) * global_batch
            loss = module._loss(data[i:i + global_batch])
            (loss / accumulate).backward()
            total += float(loss.detach())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total / accumulate)
    return losses, {k: p.detach().clone() for k, p in module.model.named_parameters()}


def trainer_kwargs(**kw: Any) -> dict[str, Any]:
    base = dict(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0)
    base.update(kw)
    return base


def fit_compare(plan: dict | None, kind: str = "llama", steps: int = 10, global_batch: int = 8,
                accumulate: int = 1, clip: float | None = None, strategy_kwargs: dict | None = None) -> dict[str, Any]:
    """Trainer.fit under ``plan`` vs the single-process loop: losses and final weights."""
    module = make_module(kind)
    ref_module = copy.deepcopy(module)
    strategy = GalvatronStrategy(plan=plan, **(strategy_kwargs or {}))
    shards = ParallelPlan.from_dict(plan).data_parallel_size if plan else dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    data = Windows(steps * accumulate * global_batch)
    loader = DataLoader(data, batch_size=global_batch // shards, shuffle=False)
    rec = LossRecorder()
    trainer = L.Trainer(strategy=strategy, max_steps=steps, callbacks=[rec], accumulate_grad_batches=accumulate,
                        gradient_clip_val=clip, **trainer_kwargs())
    trainer.fit(module, loader)
    got = full_state(module.model)
    # Lightning's injected DistributedSampler shuffles training data with seed 0, epoch 0: at step t the
    # union of the ranks' batches is perm[t*G:(t+1)*G], which is what the reference consumes
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    ref_losses, want = reference(ref_module, data.data[perm], steps, global_batch, accumulate, clip)
    loss_rec = rec.losses[accumulate - 1::accumulate]  # one loss per optimizer step (mean of micro-batches differs)
    return {
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(_step_means(rec.losses, accumulate), ref_losses)),
        "weight_err": max(rel_err(got[k], want[k]) for k in want),
        "keys_equal": sorted(got) == sorted(want), "n_losses": len(loss_rec),
        "sampler": strategy.distributed_sampler_kwargs, "losses": rec.losses, "ref_losses": ref_losses,
    }


def _step_means(losses: list[float], accumulate: int) -> list[float]:
    return [sum(losses[i:i + accumulate]) / accumulate for i in range(0, len(losses), accumulate)]


def run_many(cases: list[tuple[str, str, dict]]) -> dict[str, Any]:
    """Several Trainer checks in one launch: (name, function name, kwargs)."""
    out = {}
    for name, fn, kw in cases:
        out[name] = globals()[fn](**kw)
        dist.barrier()
    return out


def fit_auto(steps: int = 5, per_shard: int = 2, memory_budget: str = "2GB") -> dict[str, Any]:
    """strategy='galvatron' with no plan: the planner picks one; it must still train exactly."""
    module = make_module("llama")
    ref_module = copy.deepcopy(module)
    data = Windows(steps * per_shard * int(os.environ["WORLD_SIZE"]))
    loader = DataLoader(data, batch_size=per_shard, shuffle=False)
    strategy = GalvatronStrategy(memory_budget=memory_budget)
    rec = LossRecorder()
    trainer = L.Trainer(strategy=strategy, max_steps=steps, callbacks=[rec], **trainer_kwargs())
    trainer.fit(module, loader)
    assert strategy.plan is not None
    g = per_shard * strategy.plan.data_parallel_size
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    ref_losses, want = reference(ref_module, data.data[perm], steps, g)
    got = full_state(module.model)
    return {"plan": strategy.plan.to_dict(), "loss_err": max(abs(a - b) / abs(b) for a, b in zip(rec.losses, ref_losses)),
            "weight_err": max(rel_err(got[k], want[k]) for k in want), "predicted": strategy.plan.prediction is not None}
