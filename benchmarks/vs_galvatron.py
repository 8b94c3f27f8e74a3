"""Our planner vs Galvatron 2.4 on Galvatron's own A100 profiles (shipped in tests/data/galvatron).

For each configuration of the reference README: our search wall time and best plan, and the predicted
time per iteration of our plan and of Galvatron's chosen plan, both under *our* cost model, next to
Galvatron's own prediction for its plan. Also a batch-size sweep (Galvatron: 19 min, returned batch 8
because per-sample profiles made every batch tie) and a simulated 1024-GPU scale row.

    python benchmarks/vs_galvatron.py [--ref PATH] [--no-write]     (or GALV_REFERENCE=PATH)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_galv.compat.galvatron import read_hardware_profile, read_model_profile  # noqa: E402
from lightning_galv.plan import LayerStrategy, ModelShape, ParallelPlan  # noqa: E402
from lightning_galv.planner.cost import GalvatronCostModel  # noqa: E402
from lightning_galv.planner.profiles import HardwareProfile  # noqa: E402
from lightning_galv.planner import SearchSpace, search  # noqa: E402

GiB = 2**30
# model, nodes, memory GB, global batch, Galvatron's plan (pp, tp, micro-batches), its prediction s, its wall s, 3-D only
REFERENCE = [
    ("gpt-1.5b", 2, 40, 144, (1, 1, 3), 0.861, 129.0, False),
    ("gpt-2.7b", 1, 40, 64, (1, 1, 4), 1.81, 41.0, False),
    ("gpt-2.7b", 2, 40, 64, (1, 1, 2), 0.905, 55.0, False),
    ("gpt-1.5b", 2, 40, 448, (2, 2, 112), 3.08, 1.0, True),
    ("gpt-2.7b", 2, 40, 320, (2, 2, 80), 5.22, 1.0, True),
]


def galvatron_plan(world: int, layers: int, pp: int, tp: int, m: int, batch: int, three_d: bool) -> ParallelPlan:
    """Galvatron's chosen plan from the README table (ZeRO-2 DP; 3-D plans also shard the vocabulary by tp)."""
    stage = world // pp
    s = LayerStrategy(tp=tp, dp=stage // tp, zero=2)
    emb = s if three_d else LayerStrategy(dp=stage, zero=2)
    return ParallelPlan.uniform(world, layers, s, pp=pp, micro_batches=m, global_batch=batch, embed=emb, head=emb)


def _secs(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 0.1 else f"{t:.2f} s"


def run(ref: Path, repeats: int = 5) -> str:
    out = [f"Search wall time: median of {repeats} repeats in this run (min–max in brackets). Rows marked 3-D search "
           "Galvatron's 3-D space there (one pp × tp × dp for all layers, ZeRO-2, no sequence parallelism, no "
           "recomputation, consecutive tp, 1F1B, max tp 8, max pp 8, fixed batch); the row below each "
           "(full space) searches our whole space on the same input (per-layer tp/dp/sp/ZeRO/recomputation, "
           "three schedules, uneven stages) and is compared with the same ~1 s.",
           "",
           "| model | nodes×GPUs | batch | our search | Galvatron search | speed-up | our plan | ours: our plan | "
           "ours: Galvatron's plan | Galvatron: its plan | Δ same plan |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(r, False) for r in REFERENCE] + [(r, True) for r in REFERENCE if r[-1]]
    rows.sort(key=lambda rf: (REFERENCE.index(rf[0]), rf[1]))
    for (name, nodes, mem, batch, (pp, tp, m), g_pred, g_wall, three_d), full in rows:
        prof = read_model_profile(ref / "gpt" / "meta_configs" / f"{name}.json", ref / "gpt" / "configs")
        hw = read_hardware_profile(ref / "hardware", nodes, 8, device_memory_bytes=mem * GiB)
        world = nodes * 8
        kw = dict(max_tp=8, max_pp=8, vocab_padding=True)
        space = SearchSpace.three_d(schedules=("1f1b",), **kw) if three_d and not full else SearchSpace(**kw)
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ours = search(prof, hw, world, mem * GiB, global_batch=batch, top_k=3, space=space)
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        best = ours[0]
        gp = galvatron_plan(world, prof.num_layers, pp, tp, m, batch, three_d)
        g_ours = GalvatronCostModel(prof, hw).evaluate(gp).step_time_s
        kinds = sorted({s.short() for s in best.layers})
        desc = f"pp{best.pp} {'/'.join(kinds)} m={best.micro_batches}" + (
            f" div {list(best.pp_division)}" if best.pp > 1 else "") + (
            f", embed {best.embed.short()} head {best.head.short()}" if (best.embed, best.head) != (
                best.layers[0], best.layers[-1]) else "")
        label = name + (" (full space)" if full else " (3-D)" if three_d else "")
        out.append(f"| {label} | {nodes}×8 | {batch} | {_secs(wall)} [{_secs(min(walls))}–{_secs(max(walls))}] | "
                   f"{'~' if three_d else ''}{g_wall:.0f} s | {g_wall / wall:.0f}× | {desc} | "
                   f"{best.prediction.step_time_s:.3f} s | {g_ours:.3f} s | "
                   f"{g_pred:.3f} s | {100 * (g_ours - g_pred) / g_pred:+.1f} % |")
    # batch sweep: Galvatron took 19 min and returned batch 8 (every batch tied)
    prof = read_model_profile(ref / "gpt" / "meta_configs" / "gpt-2.7b.json", ref / "gpt" / "configs")
    hw = read_hardware_profile(ref / "hardware", 1, 8)
    t0 = time.perf_counter()
    sweep = search(prof, hw, 8, 40 * GiB, global_batch=range(8, 129, 8), top_k=20,
                   space=SearchSpace(max_tp=8, max_pp=8, vocab_padding=True))
    wall = time.perf_counter() - t0
    at8 = search(prof, hw, 8, 40 * GiB, global_batch=8, top_k=1,
                 space=SearchSpace(max_tp=8, max_pp=8, vocab_padding=True))[0].prediction.throughput
    out.append("")
    out.append(f"Batch sweep gpt-2.7b 1×8, batch 8..128: {wall:.2f} s (Galvatron: 19 min); chosen batch "
               f"{sweep[0].global_batch} at {sweep[0].prediction.throughput:.2f} samples/s"
               f" (best plan at batch 8: {at8:.2f} samples/s). Per-sample profiles make compute "
               "per sample identical; larger batches win only by amortizing per-step costs (overlap slowdown of "
               "gradient sync, optimizer step), which our model prices.")
    # scale
    shape = ModelShape(80, 8192, 64, 8, 28672, 32000, 4096)
    big = HardwareProfile.uniform(128, 8, 80 * GiB, intra_bw=200e9, inter_bw=25e9)
    t0 = time.perf_counter()
    res = search(shape, big, 1024, 80 * GiB, global_batch=1024, top_k=3)
    wall = time.perf_counter() - t0
    b = res[0]
    out.append(f"Scale: simulated 128×8 = 1024 GPUs, 80-layer 70B-class model (analytic profile), batch 1024: "
               f"{wall:.2f} s search (goal ≤ 60 s); best pp{b.pp} m={b.micro_batches} "
               f"{'/'.join(sorted({s.short() for s in b.layers}))}, {b.prediction.step_time_s:.2f} s/step.")
    return "\n".join(out)


def write_section(text: str, path: Path) -> None:
    from _results import write_section as write

    write("vs_galvatron", f"## Planner vs Galvatron (benchmarks/vs_galvatron.py)\n\n{text}", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=os.environ.get("GALV_REFERENCE", str(ROOT / "tests" / "data" / "galvatron")))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--repeats", type=int, default=5, help="searches per row; the table shows the median")
    args = ap.parse_args()
    text = run(Path(args.ref), args.repeats)
    print(text)
    if not args.no_write:
        write_section(text, ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
