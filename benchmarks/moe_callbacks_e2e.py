"""End-to-end step time with and without the per-step MoE callbacks (issue 12, P6/P7 end-to-end rows).

    python benchmarks/moe_callbacks_e2e.py                  # 4 and 8 ranks; prints and updates benchmarks/RESULTS.md
    python benchmarks/moe_callbacks_e2e.py --corpus mixed   # the same on the mixed-domain corpus (own section)

One gloo launch per world size (rank side: ``benchmarks/_moe_callbacks_runs.py``). The MoE decoder (dim 128,
4 MoE blocks of 8 SwiGLU experts, top-2, dropless) is first trained in one process on the shipped corpus so that
its router has a trained router's skew and per-sample locality; then every rank trains it under
``LayerStrategy(dp=world, ep=4)`` with: plain EP, ExpertRelayout (LAER-MoE; experts whole on their owners, and
``relayout-fsep`` with fully sharded experts), SamplePlacement (NetMoE, 2 ranks per simulated node) and both. Reported per variant: step time (median over repeats of each repeat's median step,
95 % t-interval over repeats), the paired ratio to plain EP, and what the callbacks measured on the same steps:
max/mean assignments per rank (before = plain EP's placement of the same routing, after = the layout used)
and inter-node all-to-all bytes of the whole EP group's dispatch + combine in the forward (before = plain EP
for the same routing, after = as sent, carry rows included; the percentage is after / before - 1).

Caveat, stated with the numbers: 4 or 8 ranks share 2 CPU cores, so a step's time is mostly compute and
scheduling, and moving bytes over loopback costs almost nothing; what a callback saves on a real network is
in the byte and load columns (and P6/P7's predicted times), what it costs here is in the time column.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _stats import interval  # noqa: E402
from lightning_galv.plan import LayerStrategy as L  # noqa: E402
from lightning_galv.plan import ParallelPlan  # noqa: E402
from lightning_galv.testing import run_distributed  # noqa: E402

RUNS = str(HERE / "_moe_callbacks_runs.py") + "::run_all"
VARIANTS = ["plain", "relayout", "relayout-fsep", "placement", "relayout+placement"]


def _table(world: int, res: dict) -> list[str]:
    rows = []
    base = [statistics.median(r) for r in res["times"]["plain"]]
    for name in VARIANTS:
        rep = [statistics.median(r) for r in res["times"][name]]
        _, lo, hi = interval(rep)
        rm, rlo, rhi = interval([a / b for a, b in zip(rep, base)])
        load = inter = moved = "-"
        recs = res["relayout"][name]
        if recs:
            before = statistics.fmean(r["max_mean_before"] for r in recs)
            after = statistics.fmean(r["max_mean_after"] for r in recs)
            ms = statistics.median(r["planner_ms"] for r in recs)
            load = f"{before:.2f} -> {after:.2f} (planner {ms:.2f} ms)"
            moved = (f"{statistics.fmean(r['moved_bytes'] for r in recs) / 1e6:.2f} / "
                     f"{statistics.fmean(r['max_rank_bytes'] for r in recs) / 1e6:.2f} MB")
        steps = res["placement"][name]
        if steps:
            b = sum(s["inter_before"] for s in steps)
            a = sum(s["inter_after"] for s in steps)
            ms = statistics.median(s["solve_ms"] for s in steps)
            inter = f"{b / len(steps) / 1e6:.2f} -> {a / len(steps) / 1e6:.2f} MB ({100 * (a / b - 1):+.0f} %; solver {ms:.2f} ms)"
        rows.append(f"| {world} | {name} | {statistics.median(rep):.3f} [{lo:.3f}, {hi:.3f}] | "
                    f"{rm:.2f} [{rlo:.2f}, {rhi:.2f}] | {load} | {moved} | {inter} |")
    return rows


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pretrain", type=int, default=150)
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--corpus", choices=("shipped", "mixed"), default="shipped",
                    help="pre-train and train on the shipped single-domain corpus or on the mixed-domain corpus of "
                         "mixed_corpus.py (per-sample routing locality, which is what sample placement feeds on)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    corpus = None
    if args.corpus == "mixed":
        import mixed_corpus

        corpus = str(mixed_corpus.MIXED_CORPUS)
    corpus_name = ("the MIXED-DOMAIN corpus (benchmarks/traces/mixed_corpus.jsonl: prose, tables/arithmetic, Python, "
                   "Russian)" if corpus else "the shipped corpus")
    layers, seq, per_rank = 4, 64, 4
    cfg = dict(vocab_size=256, dim=128, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_hidden=256, max_seq_len=seq,
               num_experts=8, top_k=2, expert_hidden=256, moe_every=1)
    rows = ["| ranks | variant | step time (s), median [95 % CI] | ratio to plain [95 % CI] | max/mean load per "
            "rank, plain EP -> used | expert parameters sent per layer-step: EP group / largest sender | "
            "inter-node a2a bytes per rank-step, plain -> sent |", "|---|---|---|---|---|---|---|"]
    for world in args.worlds:
        plan = ParallelPlan(world, (L(dp=world, ep=4),) * layers).to_dict()
        res = run_distributed(RUNS, world, (plan, cfg, VARIANTS, 2, per_rank, seq, args.steps, 2, args.repeats,
                                            args.pretrain, corpus), timeout=3600)[0]
        rows += _table(world, res)
    title = "MoE callbacks end to end" + (", mixed-domain corpus" if corpus else "")
    cmd = "benchmarks/moe_callbacks_e2e.py" + (" --corpus mixed" if corpus else "")
    body = (f"## {title} ({cmd})\n\n"
            f"gloo ranks on this 2-core CPU machine; MoE decoder dim 128, {layers} MoE blocks of 8 experts (SwiGLU "
            f"256), top-2, dropless, pre-trained {args.pretrain} steps on {corpus_name}; plan dp=ranks, ep=4; "
            f"{per_rank} corpus windows x {seq} tokens per rank; 2 ranks per simulated node; {args.repeats} repeats x "
            f"{args.steps} steps (2 warm-up), variants rotated per repeat. Bytes are rank 0's.\n\n"
            + "\n".join(rows) + "\n")
    print(body)
    if not args.no_write:
        from _results import write_section

        write_section("moe_callbacks_e2e" + ("_mixed" if corpus else ""), body)
    return body


if __name__ == "__main__":
    main()
