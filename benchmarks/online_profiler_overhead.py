"""What OnlineProfiler costs: training time with vs without it, at its default sampling period.

    python benchmarks/online_profiler_overhead.py      # prints the table and updates benchmarks/RESULTS.md

One process, the reference LLaMA (dim 256, 4 layers, seq 128, batch 8, fp32, SGD) trained for ``steps``
Trainer steps with no callback and with ``OnlineProfiler()`` (every 50th step sampled: hooks, synchronization
and a torch.profiler session on that step only). The two runs alternate within each repeat (order flipped
every repeat) and the overhead is the paired ratio of the two runs' wall times, with a 95 % t-interval over
the repeats. A second row samples every step, the worst case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

sys.path.insert(0, str(HERE))
from _stats import interval  # noqa: E402


def run(steps: int, callback: object | None) -> float:
    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_galv.demo.module import CausalLM

    torch.manual_seed(0)
    module = CausalLM(kind="llama", vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768,
                      max_seq_len=128, optimizer="sgd", lr=0.01)
    data = torch.randint(0, 512, (steps * 8, 129))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback] if callback is not None else [])
    t0 = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=8))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> str:
    import torch

    from lightning_galv.callbacks import OnlineProfiler

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = ["| profiler | overhead: mean paired ratio - 1 [95 % CI] | runs (s): without / with, medians |",
            "|---|---|---|"]
    for label, make in (("OnlineProfiler() (every 50th step)", lambda: OnlineProfiler(log=False)),
                        ("every step (worst case)", lambda: OnlineProfiler(every_n_steps=1, warmup_steps=0, log=False))):
        ratios, plain, prof = [], [], []
        for rep in range(args.repeats):
            order = (False, True) if rep % 2 == 0 else (True, False)
            got = {}
            for with_cb in order:
                got[with_cb] = run(args.steps, make() if with_cb else None)
            plain.append(got[False])
            prof.append(got[True])
            ratios.append(got[True] / got[False])
        mean, lo, hi = interval(ratios)
        rows.append(f"| {label} | {mean - 1:+.1%} [{lo - 1:+.1%}, {hi - 1:+.1%}] | "
                    f"{statistics.median(plain):.2f} / {statistics.median(prof):.2f} |")
    body = ("## OnlineProfiler overhead (benchmarks/online_profiler_overhead.py)\n\n"
            f"One process, 1 thread, LLaMA dim 256 x 4 layers, seq 128, batch 8; {args.steps} Trainer steps per run, "
            f"{args.repeats} paired repeats (order alternating). Goal: <= 2 % at the default period.\n\n"
            + "\n".join(rows) + "\n")
    print(body)
    if not args.no_write:
        from _results import write_section

        write_section("online_profiler", body)
    return body


if __name__ == "__main__":
    main()
