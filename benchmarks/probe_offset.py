"""Does the speed probe time what the profile's speed reference times? (issue 17)

benchmarks/costmodel_accuracy.py scales every measured step to "profile speed" by (profile reference / probe). Until
6565948 the reference was the ShardedLayerProfiler's raw median of the unsharded block at 2 samples (timed interleaved
with every other variant) while the probe repeats that pass back to back (``costmodel_ranks.probe``); the two were
meant to read alike at equal speed, and part one checks it (since a0d3602 the reference is the probes around the
profile, ``costmodel_ranks._references``, because they did not). This script takes, in one launch per world size,
``--rounds`` profile runs (``costmodel_ranks.profile_machine``, exactly as the accuracy benchmark profiles) with
``--probes`` probes right before and right after each, seconds apart: a load (median of the round's probes / its
reference) away from 1 is a difference between the protocols, not drift, and the accuracy benchmark's "at profile
speed" column carries it.

Part two (``--context-launches``, 0 skips it): the accuracy benchmark's steps are scaled by probes taken *between
training steps*, with the plan's model, gradients and optimizer state alive. Per plan, probes with no model alive
right before it is built and right after it is freed, next to the probes between its steps, seconds apart: a ratio
away from 1 is the context, not the machine's speed, and the "at profile speed" column carries it as a load.

    python benchmarks/probe_offset.py [--rounds 6] [--probes 3] [--context-launches 3] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _results import write_section  # noqa: E402
from _stats import interval  # noqa: E402

from lightning_galv.testing import run_distributed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--probes", type=int, default=3)
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--context-launches", type=int, default=3,
                    help="launches per world size for part two (0: skip it)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.rounds < 2 or args.probes < 1:
        raise ValueError(f"--rounds {args.rounds} --probes {args.probes}: need at least 2 rounds (an interval) and 1 "
                         "probe. HINT: the defaults are 6 and 3.")
    env = {"PYTHONPATH": f"{HERE}:{HERE.parent}"}
    lines = [f"{args.rounds} profile runs per world size in one launch, {args.probes} probes right before and "
             f"{args.probes} right after each; load = median of the round's probes / the profile's reference; "
             "mean over rounds with its 95 % t-interval.", "",
             "| world | reference (ms, median) | probes before / after (ms, median) | load per round | "
             "load: mean [95 % CI] |", "|---|---|---|---|---|"]
    for world in args.worlds:
        res = run_distributed("_probe_offset_ranks:rounds", world, (args.rounds, args.probes), env=env,
                              timeout=3600)[0]
        loads = [statistics.median(before + after) / ref for ref, before, after in res]
        mean, lo, hi = interval(loads)
        med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        lines.append(f"| {world} ranks | {med([r for r, _, _ in res]):.1f} | "
                     f"{med([x for _, b, _ in res for x in b]):.1f} / {med([x for _, _, a in res for x in a]):.1f} | "
                     f"{', '.join(f'{x:.3f}' for x in loads)} | {mean:.3f} [{lo:.3f}, {hi:.3f}] |")
        print(lines[-1], flush=True)
    if args.context_launches:
        lines += ["", *context(args.context_launches, args.probes, args.worlds, env)]
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        write_section("probe_offset", "## Speed probe vs the profile's speed reference (benchmarks/probe_offset.py)"
                      "\n\n" + NOTES + "\n\n" + report)


# from small to large plan state, with and without checkpointing (costmodel_accuracy.plans' names)
CONTEXT_PLANS = ("2r dp2", "2r dp2·zero3", "2r tp2", "2r tp+sp2·ckpt",
                 "4r dp4", "4r dp4·zero3", "4r tp4", "4r tp4·ckpt")


def context(launches: int, probes: int, worlds: list[int], env: dict) -> list[str]:
    """Part two's table: per world size and plan, probes between training steps / probes with no model alive
    (the median of the ones right before and right after the plan), mean over launches with a t-interval."""
    from costmodel_accuracy import plans

    lines = [f"Probes between training steps vs with no model alive, seconds apart: {launches} launches per world "
             f"size, per plan {probes} probes right before it is built and {probes} right after it is freed, the "
             "probes between its steps as the accuracy benchmark takes them (before each of 5 measured steps after "
             "2 warm-up steps, and after the last); ratio = median between / median of the ones around, mean over "
             "launches [95 % t-interval].", "",
             "| plan | around (ms) | between steps (ms) | ratio: mean [95 % CI] |", "|---|---|---|---|"]
    for world in worlds:
        chosen = [(n, p.to_dict()) for n, p in plans() if n in CONTEXT_PLANS and p.world_size == world]
        per: dict[str, list[list[float]]] = {n: [] for n, _ in chosen}
        for launch in range(launches):
            k = launch % len(chosen)  # rotate the order: no plan always first
            res = run_distributed("_probe_offset_ranks:between_steps", world, (chosen[k:] + chosen[:k], probes),
                                  env=env, timeout=3600)[0]
            for n, v in res.items():
                per[n].append(v)
        for n, runs in per.items():
            ratios = [b / statistics.median([a, c]) for a, b, c in runs]
            mean, lo, hi = interval(ratios) if len(ratios) > 1 else (ratios[0], float("nan"), float("nan"))
            around = statistics.median(statistics.median([a, c]) for a, _, c in runs) * 1e3
            between = statistics.median(b for _, b, _ in runs) * 1e3
            lines.append(f"| {n} | {around:.1f} | {between:.1f} | {mean:.3f} [{lo:.3f}, {hi:.3f}] |")
            print(lines[-1], flush=True)
    return lines


NOTES = """Model: costmodel_accuracy.py's dense LLaMA; profiles as that benchmark takes them (every rank busy,
collectives, ModelProfiler, ShardedLayerProfiler with every variant and its checkpointed twin interleaved over 5
rounds). A load below 1 means the probe reads faster than the reference at the same moment: the accuracy
benchmark's "at profile speed" column then scales every measured step up by 1 / load, on top of any drift (that
benchmark's reference is, since a0d3602, the probes around the profile: the first table is why). In the second
table a ratio above 1 means a probe between training steps reads slower than one with no model alive seconds
apart: the accuracy benchmark then scales those steps down by it."""


if __name__ == "__main__":
    main()
