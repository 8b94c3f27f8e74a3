"""GalvatronAccounting vs Galvatron 2.4.0's own cost model (the judge) on Galvatron's plans.

For every plan Galvatron ships for gpt-1.5b / 2.7b / 6.7b and llama-7b, plus variants of them (pipelines,
ZeRO-3, checkpointing, vocab tp, embed_sdp, ddp), both score the plan: time per iteration and memory per
stage in the best context that fits. Also checks that ``write_plan(read_plan(plan))`` scores identically.
Runs under the judge's venv (``shared/galvatron-judge/setup.sh``):

    $JUDGE_VENV/bin/python benchmarks/galvatron_accounting.py [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
JUDGE = Path(os.environ.get("GALV_JUDGE", ROOT.parent / "shared" / "galvatron-judge"))
sys.path.insert(0, str(JUDGE))

from lightning_galv.compat.galvatron import read_galvatron_hardware, read_model_profile, read_plan, write_plan  # noqa: E402
from lightning_galv.planner.galvatron_accounting import GalvatronAccounting  # noqa: E402

DATA = ROOT / "tests" / "data" / "galvatron"
MODELS = {  # name: (family dir, reader kwargs matching the judge's profile set, Megatron-SP on)
    "gpt-1.5b": ("gpt_hf", dict(layout="legacy"), False),
    "gpt-2.7b": ("gpt_hf", dict(layout="legacy"), False),
    "gpt-6.7b": ("gpt_hf", dict(layout="2.4", memory_mode="sequence"), True),
    "llama-7b": ("llama_hf", dict(layout="legacy"), True),
}


def cases() -> list[tuple[str, int, int, dict]]:
    """(model, nodes, memory GB, plan JSON): the shipped plans, then variants."""
    out = []
    for name, (fam, _, _) in MODELS.items():
        for p in sorted((DATA / "models" / fam / "configs").glob(f"galvatron_config_{name}_*nodes*.json")):
            nodes = int(p.name.split("_")[3][0])
            d = json.loads(p.read_text())
            d.setdefault("pipeline_type", "pipedream_flush")
            d["default_dp_type"] = "zero2"
            out.append((name, nodes, 40, d))
    out.append(("gpt-2.7b", 1, 40, json.loads((DATA / "plans" / "T06_galvatron_gpt2.7b_1x8_40G.json").read_text())))
    # variants on gpt-2.7b 1x8 (32 layers) and gpt-6.7b / llama-7b 1x8
    def plan(n, pp, tp, zero3, ckpt, bsz, chunks, vtp=1, esdp=0, dp_type="zero2"):
        div = [n // pp] * pp
        return {"pp_deg": pp, "tp_sizes_enc": ",".join([str(tp)] * n), "tp_consecutive_flags": ",".join(["1"] * n),
                "dp_types_enc": ",".join([str(zero3)] * n), "use_sp": ",".join(["0"] * n),
                "checkpoint": ",".join([str(ckpt)] * n), "global_bsz": bsz, "chunks": chunks,
                "pp_division": ",".join(map(str, div)), "pipeline_type": "pipedream_flush",
                "default_dp_type": dp_type, "vtp": vtp, "vsp": 0, "embed_sdp": esdp}
    for name in ("gpt-2.7b", "gpt-6.7b", "llama-7b"):
        n = 32
        out += [(name, 1, 40, plan(n, 2, 2, 0, 0, 64, 4)), (name, 1, 40, plan(n, 1, 2, 1, 1, 32, 2, vtp=2, esdp=1)),
                (name, 1, 40, plan(n, 4, 1, 0, 1, 64, 8)), (name, 1, 40, plan(n, 1, 1, 1, 0, 16, 1)),
                (name, 1, 40, plan(n, 2, 4, 0, 0, 32, 4, vtp=4)), (name, 1, 40, plan(n, 1, 8, 0, 0, 16, 2, vtp=8)),
                (name, 1, 40, plan(n, 1, 2, 0, 0, 32, 4, dp_type="ddp"))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import score_plan as SP

    rows, worst_t, worst_m, n_cmp, same_rt = [], 0.0, 0.0, 0, 0
    engines: dict = {}
    for name, nodes, mem, d in cases():
        fam, kw, sp = MODELS[name]
        key = (name, nodes, mem, d["global_bsz"], d["chunks"], d["pipeline_type"], d["default_dp_type"])
        if key not in engines:
            engines[key] = SP.load_engine(name, nodes, 8, mem, bsz=int(d["global_bsz"]), chunk=int(d["chunks"]),
                                          pipeline_type=d["pipeline_type"], default_dp_type=d["default_dp_type"])
        E = engines[key]
        try:
            judge = SP.score_plan(E, d)
        except AssertionError as exc:
            rows.append(f"| {name} {nodes}×8 | {SP.summarize(d)} | judge refuses: {exc} | | | |")
            continue
        js = judge["score"]
        world = nodes * 8
        try:
            plan = read_plan(d, world, sequence_parallel=sp)
        except ValueError as exc:
            rows.append(f"| {name} {nodes}×8 | {SP.summarize(d)} | ours refuses: {str(exc)[:80]} | | | |")
            continue
        model = read_model_profile(DATA / "models" / fam / "meta_configs" / f"{name}.json",
                                   DATA / "models" / fam / "configs", **kw)
        acc = GalvatronAccounting(model, read_galvatron_hardware(DATA / "hardware", nodes, 8), mem,
                                  sequence_parallel=sp, default_dp_type=d["default_dp_type"])
        ours = acc.score(plan).best
        back = SP.score_plan(E, {k: v for k, v in write_plan(plan).items() if k != "lightning_galv"})["score"]
        if js is not None and back is not None and back["time_per_iter_s"] == js["time_per_iter_s"] \
                and back["mem_used_MB_per_stage"] == js["mem_used_MB_per_stage"]:
            same_rt += 1
        if js is None or ours is None:
            rows.append(f"| {name} {nodes}×8 | {SP.summarize(d)} | judge {js and js['time_per_iter_s']} | "
                        f"ours {ours and ours.time_s} | | |")
            continue
        dt = abs(ours.time_s - js["time_per_iter_s"]) / js["time_per_iter_s"]
        dm = max(abs(a - b) / b for a, b in zip(ours.used_mb, js["mem_used_MB_per_stage"]))
        worst_t, worst_m, n_cmp = max(worst_t, dt), max(worst_m, dm), n_cmp + 1
        rows.append(f"| {name} {nodes}×8 | {SP.summarize(d)} | {js['time_per_iter_s']:.4f} s / "
                    f"{js['mem_used_MB_per_stage']} | {ours.time_s:.4f} s / {[int(u) for u in ours.used_mb]} | "
                    f"{100 * dt:.3f} % | {100 * dm:.3f} % |")
    text = "\n".join([
        f"GalvatronAccounting vs Galvatron 2.4.0's cost model (judge), {n_cmp} plans compared: worst time error "
        f"{100 * worst_t:.3f} %, worst per-stage memory error {100 * worst_m:.3f} % (best context that fits, "
        f"memory as Galvatron's DP adds it up, reserve excluded). write_plan(read_plan(plan)) scored identically "
        f"by the judge: {same_rt} of {len(rows)}.", "",
        "| model | plan | judge: time / MB per stage | ours | Δ time | Δ memory |", "|---|---|---|---|---|---|", *rows])
    print(text)
    if not args.no_write:
        (ROOT / "benchmarks" / "RESULTS_galvatron_accounting.md").write_text(
            "## GalvatronAccounting vs Galvatron's judge (benchmarks/galvatron_accounting.py)\n\n" + text + "\n")


if __name__ == "__main__":
    main()
