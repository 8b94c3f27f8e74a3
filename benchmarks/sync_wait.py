"""Where the gradient-sync wait after backward comes from (issue 17): rank skew or collective time.

The cost-model table (benchmarks/costmodel_accuracy.py) measures, per step, the slowest rank's time from the end
of its backward to the end of its gradient sync ("wait"), and finds it larger than the profiled all-reduce of the
whole gradient (2r dp2: 60 ms measured at b2346bf). Two causes give the same number: the ranks end backward at
different times (the first to finish waits for the last: *skew*), or the collective itself still runs after the
last rank's backward (*tail*: the part of the bucketed all-reduce that backward did not hide). This script
takes every rank's own clock marks (perf_counter, one clock for all processes of the machine) per step --
start after the barrier, backward end, sync end, optimizer end -- and splits the wait:

- ``skew`` = latest backward end - earliest backward end (over ranks),
- ``tail`` = latest sync end - latest backward end (collective time no backward overlapped),
- ``wait`` = the largest per-rank (sync end - backward end) = about skew + tail,
- ``start skew`` = spread of the start marks (how unevenly the ranks leave the barrier).

Next to them: the profiled all-reduce of the whole gradient on that many ranks (HardwareProfile, measured
with the ranks otherwise idle), and fwd+bwd measured vs the cost model's prediction (backward slowed by the
all-reduce's threads that run during it on a 2-core machine would show there).

    python benchmarks/sync_wait.py [--launches 5] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _results import write_section  # noqa: E402
from _stats import interval  # noqa: E402
from costmodel_accuracy import RANKS, Case, heldout_cases, plans, profile_for, profile_world  # noqa: E402

from lightning_galv.planner.cost import GalvatronCostModel  # noqa: E402

NAMES = ("2r dp2", "2r dp2·ckpt", "2r dp2·zero1", "2r tp2", "4r dp4", "4r dp4·ckpt ·L6", "4r tp4")


def cases() -> list[Case]:
    from costmodel_accuracy import CFG, SEQ

    every = [Case(n, p, CFG, SEQ) for n, p in plans()] + heldout_cases()
    return [c for c in every if c.name in NAMES]


def grad_bytes(cfg: dict) -> float:
    """fp32 gradient bytes of the whole model (every plan here keeps full replicas of what it all-reduces)."""
    from costmodel_ranks import make_model

    return 4.0 * sum(p.numel() for p in make_model(cfg).parameters())


def split(marks: list[list[list[float]]]) -> dict[str, float]:
    """Per-step medians (ms) of skew, tail, wait, start skew and the slowest rank's fwd+bwd from the clock marks."""
    out: dict[str, list[float]] = {k: [] for k in ("skew", "tail", "wait", "start", "fb", "after", "step")}
    for step in marks:  # step -> rank -> [start, backward end, sync end, optimizer end]
        start = [r[0] for r in step]
        bwd = [r[1] for r in step]
        sync = [r[2] for r in step]
        opt = [r[3] for r in step]
        out["skew"].append(max(bwd) - min(bwd))
        out["tail"].append(max(sync) - max(bwd))
        out["wait"].append(max(s - b for s, b in zip(sync, bwd)))
        out["start"].append(max(start) - min(start))
        out["fb"].append(max(b - s for s, b in zip(start, bwd)))
        out["after"].append(max(opt) - max(bwd))  # the step's critical path after the last backward: tail + optimizer
        out["step"].append(max(o - s for s, o in zip(start, opt)))
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def _ci(xs: list[float]) -> str:
    med = statistics.median(xs)
    if len(xs) < 2:
        return f"{med:.1f}"
    _, lo, hi = interval(xs)
    return f"{med:.1f} [{lo:.1f}, {hi:.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=5, help="independent launches per world size")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from lightning_galv.testing import run_distributed

    t_start = time.perf_counter()
    cs = cases()
    profiles = {}
    for world in (2, 4):
        t0 = time.perf_counter()
        profiles[world] = profile_world(world)
        print(f"profiles on {world} ranks: {time.perf_counter() - t0:.1f} s", flush=True)
    per: dict[str, list[dict[str, float]]] = {c.name: [] for c in cs}
    for launch in range(args.launches):
        for world in (2, 4):
            batch = [c for c in cs if c.plan.world_size == world]
            k = launch * len(batch) // args.launches  # rotate the order: no plan always runs first
            order = batch[k:] + batch[:k]
            t0 = time.perf_counter()
            res = run_distributed(f"{RANKS}::measure_plans", world,
                                  ([(c.name, c.plan.to_dict(), c.cfg, c.seq) for c in order], args.warmup, args.steps,
                                   False), timeout=1800)
            print(f"launch {launch + 1}/{args.launches}: {len(batch)} plans on {world} ranks: "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            for c in order:
                per[c.name].append(split(res[0][c.name]["marks"]))
    rows = []
    shares: list[tuple[str, float]] = []
    for c in cs:
        model, hw = profiles[c.plan.world_size]
        pred = GalvatronCostModel(profile_for(model, c), hw, runtime="native").evaluate(c.plan)
        dp = c.plan.layers[0].dp
        ar = hw.collective_time("allreduce", grad_bytes(c.cfg), dp) * 1e3 if dp > 1 else 0.0
        runs = per[c.name]
        col = {k: [r[k] for r in runs] for k in runs[0]}
        fb, ex = pred.phases(0, c.plan.micro_batches)
        rows.append(f"| {c.name} | {_ci(col['wait'])} | {_ci(col['skew'])} | {_ci(col['tail'])} | "
                    f"{_ci(col['start'])} | {ar:.1f} | {_ci(col['fb'])} | "
                    f"{fb * 1e3:.1f} | {_ci(col['after'])} | "
                    f"{ex * 1e3:.1f} | {_ci(col['step'])} | {pred.step_time_s * 1e3:.1f} |")
        shares.append((c.name, statistics.median(col["skew"]) / statistics.median(col["wait"])
                       if statistics.median(col["wait"]) > 0 else 0.0))
    head = ("## Gradient-sync wait split into rank skew and collective tail (benchmarks/sync_wait.py)\n\n"
            f"{args.launches} launches per world size (new processes, plan order rotated), per launch the median "
            f"of {args.steps} steps after {args.warmup} warm-up steps; each cell: median over launches [95 % "
            "t-interval of the mean], ms, raw (not scaled to profile speed). *wait*: the largest per-rank time from "
            "backward end to sync end (the cost-model table's wait); *skew*: latest - earliest backward end over "
            "ranks; *tail*: latest sync end - latest backward end (collective time no backward hid); *start skew*: "
            "spread of the ranks' step starts after the barrier; *profiled all-reduce*: the whole fp32 gradient on "
            "the plan's data group, from the hardware profile of this run (ranks otherwise idle); *fwd+bwd*: the "
            "slowest rank's, vs the cost model's prediction from this run's profiles; *after backward*: the step's "
            "critical path after the last rank's backward ends (tail + optimizer), vs the prediction's per-step "
            "part; *step*: the slowest rank's step vs the predicted step time.\n\n"
            "| plan | wait | skew | tail | start skew | profiled all-reduce | fwd+bwd measured | fwd+bwd predicted "
            "| after backward measured | predicted | step measured | predicted |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    dp_rows = [(n, x) for n, x in shares if "dp" in n]
    foot = ("\nShare of the wait that is rank skew (median skew / median wait) on the data-parallel plans: "
            + ", ".join(f"{n} {x:.0%}" for n, x in dp_rows) + ". Skew does not lengthen the step beyond the "
            "slowest rank's fwd+bwd + the tail: the rank that finishes backward first waits for the slowest, whose "
            "fwd+bwd is already counted; a phase table that takes each phase's own slowest rank counts it twice.")
    report = head + "\n" + "\n".join(rows) + "\n" + foot
    print(report)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if not args.no_write:
        write_section("sync_wait", report)


if __name__ == "__main__":
    main()
