"""The main job: train a tiny LLaMA-style model on CPU with a heterogeneous Galvatron plan.

``python -m lightning_galv.demo`` (or ``galv demo``) starts 4 gloo processes, prints the plan and a loss
curve. ``--plan FILE`` trains with your plan; ``--auto`` lets the planner choose. ``--steps`` may exceed
one pass over the corpus: training continues into further epochs, and validation runs once, after the
last step.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
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


def check_demo_args(steps: int, devices: int, batch_size: int) -> None:
    """Refuse what cannot train before any process starts (``--steps 0`` once died on a missing loss)."""
    from ..errors import bad_value

    if steps < 1:
        raise bad_value(f"--steps {steps}", "must be >= 1 (the demo trains, then reports its final loss)",
                        "e.g. --steps 40; any count works, also beyond one epoch")
    if devices < 1:
        raise bad_value(f"--devices {devices}", "must be >= 1", "e.g. --devices 4 (CPU processes)")
    if batch_size < 1:
        raise bad_value(f"--batch-size {batch_size}", "must be >= 1", "e.g. --batch-size 16")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="galv demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n  galv demo                      # 4 CPU ranks, 40 steps\n"
                                       "  galv demo --auto --steps 20    # the planner picks the plan\n"
                                       "  galv demo --plan recipes/plans/hetero4.yaml --model moe")
    p.add_argument("--devices", type=int, default=4, help="CPU processes (default 4)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (>= 1; may span several epochs)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (samples per step)")
    p.add_argument("--plan", default=None, help="plan file (YAML/JSON); default: the built-in heterogeneous plan")
    p.add_argument("--auto", action="store_true", help="let the planner search a plan for this machine")
    p.add_argument("--model", choices=("llama", "moe"), default="llama",
                   help="llama, or the MoE decoder (every block MoE; aux losses logged, not in train_loss)")
    p.add_argument("--timeline", default=None, metavar="OUT.png",
                   help="pipelined plans (pp > 1): draw a measured step's schedule (OnlineProfiler, last sampled step)")
    args = p.parse_args(argv)
    check_demo_args(args.steps, args.devices, args.batch_size)
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
    # validation drops partial batches (a pipeline splits every batch into its micro-batches), so a per-shard batch
    # larger than the validation split's share has nothing to validate: say so instead of reporting a NaN loss
    data.setup("fit")  # (tokenizes the shipped corpus, a second: the ranks' own setup reads the same windows)
    val_per_shard = -(-len(data.val) // shards)  # the distributed sampler pads every shard to the ceiling
    validates = val_per_shard >= data.batch_size
    model = CausalLM(lr=3e-3, **(DEMO_MOE if args.model == "moe" else DEMO_MODEL))
    from ..callbacks.loss_log import LossLog

    callbacks: list[L.Callback] = [LossLog(every=5, bar=True)]
    if args.timeline:
        from ..callbacks import OnlineProfiler

        # sample a late step (warm caches), a few times; no collective profiling: only the schedule is drawn
        callbacks.append(OnlineProfiler(every_n_steps=max(1, args.steps // 4), warmup_steps=min(2, args.steps - 1),
                                        collectives=False, log=False, timeline_png=args.timeline))
    # validation once, after the last step: counted in training batches across epochs (check_val_every_n_epoch
    # =None), so --steps beyond one epoch (165 batches of the shipped corpus at batch 16) is fine
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        max_epochs=-1, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=4 if validates else 0, val_check_interval=args.steps,
                        check_val_every_n_epoch=None,
                        num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    if args.timeline and trainer.is_global_zero:
        print(f"wrote {args.timeline}" if Path(args.timeline).is_file() else
              f"no timeline written: the plan has pp={strategy.plan.pp if strategy.plan else '?'} (needs pp > 1)")
    if trainer.is_global_zero:
        val = (f"val_loss {float(trainer.callback_metrics.get('val_loss', float('nan'))):.3f}" if validates else
               f"no val_loss: the validation split's {len(data.val)} windows give {val_per_shard} per data shard, "
               f"fewer than one batch of {data.batch_size} (HINT: a --batch-size of at most "
               f"{val_per_shard * shards} validates)")
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}, {val}")


if __name__ == "__main__":
    main()
