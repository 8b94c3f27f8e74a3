"""The main job: train a tiny LLaMA-style model on CPU with a heterogeneous Galvatron plan.

``python -m lightning_galv.demo`` (or ``galv demo``) starts 4 gloo processes, prints the plan and a loss
curve. ``--plan FILE`` trains with your plan; ``--auto`` lets the planner choose.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import lightning.pytorch as L
import torch

from ..plan import LayerStrategy, ParallelPlan

DEMO_MODEL = dict(kind="llama", vocab_size=256, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=128,
                  max_seq_len=64)
# --model moe: every block MoE (4 experts of half the dense width, top-2: the dense model's active compute)
DEMO_MOE = dict(DEMO_MODEL, kind="moe", num_experts=4, top_k=2, expert_hidden=64)


def demo_plan(world_size: int = 4) -> ParallelPlan:
    """Four different layer strategies on 4 ranks: the per-layer freedom Galvatron searches over."""
    if world_size != 4:
        return ParallelPlan.uniform(world_size, DEMO_MODEL["n_layers"], LayerStrategy(dp=world_size))
    return ParallelPlan(
        world_size=4,
        embed=LayerStrategy(tp=2, dp=2),                                  # vocab-parallel embedding
        layers=(LayerStrategy(tp=4, sp="megatron"),                        # TP + sequence-sharded norms
                LayerStrategy(tp=2, dp=2, checkpoint=True),                # TP x DP, recomputed
                LayerStrategy(tp=2, dp=2, sp="ulysses"),                   # all-to-all sequence parallel
                LayerStrategy(dp=4, zero=3)),                              # fully sharded data parallel
        head=LayerStrategy(dp=4, zero=2),
    )


class LossCurve(L.Callback):
    """Prints a compact loss curve on rank 0."""

    def __init__(self, every: int = 5) -> None:
        self.every, self.points = every, []
        self.start = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = float(trainer.callback_metrics.get("train_loss", outputs["loss"]))
        step = trainer.global_step
        if trainer.is_global_zero and (step % self.every == 0 or step == 1):
            self.points.append((step, loss))
            bar = "#" * max(1, int(loss * 8))
            print(f"step {step:4d}  loss {loss:6.3f}  {bar}", flush=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            print(f"trained {trainer.global_step} steps in {time.perf_counter() - self.start:.1f}s", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="galv demo", description=__doc__)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (samples per step)")
    p.add_argument("--plan", default=None, help="plan file (YAML/JSON); default: the built-in heterogeneous plan")
    p.add_argument("--auto", action="store_true", help="let the planner search a plan for this machine")
    p.add_argument("--model", choices=("llama", "moe"), default="llama",
                   help="llama, or the MoE decoder (every block MoE; aux losses logged, not in train_loss)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)

    from .. import GalvatronStrategy
    from .corpus import ByteCorpus
    from .module import CausalLM

    if args.auto:
        strategy = GalvatronStrategy()
        shards = args.devices  # the auto plan decides; the loader batch is fixed per rank below
    else:
        plan = ParallelPlan.load(args.plan) if args.plan else demo_plan(args.devices)
        strategy = GalvatronStrategy(plan=plan)
        shards = plan.data_parallel_size
    if args.batch_size % shards:
        raise ValueError(f"--batch-size {args.batch_size}: must be divisible by the plan's {shards} data shards. "
                         f"HINT: use a multiple of {shards}.")
    data = ByteCorpus(seq_len=DEMO_MODEL["max_seq_len"], batch_size=args.batch_size // shards)
    model = CausalLM(lr=3e-3, **(DEMO_MOE if args.model == "moe" else DEMO_MODEL))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        callbacks=[LossCurve()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=4,
                        val_check_interval=args.steps, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}, "
              f"val_loss {float(trainer.callback_metrics.get('val_loss', float('nan'))):.3f}")


if __name__ == "__main__":
    main()
