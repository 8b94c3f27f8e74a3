"""How unevenly the MoE accuracy benchmark's routers load the expert-parallel ranks, and how much of the expert-
parallel plans' error that would explain (issue 17).

The cost model prices an MoE block from the ShardedLayerProfiler's timing of that block on random hidden states,
where the untrained router spreads the routed copies nearly evenly; it assumes the same of training
(``MoELayerFacts``: "balanced routing makes the per-rank expert compute independent of expert parallelism").
Under expert parallelism the busiest rank of an EP group sets the pace: the others wait for it in the combine
all-to-all. This script routes the benchmark's own global batch (``costmodel_accuracy.py``'s data: seed 123,
random tokens; the model at its seed-0 initialization, which is what the plans train from: 7 steps at lr 1e-4
barely move the routers) through each MoE layer and reports, per EP degree, the busiest rank's routed copies over
the EP group's mean (experts placed as the runtime places them: rank r of an EP group owns E/ep consecutive
experts; EP groups as ``RankLayout.expert_grid`` forms them: consecutive data shards).

Then a what-if on a stored accuracy run (``benchmarks/data/costmodel_<model>.json`` and its profiles): each plan's
prediction plus, per MoE layer under ep, (skew - 1) x the layer's expert share of its forward + backward compute
(``cost.moe_compute_share``, a FLOP share, applied to the measured sharded fits). It is a diagnostic of what
balanced routing leaves out, not the cost model's prediction; the cost model does not read the skew.

    python benchmarks/moe_routing_skew.py [--model moe-wide] [--no-write]
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

from _results import write_section  # noqa: E402
from costmodel_accuracy import GLOBAL_BATCH, MODELS, Case, moe_plans, profile_for  # noqa: E402

from lightning_galv.plan import ParallelPlan  # noqa: E402
from lightning_galv.planner.cost import GalvatronCostModel, layer_compute, moe_compute_share  # noqa: E402
from lightning_galv.planner.profiles import HardwareProfile, ModelProfile  # noqa: E402

DATA_SEED = 123  # costmodel_ranks.measure_plans' generator


def routed_counts(model_name: str) -> list[list[list[int]]]:
    """Per MoE layer, per sample of the benchmark's global batch: routed copies per expert ``[layer][sample][E]``
    (one process, the whole model, no capacity: routing does not depend on the plan)."""
    import torch

    from costmodel_ranks import make_model
    from lightning_galv.models.moe import MoELayer

    torch.set_num_threads(1)
    cfg, seq = MODELS[model_name][:2]
    model = make_model(cfg)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    caught: list[torch.Tensor] = []
    for layer in layers:
        route = layer.route

        def spy(x: torch.Tensor, route=route):  # type: ignore[no-untyped-def]
            out = route(x)
            caught.append(out[3])  # [T, k] expert ids, T = batch x seq row-major
            return out

        layer.route = spy  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(DATA_SEED)
    data = torch.randint(0, cfg["vocab_size"], (GLOBAL_BATCH, seq + 1), generator=gen)
    with torch.no_grad():
        model(data[:, :-1])
    e = cfg["num_experts"]
    out = []
    for ids in caught:
        per_sample = ids.reshape(GLOBAL_BATCH, seq * ids.shape[-1])  # [B, seq x k]
        out.append([torch.bincount(row, minlength=e).tolist() for row in per_sample])
    return out


def skew(counts: list[list[int]], ep: int, shards: int) -> float:
    """Busiest EP rank's routed copies over its EP group's mean, the worst group: the global batch in ``shards``
    equal data shards, EP groups of ``ep`` consecutive shards, rank r of a group owning experts [r E/ep, (r+1) E/ep)."""
    e = len(counts[0])
    per_shard = len(counts) // shards
    worst = 0.0
    for g in range(shards // ep):
        samples = counts[g * ep * per_shard:(g + 1) * ep * per_shard]
        per_expert = [sum(c[x] for c in samples) for x in range(e)]
        loads = [sum(per_expert[r * e // ep:(r + 1) * e // ep]) for r in range(ep)]
        worst = max(worst, max(loads) / (sum(loads) / ep))
    return worst


def skewed_prediction(model: ModelProfile, hw: HardwareProfile, case: Case, skews: list[float]) -> float:
    """The cost model's step time plus each MoE layer's expert compute (its FLOP share of the sharded fits) times
    (skew - 1) under ep > 1; one micro-batch per layer and step as the benchmark's plans run."""
    plan: ParallelPlan = case.plan
    profile = profile_for(model, case)
    base = GalvatronCostModel(profile, hw, runtime="native").evaluate(plan).step_time_s
    extra = 0.0
    moe_layer = 0
    for i, s in enumerate(plan.layers):
        lt = profile.layer_types[profile.layer_type_of[i]]
        if lt.moe is None:
            continue
        k = skews[moe_layer]
        moe_layer += 1
        if s.ep == 1:
            continue
        b = plan.global_batch / plan.micro_batches / s.dp
        kinds = ("forward", "backward") + (("recompute",) if s.checkpoint else ())
        work = sum(layer_compute(lt, kind, s, b, case.seq) for kind in kinds)
        extra += plan.micro_batches * work * moe_compute_share(lt) * (k - 1.0)
    return base + extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=[m for m in MODELS if m != "llama"], default="moe-wide")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    cfg, seq = MODELS[args.model][:2]
    counts = routed_counts(args.model)
    cases = {n: Case(n, p, cfg, seq) for n, p in moe_plans()}
    lines = [f"Routed copies of the benchmark's global batch ({GLOBAL_BATCH} x {seq} tokens, top-{cfg['top_k']} of "
             f"{cfg['num_experts']}): busiest EP rank / its group's mean, per MoE layer (1.00 = balanced).", "",
             "| plan | ep | data shards | skew per layer | mean |", "|---|---|---|---|---|"]
    plan_skews: dict[str, list[float]] = {}
    for name, case in cases.items():
        s = case.plan.layers[0]
        if s.ep == 1:
            continue
        ks = [skew(c, s.ep, s.dp) for c in counts]
        plan_skews[name] = ks
        lines.append(f"| {name} | {s.ep} | {s.dp} | {' '.join(f'{k:.2f}' for k in ks)} | "
                     f"{statistics.fmean(ks):.2f} |")
    data_path = HERE / "data" / f"costmodel_{args.model}.json"
    prof_path = HERE / "data" / f"costmodel_{args.model}_profiles.json"
    if data_path.is_file() and prof_path.is_file():
        data, profiles = json.loads(data_path.read_text()), json.loads(prof_path.read_text())
        lines += ["", f"What-if on the stored run (`{data_path.relative_to(HERE.parent)}`, {len(data[0]['runs'])} "
                  "launches): error at profile speed, median over launches, of the cost model's prediction and of "
                  "that prediction plus the skew's extra expert compute (see the notes).", "",
                  "| plan | skew (mean) | error: cost model | error: + skew x expert FLOP share |", "|---|---|---|---|"]
        for r in data:
            case = cases[r["name"]]
            ks = plan_skews.get(r["name"], [1.0] * len(counts))
            now, what_if = [], []
            for run in r["runs"]:
                m, h = profiles[run["launch"]][str(r["world"])][:2]
                model, hw = ModelProfile.from_dict(m), HardwareProfile.from_dict(h)
                now.append(run["pred"] / run["mt"] - 1)
                what_if.append(skewed_prediction(model, hw, case, ks) / run["mt"] - 1)
            lines.append(f"| {r['name']} | {statistics.fmean(ks):.2f} | {statistics.median(now) * 100:+.1f}% | "
                         f"{statistics.median(what_if) * 100:+.1f}% |")
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        write_section(f"moe_routing_skew_{args.model.replace('-', '_')}",
                      f"## Routing skew of the MoE accuracy benchmark (benchmarks/moe_routing_skew.py --model "
                      f"{args.model})\n\n{NOTES}\n\n{report}")


NOTES = """Why: the cost model assumes balanced routing, and the benchmark's notes said random tokens give it. They do
not at this model's initialization: the routers see embedded tokens, not random hidden states, and some experts
draw more copies than others. Under expert parallelism the busiest rank's experts set the pace. The what-if adds
the extra expert compute alone (not the longer all-to-all into the busiest rank); the FLOP share is an upper
estimate of the experts' share of a block's time on CPU, where per-expert dispatch and small matmuls cost more
per FLOP than attention's."""


if __name__ == "__main__":
    main()
