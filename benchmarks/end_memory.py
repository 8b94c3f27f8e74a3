"""Predicted vs measured peak memory of plans whose embedding and head are FSDP2 units (ZeRO-2/3 ends).

    python benchmarks/end_memory.py

Why a separate check: the accuracy table's plans (``costmodel_accuracy.py``) keep both ends at ZeRO-0, while the
search may shard them (``LayerStrategy`` of ``plan.embed`` / ``plan.head``); until 7870610 the cost model priced
sharded ends with the textbook ZeRO bytes only (no ZeRO-2 sharded copy, no unsharded gradient kept while
accumulating, no gathered ZeRO-3 head at the start of backward). Here plans with ZeRO-2/3 ends run on 2 ranks
(the reference LLaMA of the accuracy table, its global batch 8) and their live-tensor peak (MemTracker, max over
ranks, ``costmodel_ranks.measure_plans``) is set against this checkout's prediction from the profiles stored with
the accuracy table's run (launch 0, 2 ranks; memory predictions use the profile's activation bytes, which do not
change between profile runs). Live-tensor bytes are deterministic for a plan, so one launch suffices.

Writes its own RESULTS.md section, stamped with commit, date, load and command line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from costmodel_accuracy import CFG, GLOBAL_BATCH, RANKS, SEQ  # noqa: E402

from lightning_galv import LayerStrategy as S  # noqa: E402
from lightning_galv import ParallelPlan  # noqa: E402
from lightning_galv.planner.cost import GalvatronCostModel  # noqa: E402
from lightning_galv.planner.profiles import HardwareProfile, ModelProfile  # noqa: E402

MiB = 2**20
# (blocks' ZeRO stage, the ends' ZeRO stage, micro-batches)
CASES = [(3, 0, 2), (3, 3, 2), (3, 3, 1), (2, 2, 2), (2, 2, 1), (0, 2, 1), (0, 3, 2), (1, 3, 2)]


def plan(zero: int, end_zero: int, m: int) -> ParallelPlan:
    return ParallelPlan.uniform(2, CFG["n_layers"], S(dp=2, zero=zero), global_batch=GLOBAL_BATCH,
                                micro_batches=m).with_(embed=S(dp=2, zero=end_zero), head=S(dp=2, zero=end_zero))


def main() -> None:
    from lightning_galv.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default=str(HERE / "data" / "costmodel_llama_profiles.json"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    m, h = json.loads(Path(args.profiles).read_text())[0]["2"][:2]
    cost = GalvatronCostModel(ModelProfile.from_dict(m), HardwareProfile.from_dict(h), runtime="native")
    cases = [(f"blocks ZeRO-{z}, ends ZeRO-{ez}, m={mb}", plan(z, ez, mb)) for z, ez, mb in CASES]
    res = run_distributed(f"{RANKS}::measure_plans", 2, ([(n, p.to_dict(), CFG, SEQ) for n, p in cases], 1, 2, True),
                          timeout=1800)
    lines = ["## Peak memory with sharded embedding and head (benchmarks/end_memory.py)", "",
             "2 CPU gloo ranks, reference LLaMA (dim 256, 4 layers, vocab 512, seq 128), global batch 8, fp32, Adam; "
             "every block and both ends data parallel over the 2 ranks. Measured: live-tensor peak of one step "
             "(MemTracker, max over ranks); predicted: this commit's native cost model from the accuracy table's "
             f"stored profiles ({Path(args.profiles).name}, launch 0).", "",
             "| plan | predicted | measured | err |", "|---|---|---|---|"]
    errs = []
    for n, p in cases:
        meas = max(r[n]["peak_bytes"] for r in res) / MiB
        pred = cost.evaluate(p).peak_memory_bytes / MiB
        errs.append(abs(pred / meas - 1))
        lines.append(f"| {n} | {pred:.2f} MiB | {meas:.2f} MiB | {(pred / meas - 1) * 100:+.1f}% |")
    lines += ["", f"|err|: median {statistics.median(errs) * 100:.1f}%, max {max(errs) * 100:.1f}% over {len(errs)} plans."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        from _results import write_section

        write_section("end_memory", text, HERE / "RESULTS.md")


if __name__ == "__main__":
    main()
