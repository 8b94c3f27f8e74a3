"""Which part of a training step the cost model under-predicts (issue 17): blocks, ends, or per-step work -- for the
MoE decoder (default) or the dense LLaMA (``--model dense``).

benchmarks/costmodel_accuracy.py --model moe finds most MoE plans' fwd+bwd 5-16 % above the prediction, and
benchmarks/moe_block_insitu.py finds the blocks inside a step as fast as alone. This script takes, per launch, a
fresh profile the way that benchmark does (``costmodel_accuracy.profile_world``: automatic mode's profilers on
all ranks) and right after it measures the plans (benchmarks/_moe_insitu_ranks.py, the runtime's own overlapped
sync), splitting each step into:

- the MoE blocks' forward and backward (hooks on each block; all-to-all included), vs the cost model's per-layer
  ``fwd`` and ``bwd`` summed (``layer_cost``);
- the ends: the rest of fwd+bwd (embedding, final norm, head, loss), vs ``stage_fixed``'s per-micro-batch time
  (plus every re-layout outside the blocks: at the chunk's edges and between blocks of different strategies);
- after backward: the gradient sync still to wait for and the optimizer step, vs the layers' and the ends'
  per-step extras.

No speed correction: profile and measurement are minutes apart in one launch sequence. Each launch's value is the
slowest rank's median; the table gives the median over launches and the 95 % t-interval of the mean of the
per-launch (predicted / measured) ratios.

    python benchmarks/moe_step_parts.py [--model moe|moe-wide|dense] [--launches 5] [--steps 10] [--no-write]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _results import write_section  # noqa: E402
from _stats import interval  # noqa: E402
from costmodel_accuracy import MODELS, moe_plans, plans, profile_world  # noqa: E402
from moe_block_insitu import launches, parse_args, selected  # noqa: E402

from lightning_galv.planner.cost import GalvatronCostModel, StageContext  # noqa: E402


def predicted_parts(model, hw, plan) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The cost model's step split like the measurement (seconds; one stage, one micro-batch)."""
    cm = GalvatronCostModel(model, hw, runtime="native")
    m = plan.micro_batches
    ctx = StageContext(plan.stage_size, plan.global_batch // m, m, plan.pp, 0, plan.pipeline_schedule,
                       plan.virtual_stages)
    ends, extra, _ = cm.stage_fixed(plan.embed, plan.head, ctx, plan.vocab_parallel_loss)
    cost = cm.evaluate(plan)
    # what the measurement counts as ends besides the ends themselves: the re-layouts at the chunk's edges and
    # between blocks of different strategies (a heterogeneous plan's), all outside the blocks' hooks
    ends += cost.breakdown["transitions"]
    extra += cm.stage_sync_time(plan, 0, ctx)  # the stage's own gradient-sync part (after backward)
    fwd = bwd = hooked = 0.0
    for i, s in enumerate(plan.layers):
        c = cm.layer_cost(i, s, ctx)
        # the bucket copies the gradient hooks run inside backward count there, as measured
        fwd, bwd, extra = fwd + c.fwd, bwd + c.bwd + c.in_backward, extra + c.step_extra - c.in_backward
        hooked += c.in_backward
    ends_hooked = cost.stage_in_backward_s[0] - hooked  # the ends' own (embedding and head gradients)
    parts = {"fwd": fwd, "bwd": bwd, "ends": ends + ends_hooked, "extra": extra - ends_hooked}
    if abs(sum(parts.values()) - cost.step_time_s) > 1e-9 * max(1.0, cost.step_time_s):
        raise ValueError(f"plan parts sum to {sum(parts.values())} s, evaluate() to {cost.step_time_s} s: the split "
                         "must add up to the step. HINT: a part of the cost model is missing from this split.")
    return parts | {"step": cost.step_time_s}


def _ci(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    mean, lo, hi = interval(xs)
    return f"{mean:.2f} [{lo:.2f}, {hi:.2f}]"


def main() -> None:
    args = parse_args(__doc__)
    moe = args.model != "dense"
    by_name = dict(moe_plans() if moe else plans())
    rows: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {}
    cfg, seq = MODELS[args.model if moe else "llama"][:2]
    fresh = ((lambda world: profile_world(world, cfg, seq, "profile_machine_moe")) if moe  # noqa: E731
             else (lambda world: profile_world(world)))
    for (model, hw), names, slowest in launches(args.launches, args.steps, selected(args.plans, args.model),
                                                before=fresh, model=args.model):  # type: ignore[misc]
        for name, r in zip(names, slowest):
            meas = {"fwd": r["overlap_fwd"], "bwd": r["overlap_bwd"],
                    "ends": r["overlap_fb"] - r["overlap_fwd"] - r["overlap_bwd"],
                    "extra": r["overlap_step"] - r["overlap_fb"], "step": r["overlap_step"],
                    "sync": r["overlap_sync"], "opt": r["overlap_opt"]}
            rows.setdefault(name, []).append((predicted_parts(model, hw, by_name[name]), meas))
    ms = lambda pairs, side, k: statistics.median(p[side][k] for p in pairs) * 1e3  # noqa: E731
    lines = [f"{args.launches} launches per world size (a fresh profile each), {args.steps} steps per launch and plan "
             "after 4 warm-up steps; ms: median over launches of the slowest rank's median; ratio: mean of the "
             "per-launch predicted / measured [95 % t-interval].", "",
             "| plan | blocks fwd pred / meas (ms) | ratio | blocks bwd pred / meas | ratio | ends fwd+bwd pred / meas "
             "| ratio | after backward pred / meas (sync + optimizer) | ratio | step pred / meas | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, pairs in rows.items():
        cells = [name]
        for k in ("fwd", "bwd", "ends", "extra", "step"):
            ratio = _ci([p[0][k] / p[1][k] for p in pairs if p[1][k] > 0])
            meas = f"{ms(pairs, 1, k):.1f}" + (f" ({ms(pairs, 1, 'sync'):.1f} + {ms(pairs, 1, 'opt'):.1f})"
                                               if k == "extra" else "")
            cells += [f"{ms(pairs, 0, k):.1f} / {meas}", ratio]
        lines.append("| " + " | ".join(cells) + " |")
    report = "\n".join(lines)
    print(report)
    if not args.no_write and not args.plans:
        if args.model == "moe":
            write_section("moe_step_parts", "## MoE step parts, predicted vs measured (benchmarks/moe_step_parts.py)"
                          "\n\n" + NOTES + "\n\n" + report)
        elif moe:
            write_section("moe_wide_step_parts", "## MoE step parts of the dense-sized MoE decoder, predicted vs "
                          "measured (benchmarks/moe_step_parts.py --model moe-wide)\n\n" + WIDE_NOTES + "\n\n" + report)
        else:
            write_section("dense_step_parts", "## Dense step parts, predicted vs measured "
                          "(benchmarks/moe_step_parts.py --model dense)\n\n" + DENSE_NOTES + "\n\n" + report)


NOTES = """Model, batch and plans: costmodel_accuracy.py's MoE ones (dim 128, 4 MoE blocks of 8 experts, top-2, seq 64,
global batch 8). A ratio below 1 is a part the cost model under-predicts. "ends" is measured as fwd+bwd less the
blocks, so it also holds what runs between blocks (the runtime's re-layouts at the ends, hook overhead)."""

WIDE_NOTES = """Model, batch and plans: costmodel_accuracy.py's `--model moe-wide` ones (its dense model, dim 256, seq 128,
with every FFN as 8 experts of width 384, top-2; global batch 8). A ratio below 1 is a part the cost model
under-predicts. "ends" is measured as fwd+bwd less the blocks, so it also holds what runs between blocks (the
runtime's re-layouts at the ends, hook overhead)."""

DENSE_NOTES = """Model, batch and plans: costmodel_accuracy.py's dense ones (reference LLaMA, dim 256, 4 blocks, seq 128,
global batch 8). A ratio below 1 is a part the cost model under-predicts. "ends" is measured as fwd+bwd less the
blocks, so it also holds what runs between blocks (the runtime's re-layouts at the ends, hook overhead)."""


if __name__ == "__main__":
    main()
