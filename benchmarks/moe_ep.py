"""MoE step time, all-to-all volume and parameter memory: dp-only vs expert parallelism at equal world size.

    python benchmarks/moe_ep.py            # prints the table and updates benchmarks/RESULTS.md

One 4-rank gloo launch (rank-side code: ``benchmarks/_moe_ep_runs.py``) trains the same MoE decoder
(every block MoE, 8 experts, top-2, dropless) under ``dp=4`` (every rank holds all experts), ``dp=4, ep=2``
and ``dp=4, ep=4``. Reported per plan: the step time (median over repeats of each repeat's median step,
with a 95 % t-interval over the repeats), the paired ratio to dp-only (per repeat, same interval), the
all-to-all bytes a rank sends to *other* ranks per step (measured from the routing statistics: dispatch
rows x hidden x 4 bytes, times 4 for dispatch + combine in forward and backward), and the parameters a rank
holds. CPU gloo on 2 shared cores: the absolute times say little about a GPU cluster; the a2a volume and
the memory are exact.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lightning_galv.plan import LayerStrategy as L  # noqa: E402
from lightning_galv.plan import ParallelPlan  # noqa: E402
from lightning_galv.testing import run_distributed  # noqa: E402

RUNS = str(HERE / "_moe_ep_runs.py") + "::run_all"
sys.path.insert(0, str(HERE))
from _stats import interval  # noqa: E402


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    layers = 4
    cfg = dict(vocab_size=256, dim=128, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_hidden=256, max_seq_len=64,
               num_experts=8, top_k=2, expert_hidden=256, moe_every=1)
    plans = {f"dp4{'' if ep == 1 else f' ep{ep}'}": ParallelPlan(4, (L(dp=4, ep=ep),) * layers).to_dict()
             for ep in (1, 2, 4)}
    res = run_distributed(RUNS, 4, (plans, cfg, 4, 64, args.steps, 2, args.repeats), timeout=1800)[0]
    base = "dp4"
    rows = ["| plan | step time (s), median [95 % CI of mean] | ratio to dp4 [95 % CI] | a2a bytes sent off-rank "
            "per step per rank | parameters per rank |", "|---|---|---|---|---|"]
    base_rep = [statistics.median(r) for r in res[base]["times"]]
    for name, r in res.items():
        rep = [statistics.median(x) for x in r["times"]]
        mean, lo, hi = interval(rep)
        ratio = [a / b for a, b in zip(rep, base_rep)]
        rm, rlo, rhi = interval(ratio)
        a2a = 4 * r["a2a_bytes_fwd_dispatch_per_rank"]
        rows.append(f"| {name} | {statistics.median(rep):.3f} [{lo:.3f}, {hi:.3f}] | {rm:.2f} [{rlo:.2f}, {rhi:.2f}] "
                    f"| {a2a / 1e6:.2f} MB | {r['params_local'] / 1e6:.2f} M |")
    table = "\n".join(rows)
    body = (f"## MoE: dp-only vs expert parallelism (benchmarks/moe_ep.py)\n\n"
            f"4 gloo ranks on this 2-core CPU machine; MoE decoder dim 128, {layers} MoE blocks of 8 experts "
            f"(SwiGLU 256), top-2, dropless; 4 samples x 64 tokens per rank; {args.repeats} repeats x "
            f"{args.steps} steps (2 warm-up) per plan, plans rotated per repeat.\n\n{table}\n")
    print(body)
    if not args.no_write:
        from _results import write_section

        write_section("moe_ep", body)
    return body


if __name__ == "__main__":
    main()
