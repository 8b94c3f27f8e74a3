"""P4: how close the analytic pick and the tuner's pick come to the best plan, measured exhaustively.

    python benchmarks/tuner_p4.py        # prints the table and updates benchmarks/RESULTS.md

On 4 CPU ranks and a small LLaMA (dim 128, 4 layers, seq 64, 4 samples per data shard, AdamW):
1. every plan of a reduced space (uniform layer strategies: dp4 with ZeRO 0-3 and checkpointing, tp2 x dp2
   with and without Megatron-SP, Ulysses-2 x dp2, tp4, and a 2-stage pipeline) is measured as a tuner trial
   with pruning off (the same trial path, ``warmup`` + ``steps`` steps, median step time);
2. the tuner runs as a user would run it (``tune(..., n_trials=10)``: analytic top plans first, then
   neighbours), in its own study.
Reported: the analytic pick (the tuner's first trial = the planner's top-1) and the tuned pick (best of the
10 trials), each divided by the best throughput measured anywhere. One run on a noisy 2-core machine: the
ratios carry that noise (each plan is measured once).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def main() -> str:
    import os

    import optuna

    from lightning_galv.plan import LayerStrategy as L
    from lightning_galv.plan import ParallelPlan
    from lightning_galv.tuning import tune

    os.environ["PYTHONPATH"] = str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")
    mod, dat = "_tune_factories:module", "_tune_factories:data"
    gb = 16

    def uni(s: L, **kw: object) -> ParallelPlan:
        return ParallelPlan.uniform(4, 4, s, global_batch=kw.pop("global_batch", gb), **kw)  # type: ignore[arg-type]

    space = [uni(L(dp=4)), uni(L(dp=4, zero=1)), uni(L(dp=4, zero=2)), uni(L(dp=4, zero=3)),
             uni(L(dp=4, checkpoint=True)), uni(L(tp=2, dp=2)), uni(L(tp=2, dp=2, sp="megatron")),
             uni(L(tp=2, dp=2, sp="ulysses")), uni(L(tp=4)),
             uni(L(dp=2), pp=2, micro_batches=2, global_batch=8)]
    tmp = tempfile.mkdtemp(prefix="galv_p4_")
    t0 = time.perf_counter()
    exhaustive = tune(mod, dat, devices=4, n_trials=len(space), storage=f"sqlite:///{tmp}/p4.db",
                      study_name="exhaustive", candidates=space, pruner=optuna.pruners.NopPruner(),
                      warmup_steps=2, steps=5, verbose=False)
    t_ex = time.perf_counter() - t0
    t0 = time.perf_counter()
    tuned = tune(mod, dat, devices=4, n_trials=10, storage=f"sqlite:///{tmp}/p4.db", study_name="tuned",
                 warmup_steps=2, steps=5, verbose=False)
    t_tu = time.perf_counter() - t0
    measured = [t for t in exhaustive.trials + tuned.trials if t["state"] == "COMPLETE" and t["throughput"]]
    best = max(measured, key=lambda t: t["throughput"])
    first = tuned.trials[0]
    lines = ["| | plan | samples/s | ÷ best |", "|---|---|---|---|",
             f"| best measured (exhaustive ∪ tuner) | {best['summary']} | {best['throughput']:.2f} | 1.00 |",
             f"| analytic pick (planner top-1) | {first['summary']} | {first['throughput'] or 0:.2f} | "
             f"{(first['throughput'] or 0) / best['throughput']:.2f} |",
             f"| tuned pick after {len(tuned.trials)} trials | {tuned.trials[[t['number'] for t in tuned.trials].index(max((t for t in tuned.trials if t['state'] == 'COMPLETE'), key=lambda t: t['throughput'] or 0)['number'])]['summary']} | "
             f"{tuned.best_throughput:.2f} | {tuned.best_throughput / best['throughput']:.2f} |"]
    body = ("## P4: analytic vs tuned pick vs exhaustive best (benchmarks/tuner_p4.py)\n\n"
            "4 gloo ranks, LLaMA dim 128 x 4 layers, seq 64, 4 samples per shard, AdamW; each trial 2 warm-up + 5 "
            f"measured steps (median). Exhaustive: {len(space)} plans of a reduced space in {t_ex:.0f} s; tuner: "
            f"{len(tuned.trials)} trials in {t_tu:.0f} s (goals: analytic ≥ 0.90, tuned ≥ 0.97 of the best).\n\n"
            + "\n".join(lines) + "\n\nExhaustive measurements:\n\n" + exhaustive.table()
            + "\n\nTuner trials:\n\n" + tuned.table() + "\n")
    print(body)
    from _results import write_section

    write_section("tuner_p4", body)
    return body


if __name__ == "__main__":
    main()
