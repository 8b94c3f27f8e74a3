"""P7 (LAER-MoE expert re-layout): max/mean expert load per rank before / after, and planner latency.

    flock /tmp/galv-cpu.lock python benchmarks/moe_relayout.py    # prints the table, updates RESULTS.md

Every (step, MoE layer) of a routing trace is one problem: ``load[e]`` = assignments routed to expert ``e``
over the step's samples (what the callback gets from globally reduced RoutingStats). "Before" is plain
expert parallelism (``ExpertLayout.static``: one expert per rank here), "after" is ``plan_relayout`` with
``slots_per_rank`` expert slots per rank. Imbalance = max / mean of the expected tokens per rank. Traces:
the recorded corpus trace (8 experts on 8 ranks; steps 0-49 labelled as the early-training slice, where
routing is most skewed), and the scaled 64- and 1024-device traces (benchmarks/traces.py); with as many experts
as ranks the planner takes the exact alias construction, so the traces are also scaled to twice as many experts
as ranks (two per rank, the callback's default E/ep + 1 = 3 slots), where the greedy runs. Also: how many
(rank, expert) materializations the layout adds relative to the previous step's (what a re-layout must
all-gather), and the planner's wall time (median per problem, 95 % t-interval over repeats).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _stats import interval  # noqa: E402
from traces import load_trace, scale_trace  # noqa: E402

from lightning_galv.planner.relayout import ExpertLayout, new_materializations, plan_relayout  # noqa: E402


def expert_bytes(lay: ExpertLayout, num_experts: int) -> tuple[float, float, float, float]:
    """Expert parameters a layout makes the EP group send per forward, in whole experts: (group total, largest
    sender) with experts whole on their plain-EP owners, then the same with fully sharded experts (FSEP: every
    rank holds 1/k of each; each rank gathers the other (k-1)/k of every expert its slots hold)."""
    k = len(lay.slots)
    per = num_experts // k
    sent = np.zeros(k)
    for r, slots in enumerate(lay.slots):
        for e in slots:
            if e // per != r:
                sent[e // per] += 1
    held = np.array([len(s) for s in lay.slots], dtype=float)
    fsep = (held.sum() - held) / k  # rank q sends its 1/k of every expert held by the other ranks
    return float(sent.sum()), float(sent.max()), float(fsep.sum()), float(fsep.max())


def run_case(loads: list[np.ndarray], ranks: int, slots: int, repeats: int, per_layer: int) -> dict:
    """loads: per problem [E], in (step, layer) order with ``per_layer`` layers per step."""
    e = loads[0].size
    static = ExpertLayout.static(e, ranks)
    before, after, added, used, moved = [], [], [], [], []
    prev: dict[int, ExpertLayout] = {}
    for i, load in enumerate(loads):
        lay = plan_relayout(load.tolist(), ranks, slots)
        before.append(static.with_load(load.tolist()).imbalance)
        after.append(lay.imbalance)
        used.append(sum(len(sl) for sl in lay.slots) / ranks)
        moved.append(expert_bytes(lay, e))
        j = i % per_layer
        if j in prev:
            added.append(len(new_materializations(prev[j], lay)))
        prev[j] = lay
    reps, every = [], []
    for _ in range(repeats):
        ts = []
        for load in loads:
            lv = load.tolist()
            t0 = time.perf_counter()
            plan_relayout(lv, ranks, slots)
            ts.append(time.perf_counter() - t0)
        reps.append(statistics.median(ts))
        every += ts
    b, a = np.array(before), np.array(after)
    skewed = b >= 1.5
    return dict(n=len(loads), before=b.mean(), before_max=b.max(), after=a.mean(), after_max=a.max(),
                skewed=int(skewed.sum()), skewed_after_max=float(a[skewed].max()) if skewed.any() else float("nan"),
                skewed_ok=float((a[skewed] <= 1.10).mean()) if skewed.any() else float("nan"),
                added=float(np.mean(added)) if added else 0.0, time=interval(reps), time_med=statistics.median(reps),
                time_max=max(every), used=float(np.mean(used)),
                slots_total=ranks * slots, moved=np.mean(np.array(moved), axis=0))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    trace = load_trace()
    nl = len(trace.layers)
    rec = [trace.expert_load()[s, l] for s in range(trace.steps) for l in range(nl)]
    cases = [("recorded, 8 ranks, 8 experts, all 300 steps", rec, 8, 2),
             ("recorded, 8 ranks, 8 experts, all 300 steps", rec, 8, 3),
             ("recorded, EARLY TRAINING slice (steps 0-49)", rec[:50 * nl], 8, 2)]
    steps64 = list(range(0, trace.steps, 10))
    sc = scale_trace(trace, 64, 4, 64, steps=steps64, seed=1).expert_load()
    cases.append(("scaled, 64 devices x 4 samples, 64 experts (30 steps)",
                  [sc[i, l] for i in range(len(steps64)) for l in range(nl)], 64, 2))
    cases.append(("scaled, 64 devices x 4 samples, 64 experts (30 steps)", cases[-1][1], 64, 3))
    sc16 = scale_trace(trace, 8, 4, 16, seed=2).expert_load()
    cases.append(("scaled, 8 devices x 4 samples, 16 experts (2 per rank), all 300 steps",
                  [sc16[i, l] for i in range(trace.steps) for l in range(nl)], 8, 3))
    sc128 = scale_trace(trace, 64, 4, 128, steps=steps64, seed=3).expert_load()
    cases.append(("scaled, 64 devices x 4 samples, 128 experts (2 per rank, 30 steps)",
                  [sc128[i, l] for i in range(len(steps64)) for l in range(nl)], 64, 3))
    big = []
    for i, step in enumerate(range(0, trace.steps, 30)):  # 10 steps x 4 layers, one scaled (step, layer) at a time
        for l in range(nl):
            big.append(scale_trace(trace, 1024, 4, 1024, steps=[step], layers=[l], seed=100 + i).expert_load()[0, 0])
    cases.append(("scaled, 1024 devices x 4 samples, 1024 experts (10 steps)", big, 1024, 2))

    rows = ["| trace | ranks | slots per rank (used, mean) | problems | max/mean before: mean (max) | after: mean (max) | "
            "problems with before >= 1.5: count, after <= 1.10 share, worst after | added materializations "
            "per step vs previous step | expert copies sent per forward, owner mode: group / largest sender | FSEP: group / "
            "largest sender | planner time median [95 % CI], slowest problem |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, loads, ranks, slots in cases:
        r = run_case(loads, ranks, slots, args.repeats, nl)
        m, lo, hi = (x * 1e3 for x in r["time"])
        rows.append(f"| {label} | {ranks} | {slots} ({r['used']:.2f}) | {r['n']} | {r['before']:.2f} ({r['before_max']:.2f}) | "
                    f"{r['after']:.3f} ({r['after_max']:.3f}) | {r['skewed']}, {100 * r['skewed_ok']:.0f} %, "
                    f"{r['skewed_after_max']:.3f} | {r['added']:.1f} of {r['slots_total']} | "
                    f"{r['moved'][0]:.1f} / {r['moved'][1]:.2f} | {r['moved'][2]:.1f} / {r['moved'][3]:.2f} | "
                    f"{r['time_med'] * 1e3:.2f} ms [{lo:.2f}, {hi:.2f}], {r['time_max'] * 1e3:.2f} ms |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    body = (f"## P7: LAER-MoE expert re-layout (benchmarks/moe_relayout.py)\n\n"
            f"Per (step, MoE layer) of the routing traces (P6's: recorded on the shipped corpus, and scaled), the "
            f"tokens per expert are planned by `plan_relayout`: with no more experts than ranks and two slots or "
            f"more, Walker's alias construction (exact: every rank at the mean, its own plain-EP expert plus at "
            f"most one piece of a hot one); otherwise the greedy (replicas in proportion to load, least-loaded "
            f"placement, water-filled shares, swap search), which fills every slot. Before = plain EP; "
            f"imbalance = max / mean expected tokens per rank. Planner time: median per problem, 95 % t-interval "
            f"over {args.repeats} repeats, 2 shared CPU cores. \"Added materializations\": (rank, expert) pairs "
            f"a step's layout holds that the previous step's layout of the same layer did not -- the planner "
            f"starts from scratch every step; neither runtime mode caches last step's copies, so this counts what a "
            f"runtime that did would have to fetch anew. \"Expert copies sent\" (mean over problems, in whole "
            f"experts' parameters, from the layouts): the default runtime keeps each expert whole on its plain-EP "
            f"owner, which sends a copy to every other rank that materializes it; with fully sharded experts "
            f"(`expert_sharding=\"full\"`, LAER-MoE's FSEP) every rank holds 1/k of each expert and sends it to every "
            f"other rank holding that expert, plain EP's own experts included.\n\n{table}\n")
    print(body)
    if not args.no_write:
        from _results import write_section

        write_section("moe_relayout", body)
    return body


if __name__ == "__main__":
    main()
