"""The search's account of itself: what was searched, why the winner won, how close the runners-up came.

Kept apart from the search so the wording can change without touching the algorithm; it reads only
the finished plans and the search's counters.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from ..plan import ParallelPlan
from ..units import format_bytes
from .profiles import ModelProfile

GiB = float(2**30)


def explain(plans: Sequence[ParallelPlan], profile: ModelProfile, stats: dict[str, float], budget: float,
            batches: list[int], given: float | None = None) -> str:
    """Why the winner won, in a few lines: what was searched, the winner, and the runners-up."""
    best = plans[0]
    assert best.prediction is not None
    lines = [f"searched {int(stats['configs'])} pipeline configurations ({int(stats['pruned_by_bound'])} skipped by "
             f"bound, {int(stats['infeasible'])} without a fitting plan; {int(stats['dp_runs'])} layer DPs, "
             f"{int(stats['shortcuts'])} closed-form) in {stats.get('wall_s', 0.0):.3f} s under "
             f"{format_bytes(budget)} per device"
             + (f" ({format_bytes(given)} less the safety margin)" if given is not None and given != budget else ""),
             best.describe()]
    counts = list(best.pp_division or ())
    if best.pp > 1 and len(set(counts)) > 1:
        lines.append(f"  uneven stages {counts}: stages differ in memory (in-flight micro-batches, embedding/head), "
                     "so balancing the step time moved layers between them")
    lines += _expert_lines(best, profile, stats)
    ck = sum(s.checkpoint for s in best.layers)
    if ck:
        lines.append(f"  {ck} layers recompute activations: without it the stage would not fit {format_bytes(budget)}")
    if len(batches) > 1:
        lines.append(f"  batch sweep {batches[0]}..{batches[-1]}: best throughput at global batch {best.global_batch}")
        if profile.per_sample_only:
            lines.append("  note: the time profile is per-sample (no per-call constant), so batch sizes differ only "
                         "by per-step costs (gradient sync, optimizer step, bubble); profile >= 2 batch sizes for "
                         "micro-batch efficiency")
    for rank, p in enumerate(plans[1:], start=2):
        assert p.prediction is not None
        lines.append(f"  #{rank}: pp{p.pp} {p.pipeline_schedule} m={p.micro_batches} batch={p.global_batch} "
                     f"{summary(p)}: {p.prediction.step_time_s * 1e3:.1f} ms, {p.prediction.throughput:.2f} samples/s "
                     f"({p.prediction.throughput / best.prediction.throughput:.3f}x)")
    return "\n".join(lines)


def _expert_lines(plan: ParallelPlan, profile: ModelProfile, stats: dict[str, float]) -> list[str]:
    """How the winner placed the experts of the MoE layers (nothing for a dense model)."""
    moe = [i for i in range(profile.num_layers) if profile.layer(i).moe is not None]
    if not moe:
        return []
    degrees = Counter(plan.layers[i].ep for i in moe)
    if set(degrees) == {1}:
        if stats.get("max_ep", 1) == 1:
            return [f"  {len(moe)} MoE layers keep every expert on every rank (ep=1): no expert-parallel degree was "
                    "in the search space (SearchSpace.ep_degrees, or no data group the experts divide)"]
        return [f"  {len(moe)} MoE layers keep every expert on every rank (ep=1): spreading them was priced slower "
                "(all-to-all per micro-batch vs. the smaller expert gradient sync and states)"]
    spread = ", ".join(f"ep{k} x{n}" for k, n in sorted(degrees.items()))
    return [f"  expert parallelism on the MoE layers ({spread} of {len(moe)}): each rank keeps E/ep experts and "
            "routes tokens to the others by all-to-all; dense layers keep ep=1"]


def summary(plan: ParallelPlan) -> str:
    """The plan's distinct layer strategies in short form, at most three: enough to tell runners-up apart."""
    kinds = sorted({s.short() for s in plan.layers})
    return ",".join(kinds[:3]) + ("..." if len(kinds) > 3 else "")
