"""Why the cost model under-predicts fwd+bwd (issue 17): the blocks inside a training step vs alone, for the MoE
decoder (default) or the dense LLaMA (``--model dense``).

benchmarks/costmodel_accuracy.py --model moe finds the measured fwd+bwd of most MoE plans 5-16 % above the
prediction, while the checkpointed ep plans match it. The prediction composes per-block times that the profilers
take one block at a time (fresh random hidden states, ``y.backward(ones)``); a training step runs the blocks on
real embeddings, between an embedding, a head, a loss and an optimizer step, with the gradient all-reduce hooked
into backward. This script measures, per plan and launch (fresh processes), on every rank:

- ``in step``: the blocks' own forward and backward inside training steps, summed over the blocks (hooks stamp
  each block's forward start / end, and its backward from the gradient reaching its output to its input's
  gradient; a recompute's second forward is not counted as forward);
- the same steps with the gradient sync as the runtime runs it (``overlap``: buckets launched from backward
  hooks) and switched off during backward, run after it (``after``), interleaved step by step;
- ``alone``: each of the same model's blocks (as parallelized), timed the profilers' way at the per-rank batch
  its strategy runs, summed over the blocks (until this script took ``--model``, one block times the blocks, at the
  data shard's batch: half a tp-2 block's).

Each launch's value is the slowest rank's median over its steps; the table gives the median over launches and
the 95 % t-interval of the mean of the per-launch ratios. Models, batch and plans: costmodel_accuracy.py's.

    python benchmarks/moe_block_insitu.py [--model moe|dense] [--launches 5] [--steps 10] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _results import write_section  # noqa: E402
from _stats import interval  # noqa: E402

from costmodel_accuracy import moe_plans, plans  # noqa: E402

from lightning_galv.plan import ParallelPlan  # noqa: E402
from lightning_galv.testing import run_distributed  # noqa: E402

# the default plans per model (names of costmodel_accuracy.py's plans); ``--plans`` takes any of them that runs
# one stage and one micro-batch
PLANS = {"moe": ("2r moe dp2", "2r moe ep2", "2r moe ep2·ckpt", "4r moe dp4", "4r moe ep4", "4r moe ep4·ckpt"),
         "moe-wide": ("2r moe dp2", "2r moe ep2", "2r moe ep2·ckpt", "4r moe dp4", "4r moe ep2", "4r moe ep4",
                      "4r moe ep4·zero3", "4r moe ep2·tp2 attn"),
         "dense": ("2r dp2", "2r dp2·zero3", "2r tp2", "2r tp+sp2", "2r dp2·ckpt", "4r dp4", "4r tp2·dp2", "4r tp4")}


def selected(names: list[str] | None, model: str = "moe") -> dict[int, list[tuple[str, ParallelPlan]]]:
    """The plans of ``model`` named ``names`` (default :data:`PLANS`), by world size; a ``ValueError`` names an
    unknown plan or one this measurement cannot run (a pipeline or several micro-batches: the rank side runs one
    forward and backward per step)."""
    if model not in PLANS:
        raise ValueError(f"--model {model!r}: not a model of this benchmark. HINT: choose from {sorted(PLANS)}")
    known = dict(plans() if model == "dense" else moe_plans())
    runnable = {n for n, p in known.items() if p.pp == 1 and p.micro_batches == 1}
    bad = [n for n in names or () if n not in runnable]
    if bad:
        raise ValueError(f"--plans {bad}: not a one-stage, one-micro-batch plan of the {model} model. HINT: choose "
                         f"from {sorted(runnable)}")
    out: dict[int, list[tuple[str, ParallelPlan]]] = {}
    for n in names or PLANS[model]:
        out.setdefault(known[n].world_size, []).append((n, known[n]))
    return out


def _ci(xs: list[float]) -> str:
    mean, lo, hi = interval(xs)
    return f"{mean:.2f} [{lo:.2f}, {hi:.2f}]"


def parse_args(doc: str) -> argparse.Namespace:
    """The options both MoE diagnostics take (this script and moe_step_parts.py)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--model", choices=sorted(PLANS), default="moe",
                    help="costmodel_accuracy.py's MoE decoder (default) or its dense LLaMA")
    ap.add_argument("--plans", nargs="*", default=None,
                    help="plan names (default: the model's PLANS; any one-stage, one-micro-batch plan of "
                         "costmodel_accuracy.py for that model); a run with --plans does not write RESULTS.md")
    return ap.parse_args()


def launches(n: int, steps: int, plans_by_world: dict[int, list[tuple[str, ParallelPlan]]],
             before: Callable[[int], object] | None = None, model: str = "moe"
             ) -> Iterator[tuple[object, list[str], list[dict[str, float]]]]:
    """Run ``_moe_insitu_ranks.measure_all`` ``n`` times per world size of ``plans_by_world`` (fresh processes
    each time, plan order rotated per launch so no plan always runs first) and yield, per launch, what
    ``before(world)`` returned just ahead of it, the plan names in run order, and per plan the slowest rank's
    value of each key."""
    env = {"PYTHONPATH": f"{HERE}:{HERE.parent}"}
    for world, plans in plans_by_world.items():
        for launch in range(n):
            ahead = before(world) if before is not None else None
            order = plans[launch % len(plans):] + plans[:launch % len(plans)]
            per_rank = run_distributed("_moe_insitu_ranks:measure_all", world,
                                       ([p.to_dict() for _, p in order], steps, model), env=env, timeout=1200)
            slowest = [{k: max(rank[j][k] for rank in per_rank) for k in per_rank[0][j]} for j in range(len(order))]
            yield ahead, [name for name, _ in order], slowest
            print(f"{world} ranks, launch {launch + 1}/{n} done", flush=True)


def main() -> None:
    args = parse_args(__doc__)
    runs: dict[str, list[dict[str, float]]] = {}
    for _, names, slowest in launches(args.launches, args.steps, selected(args.plans, args.model),
                                      model=args.model):
        for name, r in zip(names, slowest):
            runs.setdefault(name, []).append(r)
    ms = lambda rs, k: statistics.median(r[k] for r in rs) * 1e3  # noqa: E731
    lines = [f"{args.launches} launches per world size, {args.steps} steps per mode after 4 warm-up steps each; "
             "ms = median over launches of the slowest rank's median; ratios: mean of the per-launch ratios "
             "[95 % t-interval].", "",
             "| plan | blocks fwd in step / alone (ms) | fwd ratio | blocks bwd in step, sync after / alone | "
             "bwd ratio | bwd with the sync overlapped / after | step overlapped / after (ms) | step ratio | "
             "page faults per step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        fr = [r["after_fwd"] / r["alone_fwd"] for r in rs]
        br = [r["after_bwd"] / r["alone_bwd"] for r in rs]
        sr = [r["overlap_step"] / r["after_step"] for r in rs]
        lines.append(f"| {name} | {ms(rs, 'after_fwd'):.1f} / {ms(rs, 'alone_fwd'):.1f} | {_ci(fr)} | "
                     f"{ms(rs, 'after_bwd'):.1f} / {ms(rs, 'alone_bwd'):.1f} | {_ci(br)} | "
                     f"{ms(rs, 'overlap_bwd'):.1f} / {ms(rs, 'after_bwd'):.1f} | "
                     f"{ms(rs, 'overlap_step'):.1f} / {ms(rs, 'after_step'):.1f} | {_ci(sr)} | "
                     f"{statistics.median(r['after_faults'] for r in rs) / 1e3:.1f} k |")
    report = "\n".join(lines)
    print(report)
    if not args.no_write and not args.plans:
        if args.model == "moe":
            write_section("moe_block_insitu", "## MoE blocks inside a training step vs alone "
                          "(benchmarks/moe_block_insitu.py)\n\n" + NOTES + "\n\n" + report)
        elif args.model == "moe-wide":
            write_section("moe_wide_block_insitu", "## Blocks of the dense-sized MoE decoder inside a training step "
                          "vs alone (benchmarks/moe_block_insitu.py --model moe-wide)\n\n" + NOTES + "\n\n" + report)
        else:
            write_section("dense_block_insitu", "## Dense blocks inside a training step vs alone "
                          "(benchmarks/moe_block_insitu.py --model dense)\n\n" + NOTES + "\n\n" + report)


NOTES = """What it tells: a fwd or bwd ratio above 1 is time the blocks take in a real step that the profilers'
one-block timing does not see (the cost model composes the latter); the overlapped / after columns show what
running the bucketed all-reduce from backward hooks costs the backward and the step. The plans' gradients fit
one 25 MiB bucket, so its all-reduce starts when backward ends either way; "overlapped" differs from "after" by
the hooks that copy each gradient into the bucket while backward runs."""


if __name__ == "__main__":
    main()
