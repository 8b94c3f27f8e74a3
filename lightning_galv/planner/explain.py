"""The search's account of itself: what was searched, why the winner won, how close the runners-up came.

Kept apart from the search so the wording can change without touching the algorithm; it reads only
the finished plans and the search's counters.
"""

from __future__ import annotations

from typing import Sequence

from ..plan import ParallelPlan
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
             f"{budget / GiB:.2f} GiB per device"
             + (f" ({given / GiB:.2f} GiB less the safety margin)" if given is not None and given != budget else ""),
             best.describe()]
    counts = list(best.pp_division or ())
    if best.pp > 1 and len(set(counts)) > 1:
        lines.append(f"  uneven stages {counts}: stages differ in memory (in-flight micro-batches, embedding/head), "
                     "so balancing the step time moved layers between them")
    ck = sum(s.checkpoint for s in best.layers)
    if ck:
        lines.append(f"  {ck} layers recompute activations: without it the stage would not fit {budget / GiB:.2f} GiB")
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


def summary(plan: ParallelPlan) -> str:
    """The plan's distinct layer strategies in short form, at most three: enough to tell runners-up apart."""
    kinds = sorted({s.short() for s in plan.layers})
    return ",".join(kinds[:3]) + ("..." if len(kinds) > 3 else "")
