"""Does the speed probe time what the profile's speed reference times? (issue 17)

benchmarks/costmodel_accuracy.py scales every measured step to "profile speed" by (profile reference / probe), where
the reference is the ShardedLayerProfiler's raw median of the unsharded block at 2 samples (timed interleaved with
every other variant) and the probe repeats that pass back to back (``costmodel_ranks.probe``). The two are meant to
read alike at equal speed. This script takes, in one launch per world size, ``--rounds`` profile runs
(``costmodel_ranks.profile_machine``, exactly as the accuracy benchmark profiles) with ``--probes`` probes right
before and right after each, seconds apart: a load (median of the round's probes / its reference) away from 1 is a
difference between the protocols, not drift, and the accuracy benchmark's "at profile speed" column carries it.

    python benchmarks/probe_offset.py [--rounds 6] [--probes 3] [--no-write]
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
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        write_section("probe_offset", "## Speed probe vs the profile's speed reference (benchmarks/probe_offset.py)"
                      "\n\n" + NOTES + "\n\n" + report)


NOTES = """Model: costmodel_accuracy.py's dense LLaMA; profiles as that benchmark takes them (every rank busy,
collectives, ModelProfiler, ShardedLayerProfiler with every variant and its checkpointed twin interleaved over 5
rounds). A load below 1 means the probe reads faster than the reference at the same moment: the accuracy
benchmark's "at profile speed" column then scales every measured step up by 1 / load, on top of any drift."""


if __name__ == "__main__":
    main()
