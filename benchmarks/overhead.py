"""Step-time overhead of GalvatronStrategy vs Lightning's own strategies, same model and batch.

    python benchmarks/overhead.py            # prints the table and updates benchmarks/RESULTS.md

Three pairs on 4 CPU gloo ranks (LLaMA-style decoder, dim 256, 4 layers, seq 128, AdamW, fp32):

* our pure-DP plan  vs  ``strategy="ddp"``
* our ZeRO-3 plan   vs  ``ModelParallelStrategy`` + FSDP2 (``fully_shard`` per block in ``configure_model``)
* our TP=4 plan     vs  ``ModelParallelStrategy`` + TP (``parallelize_module`` in ``configure_model``)

Superseded for the headline figure by ``overhead_launches.py`` (one ratio per independent launch, with a
t-interval over launches: one pooled launch says nothing about how much the ratio moves between runs, so its
RESULTS.md section was removed); kept for its per-round and CPU-time breakdown of one launch.

All fits run in one launch (see ``benchmarks/_overhead_runs.py``); the members of a pair alternate
their order every round, and the ratio is ours / Lightning's median step time (goal <= 1.03).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lightning_galv.testing import run_distributed  # noqa: E402

PAIRS = [("ours_dp", "lightning_ddp"), ("ours_zero3", "lightning_fsdp2"), ("ours_tp", "lightning_tp")]
LABELS = {
    "ours_dp": ("plan ≡ DDP (dp4)", 'strategy="ddp"'),
    "ours_zero3": ("ZeRO-3 (dp4·zero3)", "ModelParallelStrategy + FSDP2"),
    "ours_tp": ("TP (tp4)", "ModelParallelStrategy + TP"),
}


def table(res: dict, args: argparse.Namespace, wall: float, load: tuple[float, float]) -> str:
    lines = [
        "## Strategy overhead vs Lightning (benchmarks/overhead.py)",
        "",
        f"4 CPU gloo ranks (1 thread each, 2 shared cores), LLaMA dim 256 · 4 layers · seq 128 · vocab 256, "
        f"AdamW fp32, global batch {args.batch}; {args.rounds} rounds × {args.steps} steps per fit, first "
        f"{args.warmup} dropped, per step the slowest rank; pair order alternates per round. Wall {wall:.0f} s. "
        "CPU s/step: CPU time of one step summed over the 4 ranks (median), insensitive to other load. "
        f"1-min load average before/after: {load[0]:.1f} / {load[1]:.1f} on 2 cores (4 ranks alone make 4; "
        "more means other jobs shared the machine and the wall ratios are noisy).",
        "",
        "| ours | Lightning | ours median step | Lightning median step | ratio (ours / Lightning) | per-round ratios "
        "| CPU s/step ours / Lightning | CPU ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ours, theirs in PAIRS:
        a, b = res[ours], res[theirs]
        per_round = ", ".join(f"{x / y:.3f}" for x, y in zip(a["round_medians"], b["round_medians"]))
        lines.append(f"| {LABELS[ours][0]} | {LABELS[ours][1]} | {a['median'] * 1e3:.1f} ms | "
                     f"{b['median'] * 1e3:.1f} ms | **{a['median'] / b['median']:.3f}** | {per_round} | "
                     f"{a['cpu_median']:.2f} / {b['cpu_median']:.2f} | {a['cpu_median'] / b['cpu_median']:.3f} |")
    return "\n".join(lines)


def write_results(text: str, path: Path) -> None:
    """Replace only our section of RESULTS.md (other sections belong to other benchmarks)."""
    from _results import write_section

    write_section("overhead", text, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="global batch (samples per step)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args()
    if args.warmup >= args.steps:
        raise ValueError(f"--warmup {args.warmup} >= --steps {args.steps}: nothing left to time. "
                         "HINT: e.g. --steps 25 --warmup 5.")
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    res = run_distributed(str(HERE / "_overhead_runs.py") + "::bench", 4,
                          (PAIRS, args.rounds, args.steps, args.warmup, args.batch),
                          init_process_group=False, timeout=3600)[0]
    text = table(res, args, time.perf_counter() - t0, (load0, os.getloadavg()[0]))
    print(text)
    if not args.no_write:
        write_results(text, HERE / "RESULTS.md")


if __name__ == "__main__":
    main()
