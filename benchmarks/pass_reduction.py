"""How a profile should reduce its ranks' passes when ranks share cores (issue 17).

The ShardedLayerProfiler times each block variant in passes that all ranks start together, and the
accuracy benchmark's speed probe repeats that pass. Until 2026-12-02 both took each rank's median over the passes,
then the largest over ranks; now each pass's slowest rank, then the median over passes
(``profilers._slowest_rank_medians``). A step waits for its slowest rank; with more ranks than cores, which ranks
share a core changes from pass to pass, and each rank's median comes mostly from the passes it had a core to
itself. This script measures both reductions of one block's passes against what they stand for: the model's blocks
run back to back, forward then backward (a data-parallel step's compute between its collectives), the slowest
rank's per round, then the median, per block. A ratio below 1 is a reduction that under-reads the step.

    python benchmarks/pass_reduction.py [--launches 5] [--rounds 12] [--no-write]
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


def per_rank_then_max(per: list[list[list[float]]]) -> float:
    """Each rank's median forward and median backward, then the largest of each over ranks, summed (the old
    reduction). ``per[rank][round] = (fwd, bwd)``."""
    fwd = max(statistics.median(p[0] for p in rank) for rank in per)
    bwd = max(statistics.median(p[1] for p in rank) for rank in per)
    return fwd + bwd


def slowest_per_pass(per: list[list[list[float]]]) -> float:
    """Each round's slowest rank's forward + backward, then the median over rounds (the reduction since
    2026-12-02)."""
    rounds = len(per[0])
    return statistics.median(max(rank[i][0] + rank[i][1] for rank in per) for i in range(rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.launches < 2 or args.rounds < 3:
        raise ValueError(f"--launches {args.launches} --rounds {args.rounds}: need at least 2 launches (an "
                         "interval) and 3 rounds (a median). HINT: the defaults are 5 and 12.")
    env = {"PYTHONPATH": f"{HERE}:{HERE.parent}"}
    lines = [f"{args.launches} launches per world size (fresh processes), {args.rounds} rounds each after one "
             "that warms up; per launch: the block's passes reduced both ways and the back-to-back blocks' "
             "forward + backward (slowest rank per round, median, / blocks); ratios: mean over launches of the "
             "per-launch ratio [95 % t-interval].", "",
             "| world | samples per rank | blocks back to back, per block (ms) | each rank's median, then the "
             "largest (ms) | ratio to back to back | each pass's slowest rank, then the median (ms) | ratio to "
             "back to back |", "|---|---|---|---|---|---|---|"]
    for world in args.worlds:
        old, new, chain, ro, rn = [], [], [], [], []
        for _ in range(args.launches):
            res = run_distributed("_pass_reduction_ranks:passes", world, (args.rounds,), env=env, timeout=1800)[0]
            c = slowest_per_pass(res["chain"]) / res["blocks"]
            o, n = per_rank_then_max(res["single"]), slowest_per_pass(res["single"])
            old.append(o)
            new.append(n)
            chain.append(c)
            ro.append(o / c)
            rn.append(n / c)
        (mo, lo_o, hi_o), (mn, lo_n, hi_n) = interval(ro), interval(rn)
        med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        lines.append(f"| {world} ranks | {res['batch']} | {med(chain):.1f} | {med(old):.1f} | {mo:.3f} "
                     f"[{lo_o:.3f}, {hi_o:.3f}] (launches {min(ro):.2f}-{max(ro):.2f}) | {med(new):.1f} | {mn:.3f} "
                     f"[{lo_n:.3f}, {hi_n:.3f}] (launches {min(rn):.2f}-{max(rn):.2f}) |")
        print(lines[-1], flush=True)
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        write_section("pass_reduction", "## Reducing a profile's passes over ranks (benchmarks/pass_reduction.py)"
                      "\n\n" + NOTES + "\n\n" + report)


NOTES = """Model: costmodel_accuracy.py's dense LLaMA block (dim 256, seq 128, fp32, 1 thread per rank, gloo),
at the per-rank batch of data parallelism over the world at global batch 8. One block's pass as the
ShardedLayerProfiler times a variant (a fresh input, all ranks starting together, backward from a ones gradient),
next to the model's 4 blocks back to back in the same launch, alternating round by round. At 2 ranks every rank
has a core; at 4, two ranks share each core."""


if __name__ == "__main__":
    main()
