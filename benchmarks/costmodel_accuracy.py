"""Cost-model accuracy on real runs on this machine (CPU, gloo, 2 and 4 ranks, 1 thread each).

1. Profile: HardwareProfiler on 2 and 4 gloo ranks; ModelProfiler on the reference LLaMA block (fp32,
   one thread, like every rank).
2. For a set of plans (dp / ZeRO-1/2/3 / tp / tp+megatron-sp / ulysses / checkpointing /
   heterogeneous per-layer): predict step time and peak memory with GalvatronCostModel, then train
   the plan for a few steps (benchmarks/costmodel_ranks.py) and measure the median step time after
   warm-up and the per-rank peak of live tensor bytes (torch MemTracker; see that module).
3. Print the table with relative errors and write it into benchmarks/RESULTS.md.

    python benchmarks/costmodel_accuracy.py [--quick] [--no-write] [--model moe|moe-wide]

``--model moe`` (issue 11: prediction vs measurement for expert parallelism) runs the same procedure on the MoE
decoder (every block MoE, 8 SwiGLU experts, top-2, dropless) with dp-only, ep=2 and ep=4 plans, profiled as
automatic mode profiles it (one layer type per block kind, the MoE layer's facts read from the module) and
written to its own RESULTS.md section; ``--model moe-wide`` does the same for an MoE decoder of the dense model's
size (its FFNs as 8 experts of half the width, top-2), whose passes are long enough to time on this VM.

The cost model is never fitted to the measured step times of the plans below: every number it uses
comes from the two profiles.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lightning_galv.auto import SHARDED_PROFILE_MAX_ROUNDS  # noqa: E402
from lightning_galv.plan import LayerStrategy as S, ModelShape, ParallelPlan  # noqa: E402
from lightning_galv.planner.cost import GalvatronCostModel  # noqa: E402
from lightning_galv.planner.search import DEFAULT_MEMORY_MARGIN  # noqa: E402
from lightning_galv.planner.profiles import HardwareProfile, ModelProfile  # noqa: E402

RANKS = str(HERE / "costmodel_ranks.py")
CFG = dict(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768, max_seq_len=128)
SEQ = 128
GLOBAL_BATCH = 8
MiB = 2**20
MOE_CFG = dict(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=256, max_seq_len=64,
               num_experts=8, top_k=2, expert_hidden=256, moe_every=1)
MOE_SEQ = 64
# The dense model above with each FFN replaced by 8 experts of which 2 are active per token, each of half the dense
# FFN's width, so a token's active FFN width equals the dense one (768). Why a second MoE model: the small one's
# speed reference is a 6-7 ms pass and its steps take ~60 ms, and on this VM a pass that short jitters by ~10 %
# (in the 20-launch run at 045cbe2 both a profile's own ratio prediction / reference and a measurement's step /
# probe spread with sd 7-11 % over launches, against 1-2 % for the dense model's 55 ms pass and 0.5 s steps).
MOE_WIDE_CFG = dict(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768, max_seq_len=128,
                    num_experts=8, top_k=2, expert_hidden=384, moe_every=1)
MOE_WIDE_SEQ = SEQ
# --model -> (config, sequence length, RESULTS.md section, memory-budget grid in MiB (start, stop, step)); each grid
# is fixed from the model's size (~0.4x to ~2.3x its full fp32 training state), never from the predictions
MODELS = {"llama": (CFG, SEQ, "costmodel", (24, 128, 4)),
          "moe": (MOE_CFG, MOE_SEQ, "costmodel_moe", (24, 128, 4)),
          "moe-wide": (MOE_WIDE_CFG, MOE_WIDE_SEQ, "costmodel_moe_wide", (64, 384, 8))}


def moe_plans() -> list[tuple[str, ParallelPlan]]:
    """dp-only vs expert parallelism at equal world size (the plans of benchmarks/moe_ep.py), plus ZeRO and
    tensor-parallel attention variants so the calibration has more than one plan per world to learn from."""
    n = MOE_CFG["n_layers"]

    def uni(world: int, s: S) -> ParallelPlan:
        return ParallelPlan.uniform(world, n, s, global_batch=GLOBAL_BATCH).with_(embed=S(dp=world), head=S(dp=world))

    return [("2r moe dp2", uni(2, S(dp=2))), ("2r moe ep2", uni(2, S(dp=2, ep=2))),
            ("2r moe ep2·zero1", uni(2, S(dp=2, ep=2, zero=1))), ("2r moe tp2 attn", uni(2, S(tp=2))),
            ("4r moe dp4", uni(4, S(dp=4))), ("4r moe ep2", uni(4, S(dp=4, ep=2))),
            ("4r moe ep4", uni(4, S(dp=4, ep=4))), ("4r moe ep4·zero3", uni(4, S(dp=4, ep=4, zero=3))),
            ("4r moe ep2·tp2 attn", uni(4, S(tp=2, dp=2, ep=2))),
            # checkpointed expert-parallel blocks: priced from their own checkpointed run (the profiler times ep
            # variants checkpointed too), not as one more forward
            ("2r moe ep2·ckpt", uni(2, S(dp=2, ep=2, checkpoint=True))),
            ("4r moe ep4·ckpt", uni(4, S(dp=4, ep=4, checkpoint=True)))]


def shape() -> ModelShape:
    return ModelShape(CFG["n_layers"], CFG["dim"], CFG["n_heads"], CFG["n_kv_heads"], CFG["ffn_hidden"],
                      CFG["vocab_size"], SEQ)


def plans() -> list[tuple[str, ParallelPlan]]:
    L = CFG["n_layers"]

    def uni(world: int, s: S, **kw) -> ParallelPlan:
        return ParallelPlan.uniform(world, L, s, global_batch=GLOBAL_BATCH, **kw).with_(
            embed=S(dp=world), head=S(dp=world))

    def het(world: int, layers: list[S], **kw) -> ParallelPlan:
        return ParallelPlan(world, tuple(layers), embed=S(dp=world), head=S(dp=world),
                            global_batch=GLOBAL_BATCH, **kw)

    # every way of sharding the block appears in at least two plans of each world, so the leave-one-out
    # calibration below never predicts a sharding it has no measurement of
    out = [
        ("2r dp2", uni(2, S(dp=2))),
        ("2r dp2·zero1", uni(2, S(dp=2, zero=1))),
        ("2r dp2·zero2", uni(2, S(dp=2, zero=2))),
        ("2r dp2·zero3", uni(2, S(dp=2, zero=3))),
        ("2r dp2·ckpt", uni(2, S(dp=2, checkpoint=True))),
        ("2r tp2", uni(2, S(tp=2))),
        ("2r tp+sp2", uni(2, S(tp=2, sp="megatron"))),
        ("2r ulysses2", uni(2, S(tp=2, sp="ulysses"))),
        ("2r dp2 m=2", uni(2, S(dp=2), micro_batches=2)),
        # FSDP2 keeps the accumulated gradients unsharded until the last micro-batch (the memory rule this checks)
        ("2r dp2·zero3 m=2", uni(2, S(dp=2, zero=3), micro_batches=2)),
        ("2r tp+sp2·ckpt", uni(2, S(tp=2, sp="megatron", checkpoint=True))),
        ("2r hetero", het(2, [S(dp=2), S(tp=2), S(dp=2, zero=3), S(tp=2, sp="ulysses", checkpoint=True)])),
        ("4r dp4", uni(4, S(dp=4))),
        ("4r dp4·zero3", uni(4, S(dp=4, zero=3))),
        ("4r tp2·dp2", uni(4, S(tp=2, dp=2))),
        ("4r tp+sp2·dp2·zero2", uni(4, S(tp=2, dp=2, sp="megatron", zero=2))),
        ("4r ulysses2·dp2·ckpt", uni(4, S(tp=2, dp=2, sp="ulysses", checkpoint=True))),
        ("4r tp4", uni(4, S(tp=4))),
        ("4r ulysses2·dp2", uni(4, S(tp=2, dp=2, sp="ulysses"))),
        ("4r tp+sp2·dp2", uni(4, S(tp=2, dp=2, sp="megatron"))),
        ("4r tp+sp4", uni(4, S(tp=4, sp="megatron"))),
        ("4r tp4·ckpt", uni(4, S(tp=4, checkpoint=True))),
        ("4r hetero", het(4, [S(tp=2, dp=2), S(dp=4, zero=2), S(dp=4, checkpoint=True), S(tp=4, sp="megatron")])),
    ]
    for world in (2, 4):  # the design rule above, checked
        seen: dict[tuple[int, str], int] = {}
        for _, p in out:
            if p.world_size == world:
                for k in {(s.tp, s.sp) for s in p.layers}:
                    seen[k] = seen.get(k, 0) + 1
        once = sorted(k for k, n in seen.items() if n < 2)
        if once:
            raise ValueError(f"{world}-rank plans shard the block as {once} in only one plan. HINT: add a second "
                             "plan with that sharding (leave-one-out could not calibrate it).")
    return out


# ---------------------------------------------------------------------------------------------------
# profiles
# ---------------------------------------------------------------------------------------------------
def profile_world(world: int, cfg: dict = CFG, seq: int = SEQ, fn: str = "profile_machine", rounds: int = 5,
                  budget_s: float | None = None) -> tuple[ModelProfile, HardwareProfile]:
    """Hardware + model profile measured with ``world`` ranks busy at once (they share the cores); ``rounds``: the
    dense model's ShardedLayerProfiler rounds, ``budget_s``: more of them while they fit in that many seconds
    (``auto.SHARDED_PROFILE_MAX_ROUNDS`` at most; the MoE decoder's follow automatic mode's). The rounds taken
    are recorded in the profile's ``source`` (``rounds=``)."""
    from lightning_galv.testing import run_distributed

    extra = (rounds, budget_s) if fn == "profile_machine" else ()
    r = run_distributed(f"{RANKS}::{fn}", world, ((1 << 16, 1 << 20, 1 << 22, 1 << 24), 5, cfg, seq, *extra))[0]
    model = ModelProfile.from_json(r["model"])
    hw = replace(HardwareProfile.from_json(r["hardware"]), memory_bandwidth=r["optimizer_bandwidth"],
                 name=f"cpu-gloo-{world}")
    taken = ",".join(str(n) for n in r.get("rounds", []))
    return model.with_(source=f"ModelProfiler around_s={r['probe_s']} interleaved_s={r['interleaved_s']} "
                              f"rounds={taken or 'n/a'}"), hw


def rounds_line(launch_profiles: list[dict[int, tuple[ModelProfile, HardwareProfile]]]) -> str:
    """The ShardedLayerProfiler rounds each world's profiles took (the source's ``rounds=``): median [min, max]."""
    parts = []
    for world in (2, 4):
        taken = []
        for lp in launch_profiles:
            if world not in lp:
                continue
            for part in lp[world][0].source.split():
                if part.startswith("rounds=") and part != "rounds=n/a":
                    taken += [int(v) for v in part.split("=", 1)[1].split(",")]
        if taken:
            parts.append(f"{world} ranks {statistics.median(taken):g} [{min(taken)}, {max(taken)}] over "
                         f"{len(taken)} profiles")
    return "Sharded-profile rounds taken (median [min, max]): " + ("; ".join(parts) or "n/a (not recorded)") + "."


def _source_value(model: ModelProfile, key: str) -> float:
    for part in model.source.split():
        if part.startswith(key + "="):
            return float(part.split("=", 1)[1])
    raise ValueError(f"profile source {model.source!r}: no {key}= speed reference (a cache from before the "
                     "probes around the profile became the reference). HINT: pass --reprofile or delete the "
                     "--profiles cache.")


def probe_of(model: ModelProfile) -> float:
    """The profile's speed reference: the profiler's own raw timing of the pass the probe repeats, taken *during*
    the ShardedLayerProfiler's rounds (``interleaved_s``, ``costmodel_ranks._raw_reference``) -- the rounds that
    time the block variants every prediction is mostly made of, so it reads the machine's speed while the
    dominant input was measured. The probes around the profile run (``around_s``, the reference from 6565948 to
    2026-12-06) bracket a run of a minute or more and miss a spell inside it: in the 10-launch run at 5e9ee88 one
    4-rank profile's interleaved timing read 1.24x its probes around, and that launch's plans were predicted
    +16 % high against the other launches' (an in-sample offset of +23.5 %). With the interleaved timing as the
    reference the stored launch offsets' sd fell from 8.5 % to 2.4 % at 4 ranks and from 4.2 % to 3.5 % at 2
    (MoE run at d4a67cb: 7.8 % -> 4.5 % and 7.5 % -> 4.4 %). The reason it was dropped at 6565948 -- it read ~8 %
    slower than the probe at equal speed -- went with a1d10ad, when the probe took over the profiler's way of
    reducing passes (around / interleaved: 1.003 [0.959, 1.047] at 2 ranks, 0.987 [0.935, 1.039] at 4 in that
    run). The tables report errors against the probes around too (:func:`around_of`)."""
    return _source_value(model, "interleaved_s")


def around_of(model: ModelProfile) -> float:
    """The previous speed reference: the median of the probes right before and right after the profile run."""
    return _source_value(model, "around_s")


def offset_line(launch_profiles: list[dict[int, tuple[ModelProfile, HardwareProfile]]]) -> str:
    """The two speed references side by side per world size (what benchmarks/probe_offset.py measures), from the
    profiles this run's predictions came from."""
    from _stats import interval

    parts = []
    for world in (2, 4):
        xs = [around_of(lp[world][0]) / probe_of(lp[world][0])
              for lp in launch_profiles if world in lp]
        if len(xs) > 1:
            m, lo, hi = interval(xs)
            parts.append(f"{world} ranks {m:.3f} [{lo:.3f}, {hi:.3f}] over {len(xs)} profiles")
        elif xs:
            parts.append(f"{world} ranks {xs[0]:.3f} (one profile)")
    return ("Speed reference: the probes around each profile / the profiler's interleaved timing of the same pass "
            "(the reference since 2026-12-06, and from 257c0e1 to 6565948): " + ("; ".join(parts) or "n/a") + ".")


# ---------------------------------------------------------------------------------------------------
# held-out shapes (issue 17): profiled at batch 8 / 4 layers, measured and predicted at other shapes
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One measured configuration: a plan on a model config; ``heldout`` says which shape differs from the profile."""

    name: str
    plan: ParallelPlan
    cfg: dict
    seq: int
    heldout: str = ""


def heldout_cases() -> list[Case]:
    """Shapes the profiles never saw: global batch 16 (the block fits were measured at 1-4 samples unsharded,
    2-8 sharded, so 8-16 samples per rank are extrapolated), depth 2 / 6 (the profile has one block type;
    the plan has more or fewer of them), sequence length 64 / 256 (the profile carried there by
    ``ModelProfile.with_seq_len``), at the tokens per step of the profiled shape (batch 16 / 4), so that the
    sequence length is what differs, and width 192 / 384 (heads of the same size, FFN 3x as profiled; the
    profile carried there by ``ModelProfile.with_width``)."""
    def uni(world: int, s: S, layers: int = CFG["n_layers"], batch: int = GLOBAL_BATCH, **kw) -> ParallelPlan:
        return ParallelPlan.uniform(world, layers, s, global_batch=batch, **kw).with_(
            embed=S(dp=world), head=S(dp=world))

    deep, shallow, long = dict(CFG, n_layers=6), dict(CFG, n_layers=2), dict(CFG, max_seq_len=2 * SEQ)
    short, longer = SEQ // 2, 2 * SEQ
    # head size 32 as profiled; kv groups of 2 heads as profiled (tp2 splits both evenly at 384)
    narrow = dict(CFG, dim=192, n_heads=6, n_kv_heads=3, ffn_hidden=576)
    wide = dict(CFG, dim=384, n_heads=12, n_kv_heads=6, ffn_hidden=1152)
    return [
        Case("2r dp2 ·B16", uni(2, S(dp=2), batch=16), CFG, SEQ, "batch 16"),
        Case("2r tp+sp2 ·B16", uni(2, S(tp=2, sp="megatron"), batch=16), CFG, SEQ, "batch 16"),
        Case("2r dp2·zero3 ·L6", uni(2, S(dp=2, zero=3), layers=6), deep, SEQ, "6 layers"),
        Case("2r ulysses2 ·L6", uni(2, S(tp=2, sp="ulysses"), layers=6), deep, SEQ, "6 layers"),
        Case("4r tp2·dp2 ·B16", uni(4, S(tp=2, dp=2), batch=16), CFG, SEQ, "batch 16"),
        Case("4r dp4·zero3 ·B16", uni(4, S(dp=4, zero=3), batch=16), CFG, SEQ, "batch 16"),
        Case("4r dp4·ckpt ·L6", uni(4, S(dp=4, checkpoint=True), layers=6), deep, SEQ, "6 layers"),
        Case("4r tp4 ·L2", uni(4, S(tp=4), layers=2), shallow, SEQ, "2 layers"),
        Case("2r dp2 ·S64", uni(2, S(dp=2), batch=16), CFG, short, "seq 64"),
        Case("2r tp+sp2 ·S256", uni(2, S(tp=2, sp="megatron"), batch=4), long, longer, "seq 256"),
        Case("2r dp2·ckpt ·S256", uni(2, S(dp=2, checkpoint=True), batch=4), long, longer, "seq 256"),
        Case("4r dp4·zero3 ·S64", uni(4, S(dp=4, zero=3), batch=16), CFG, short, "seq 64"),
        Case("4r tp2·dp2 ·S256", uni(4, S(tp=2, dp=2), batch=4), long, longer, "seq 256"),
        Case("2r dp2 ·H384", uni(2, S(dp=2)), wide, SEQ, "width 384"),
        Case("2r tp+sp2 ·H384", uni(2, S(tp=2, sp="megatron")), wide, SEQ, "width 384"),
        Case("2r dp2·ckpt ·H192", uni(2, S(dp=2, checkpoint=True)), narrow, SEQ, "width 192"),
        Case("4r tp2·dp2 ·H384", uni(4, S(tp=2, dp=2)), wide, SEQ, "width 384"),
        Case("4r dp4·zero3 ·H192", uni(4, S(dp=4, zero=3)), narrow, SEQ, "width 192"),
    ]


@functools.lru_cache(maxsize=None)
def _model_facts(cfg_json: str, seq: int) -> tuple[ModelShape, int, int, int]:
    """(shape, block parameters, embedding parameters, head parameters) of the benchmark's model at ``cfg``: what
    ``ModelProfile.with_width`` takes of the model a held-out width case runs."""
    from costmodel_ranks import make_model

    m = make_model(json.loads(cfg_json))
    count = lambda *mods: sum(p.numel() for mod in mods for p in mod.parameters())  # noqa: E731
    return m.galv_shape(seq), count(m.layers[0]), count(m.tok_embeddings), count(m.norm, m.output)


def profile_for(model: ModelProfile, case: Case) -> ModelProfile:
    """The profile re-sized to the case's depth (one layer type, repeated), carried to its width and then to its
    sequence length."""
    n = case.cfg["n_layers"]
    if n != model.num_layers:
        model = model.with_(shape=replace(model.shape, num_layers=n), layer_type_of=(0,) * n)
    if case.cfg["dim"] != model.shape.hidden:
        shape, block, embed, head = _model_facts(json.dumps(case.cfg, sort_keys=True), model.seq_len)
        model = model.with_width(shape, block, embed, head)
    return model.with_seq_len(case.seq)


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------
def rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps and one launch (smoke test)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--profiles", default=str(HERE / ".costmodel_profiles.json"),
                    help="cache of the profiles (delete to re-profile)")
    ap.add_argument("--reprofile", action="store_true")
    ap.add_argument("--fresh-profiles", action="store_true",
                    help="profile again in every launch (issue 17: the predictions depend on the profile run, so "
                         "each launch pairs a fresh profile with fresh measurements); ignores the cache")
    ap.add_argument("--launches", type=int, default=5,
                    help="independent launches per world size (fresh processes; plan order rotated each launch)")
    ap.add_argument("--only", nargs="*", help="measure only these plan names (diagnosis; implies --no-write)")
    ap.add_argument("--model", choices=tuple(MODELS), default="llama",
                    help="llama: the dense reference model; moe: the small MoE decoder (dim 128); moe-wide: the dense "
                         "model with 8 experts of half its FFN width, top-2, in every block")
    ap.add_argument("--routing-skew", choices=("balanced", "measured"), default="balanced",
                    help="MoE models: price balanced routing (the profile as taken), or give the cost model the "
                         "routing skew measured on the plans' own batch (profiling.measure_routing_skew, "
                         "ModelProfile.with_routing_skew); written to its own section and data files")
    ap.add_argument("--sharded-rounds", type=int, default=5,
                    help="ShardedLayerProfiler rounds of the dense model's profiles (more: less noise per variant, "
                         "a longer profile); the least it takes with --sharded-budget")
    ap.add_argument("--sharded-budget", type=float, default=None,
                    help="seconds of timing the dense model's ShardedLayerProfiler may spend on more rounds (up to "
                         "auto.SHARDED_PROFILE_MAX_ROUNDS); default: automatic mode's SHARDED_PROFILE_BUDGET_S; "
                         "0: exactly --sharded-rounds (the protocol before 2026-12-04)")
    args = ap.parse_args()
    if args.sharded_budget is None:
        from lightning_galv.auto import SHARDED_PROFILE_BUDGET_S

        args.sharded_budget = SHARDED_PROFILE_BUDGET_S
    budget = args.sharded_budget or None
    moe = args.model != "llama"
    cfg, seq, _, grid = MODELS[args.model]
    cases = [Case(n, p, cfg, seq) for n, p in (moe_plans() if moe else plans())]
    if not moe:
        cases += heldout_cases()
    if args.only:
        cases = [c for c in cases if c.name in args.only]
    if moe and args.profiles == str(HERE / ".costmodel_profiles.json"):
        args.profiles = str(HERE / f".costmodel_profiles_{args.model.replace('-', '_')}.json")
    launches = 1 if args.quick else args.launches
    skews: dict[int, dict[int, float]] = {}
    if args.routing_skew == "measured":
        if not moe:
            raise ValueError("--routing-skew measured: the dense model has no experts. HINT: add --model moe or "
                             "--model moe-wide.")
        from moe_routing_skew import world_skew

        skews = {w: world_skew(args.model, w) for w in (2, 4)}
        print("routing skew measured on the plans' batch:", skews, flush=True)
    tag = args.model + ("_skew" if skews else "")
    t_start = time.perf_counter()
    from lightning_galv.testing import run_distributed

    cache = Path(args.profiles)
    cached: dict[int, tuple[ModelProfile, HardwareProfile]] = {}
    fresh = args.fresh_profiles and not args.quick
    if not fresh:
        if cache.is_file() and not args.reprofile:
            d = json.loads(cache.read_text())
            cached = {int(w): (ModelProfile.from_dict(m), HardwareProfile.from_dict(h)) for w, (m, h) in d.items()}
            print("profiles from", cache)
        else:
            for w in (2, 4):
                t0 = time.perf_counter()
                cached[w] = profile_world(w, cfg, seq, "profile_machine_moe" if moe else "profile_machine",
                                          args.sharded_rounds, budget)
                print(f"profiles on {w} ranks: {time.perf_counter() - t0:.1f} s")
            cache.write_text(json.dumps({w: (m.to_dict(), h.to_dict()) for w, (m, h) in cached.items()}))

    warmup, steps = (1, 2) if args.quick else (2, 5)
    per_launch: dict[str, list[dict]] = {c.name: [] for c in cases}
    memory: dict[str, dict] = {}
    # launch -> world -> the profiles its predictions come from (with --fresh-profiles: taken in that launch,
    # right before its plans run, so every error below pairs one profile run with one measurement run)
    launch_profiles: list[dict[int, tuple[ModelProfile, HardwareProfile]]] = []
    for launch in range(launches):
        launch_profiles.append({})
        for world in (2, 4):
            batch = [c for c in cases if c.plan.world_size == world]
            if not batch:
                continue
            if fresh:
                t0 = time.perf_counter()
                launch_profiles[launch][world] = profile_world(
                    world, cfg, seq, "profile_machine_moe" if moe else "profile_machine", args.sharded_rounds, budget)
                print(f"launch {launch + 1}/{launches}: profiles on {world} ranks: {time.perf_counter() - t0:.1f} s",
                      flush=True)
            else:
                launch_profiles[launch][world] = cached[world]
            if skews:  # what the training data does to expert parallelism, which the profile's inputs do not show
                m, h = launch_profiles[launch][world]
                launch_profiles[launch][world] = (m.with_routing_skew(skews[world]), h)
            k = launch * len(batch) // launches  # rotate the order: no plan always runs first or last
            order = batch[k:] + batch[:k]
            t0 = time.perf_counter()
            res = run_distributed(f"{RANKS}::measure_plans", world,
                                  ([(c.name, c.plan.to_dict(), c.cfg, c.seq) for c in order], warmup, steps,
                                   launch == 0, (cfg, seq)), timeout=1800)
            print(f"launch {launch + 1}/{launches}: {len(batch)} plans on {world} ranks: "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            ref = probe_of(launch_profiles[launch][world][0])
            for c in order:
                r0 = res[0][c.name]
                # the plan's time at the speed the machine had while profiling: one factor per plan and launch
                # from the median of the probes taken right before its steps (one probe is too noisy on 4 ranks)
                f = ref / statistics.median(r0["probes"])
                model, hw = launch_profiles[launch][world]
                pred = GalvatronCostModel(profile_for(model, c), hw, runtime="native").evaluate(c.plan)
                # where the time goes: measured (fwd+bwd, gradient sync wait, optimizer) at profile speed against
                # the prediction's micro-batch part and per-step part (no pipeline: step = m x micro-batch + extra)
                ph = [statistics.median(v) * f for v in zip(*r0["phases"])]
                one = c.plan.pp == 1
                # each step scaled by the probes right before and right after it (geometric mean): the speed
                # changes within a plan's steps too (one launch here: factors 0.92-1.35 a few seconds apart)
                after = r0.get("probes_after") or r0["probes"]
                mt = statistics.median(t * ref / math.sqrt(a * b) for t, a, b in zip(r0["times"], r0["probes"], after))
                # the prediction split as the step is measured: the bucket copies of the gradient hooks in fwd+bwd
                pfb, pex = pred.phases(0, c.plan.micro_batches) if one else (None, None)
                # the same steps against the previous reference (the probes around the profile run)
                mt_around = mt * around_of(model) / ref
                per_launch[c.name].append(dict(launch=launch, raw=r0["step_s"], mt=mt, mt_around=mt_around,
                                               load=1 / f, pred=pred.step_time_s, pm=pred.peak_memory_bytes, ph=ph,
                                               pfb=pfb, pex=pex))
                if launch == 0:
                    memory[c.name] = dict(mm=max(r[c.name]["peak_bytes"] for r in res),
                                          rss=max(r[c.name]["rss_peak_bytes"] for r in res),
                                          kinds=max((r[c.name] for r in res), key=lambda r: r["peak_bytes"])["by_kind"])
    rows = []
    for c in cases:
        runs = per_launch[c.name]
        mts, preds = [r["mt"] for r in runs], [r["pred"] for r in runs]
        rows.append(dict(name=c.name, world=c.plan.world_size, plan=c.plan, case=c, heldout=c.heldout, runs=runs,
                         pred=statistics.median(preds), preds=preds, pm=runs[0]["pm"],
                         mt=statistics.median(mts), mts=mts, raw=statistics.median(r["raw"] for r in runs),
                         load=statistics.median(r["load"] for r in runs), **memory[c.name]))
    for per_variant in (True, False):
        calibrate(rows, launch_profiles, per_variant)
    report = (table(rows, launches, steps, warmup, fresh, grid) + "\n\n" + offset_line(launch_profiles) + "\n"
              + rounds_line(launch_profiles))
    print(report)
    if args.only:
        for r in rows:
            print(r["name"], {k: f"{v / MiB:.2f}" for k, v in r["kinds"].items()})
        return
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if not args.no_write:
        dump = [{k: v for k, v in r.items() if k not in ("plan", "case", "cal", "cal_nv")} | {"plan": r["plan"].to_dict()}
                for r in rows]
        (HERE / "data").mkdir(exist_ok=True)
        (HERE / "data" / f"costmodel_{tag}.json").write_text(json.dumps(dump, indent=1, default=float))
        # the profiles these predictions came from (per launch), so the table can be re-derived -- or another
        # cost model tried -- against the same measurements later
        (HERE / "data" / f"costmodel_{tag}_profiles.json").write_text(json.dumps(
            [{w: (m.to_dict(), h.to_dict()) for w, (m, h) in lp.items()} for lp in launch_profiles]))
        write_results(report, args.model, args.sharded_rounds, budget, skews)


def calibrate(rows: list[dict], launch_profiles: list[dict[int, tuple[ModelProfile, HardwareProfile]]],
              per_variant: bool) -> None:
    """Issue 13: each in-sample plan predicted by a Calibration fitted on the *other* in-sample plans of its world
    size (leave-one-out), each held-out case by one fitted on all in-sample plans of its world: out of sample
    either way. Per launch: its profiles, its measurements; the row keeps the median over launches of the signed
    error. ``per_variant``: also a compute factor per measured sharding (tp, sp) of the block."""
    from lightning_galv.planner.calibration import Calibration

    def native(m: ModelProfile, h: HardwareProfile) -> GalvatronCostModel:
        return GalvatronCostModel(m, h, runtime="native")

    key = "" if per_variant else "_nv"
    for r in rows:
        errs, pms, cals = [], [], []
        for run in r["runs"]:
            launch = run["launch"]
            model, hw = launch_profiles[launch][r["world"]]
            others = [(o["plan"], o2["mt"], o["mm"]) for o in rows
                      if o["world"] == r["world"] and o is not r and not o["heldout"]
                      for o2 in o["runs"] if o2["launch"] == launch]
            if not others:  # nothing to learn from (a --only selection)
                continue
            cal = Calibration.fit_plans(native, model, hw, others, per_variant=per_variant)
            m2, h2 = cal.apply(profile_for(model, r["case"]), hw)
            pred = native(m2, h2).evaluate(r["plan"])
            errs.append(rel(pred.step_time_s, run["mt"]))
            pms.append(pred.peak_memory_bytes)
            cals.append(cal)
        r["cal_err" + key] = statistics.median(errs) if errs else float("nan")
        r["cal_errs" + key] = errs  # per launch, in launch order (the bootstrap resamples launches)
        r["cal_pm" + key] = pms[0] if pms else float("nan")
        r["cal" + key] = cals[0] if cals else Calibration()


def _pct(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]  # NaN: not calibrated (no other plan to fit on)
    return f"median |err| {statistics.median(xs):.1%}, max {max(xs):.1%}" if xs else "n/a"


def _boot(rs: list[dict], key: str) -> str:
    """Median and max |err| over ``rs`` with their 95 % bootstrap intervals over launches (``key``: per-launch
    signed errors of each row); the goal is judged at the upper ends."""
    import numpy as np
    from _stats import bootstrap_launches

    errs = [r[key] for r in rs if r[key]]
    if not errs or len({len(e) for e in errs}) != 1:
        return "n/a"
    med = bootstrap_launches(errs, np.median)
    mx = bootstrap_launches(errs, np.max)
    ok = "holds" if med[2] <= 0.05 and mx[2] <= 0.15 else "does not hold"
    return (f"median |err| {med[0]:.1%} [{med[1]:.1%}, {med[2]:.1%}], max {mx[0]:.1%} [{mx[1]:.1%}, {mx[2]:.1%}] "
            f"-> goal {ok} at the upper ends")


def offsets_line(ins: list[dict]) -> str:
    """What one profile run shifts alike (:func:`_stats.launch_offsets`), per world: the launches' offsets and the
    plans' errors relative to the other plans of their launch, with the bootstrap's upper ends."""
    from _stats import launch_offsets

    parts = []
    for w in (2, 4):
        rs = [r for r in ins if r["world"] == w]
        if len(rs) < 2 or len(rs[0]["ets"]) < 2:
            continue
        offsets, residuals = launch_offsets([r["ets"] for r in rs])
        parts.append(f"{w} ranks: offsets {statistics.median(offsets):+.1%} median, [{min(offsets):+.1%}, "
                     f"{max(offsets):+.1%}] over {len(offsets)} launches (sd {statistics.pstdev(offsets):.1%}); "
                     f"residuals {_boot([{'r': x} for x in residuals], 'r')}")
    return ("Launch offsets (a diagnostic, not the goal: a launch's offset is the median error of its in-sample "
            "plans, a plan's residual its error relative to the median of the other plans of its launch, i.e. what "
            "is left when one factor per profile run is divided out): " + "; ".join(parts) + ".") if parts else ""


def phase_table(rows: list[dict]) -> str:
    """Predicted vs measured per phase, before calibration: so an error can be traced to the forward/backward
    (compute, tp / ep collectives, the overlapped gradient all-reduce) or to the per-step part (the gradient
    sync wait after backward and the optimizer)."""
    lines = ["Where the time goes, before calibration (median over launches, at profile speed; plans without a "
             "pipeline): fwd+bwd = the micro-batches' forward and backward with what the runtime overlaps with them, "
             "per step = what the gradient sync still takes after the last rank's backward ends + the optimizer step "
             "(measured along the critical path: fwd+bwd ends when the last rank's backward ends, so the phases add "
             "up to the step; see benchmarks/sync_wait.py).", "",
             "| plan | fwd+bwd predicted / measured | err | per step predicted / measured | err |", "|---|---|---|---|---|"]
    for r in rows:
        runs = [x for x in r["runs"] if x.get("pfb") is not None]
        if not runs:
            continue
        pfb = statistics.median(x["pfb"] for x in runs)
        mfb = statistics.median(x["ph"][0] for x in runs)
        pex = statistics.median(x["pex"] for x in runs)
        mex = statistics.median(x["ph"][1] + x["ph"][2] for x in runs)
        lines.append(f"| {r['name']} | {pfb * 1e3:.0f} / {mfb * 1e3:.0f} ms | {rel(pfb, mfb):+.0%} | "
                     f"{pex * 1e3:.0f} / {mex * 1e3:.0f} ms | {rel(pex, mex):+.0%} |")
    return "\n".join(lines)


def budget_sweep(rows: list[dict], grid_mib: tuple[int, int, int] = (24, 128, 4)) -> str:
    """The feasibility check against budgets on a fixed grid (by default every 4 MiB from 24 to 128 MiB; per model
    in ``MODELS``), chosen without looking at the predictions: a plan "fits" when the search would keep it
    (prediction within the budget less the search's margin) and really fits when its measured peak is within the
    budget."""
    lo_mib, hi_mib, step_mib = grid_mib
    grid = [b * MiB for b in range(lo_mib, hi_mib + 1, step_mib)]
    out = []
    for label, rs in (("in-sample", [r for r in rows if not r["heldout"]]), ("held-out", [r for r in rows if r["heldout"]])):
        if not rs:
            continue
        false_fit, false_nofit, pairs = [], 0, 0
        for b in grid:
            for r in rs:
                pairs += 1
                says = r["pm"] <= b * (1 - DEFAULT_MEMORY_MARGIN)
                if says and r["mm"] > b:
                    false_fit.append(f"{r['name']} at {b / MiB:.0f} MiB")
                elif not says and r["mm"] <= b:
                    false_nofit += 1
        out.append(f"{label}: {pairs} (plan, budget) pairs, {len(false_fit)} false \"fits\""
                   f"{' (' + ', '.join(false_fit) + ')' if false_fit else ''}, {false_nofit} false \"does not fit\"")
    return (f"Feasibility against budgets on a fixed grid ({lo_mib}-{hi_mib} MiB every {step_mib} MiB; the search keeps "
            f"{DEFAULT_MEMORY_MARGIN:.0%} free), live-tensor peaks: " + "; ".join(out) + ".")


def table(rows: list[dict], launches: int, steps: int, warmup: int, fresh: bool = False,
          grid_mib: tuple[int, int, int] = (24, 128, 4)) -> str:
    from _stats import interval

    head = ("| plan | held out | predicted" + (": median [min, max] over the launches' profiles" if fresh else "") +
            " | measured at profile speed: median [95 % CI of mean] | load | err | "
            "err (raw) | pred. memory | live-tensor peak | err | RSS peak growth | calibrated: time err "
            "(per-variant / shared) | memory err |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        # per launch: that launch's prediction against that launch's measurement; the row shows the median
        r["ets"] = [rel(x["pred"], x["mt"]) for x in r["runs"]]
        r["et"] = statistics.median(r["ets"])
        r["ers"] = [rel(x["pred"], x["raw"]) for x in r["runs"]]
        r["eas"] = [rel(x["pred"], x["mt_around"]) for x in r["runs"] if "mt_around" in x]
        r["er"] = statistics.median(r["ers"])
        r["em"] = rel(r["pm"], r["mm"])
        _, lo, hi = interval(r["mts"]) if len(r["mts"]) > 1 else (0, float("nan"), float("nan"))
        spread = f" [{min(r['preds']) * 1e3:.0f}, {max(r['preds']) * 1e3:.0f}]" if fresh else ""
        lines.append(f"| {r['name']} | {r['heldout'] or '-'} | {r['pred'] * 1e3:.0f} ms{spread} | {r['mt'] * 1e3:.0f} ms "
                     f"[{lo * 1e3:.0f}, {hi * 1e3:.0f}] | ×{r['load']:.2f} | **{r['et']:+.1%}** | {r['er']:+.1%} | "
                     f"{r['pm'] / MiB:.1f} MiB | {r['mm'] / MiB:.1f} MiB | {r['em']:+.1%} | {r['rss'] / MiB:.1f} MiB | "
                     f"**{r['cal_err']:+.1%}** / {r['cal_err_nv']:+.1%} | "
                     f"{rel(r['cal_pm'], r['mm']):+.1%} |")
    ins = [r for r in rows if not r["heldout"]]
    out = [r for r in rows if r["heldout"]]

    def errs(rs: list[dict], key: str) -> list[float]:
        return [abs(r[key]) for r in rs]

    def mem_errs(rs: list[dict], key: str) -> list[float]:
        return [abs(rel(r[key], r["mm"])) for r in rs]

    facts = "; ".join(f"{w} ranks: compute ×{c['compute_scale']}, collectives ×{c['comm_scale']:.2f}, memory "
                      f"{c['memory_slack_bytes'] / MiB:+.2f} MiB" for w, c in sorted(
                          {r["world"]: {"compute_scale": {k: round(v, 2) for k, v in r["cal"].compute_scale.items()},
                                        "comm_scale": r["cal"].comm_scale,
                                        "memory_slack_bytes": r["cal"].memory_slack_bytes} for r in out or ins}.items()))
    per = "each launch's error, median over launches" if launches > 1 else "one launch"
    lines += ["",
              f"Errors per plan: {per}. Before calibration, time at profile speed: in-sample {_pct(errs(ins, 'et'))}, "
              f"held-out {_pct(errs(out, 'et'))}; raw (no speed correction): in-sample {_pct(errs(ins, 'er'))}. "
              f"Memory (live-tensor peak): in-sample {_pct(mem_errs(ins, 'pm'))}, held-out {_pct(mem_errs(out, 'pm'))}.",
              f"After calibration (issue 13; out of sample, see the notes) with a factor per measured sharding "
              f"(the default): time in-sample {_pct(errs(ins, 'cal_err'))}, held-out {_pct(errs(out, 'cal_err'))}; "
              f"with shared factors only: in-sample {_pct(errs(ins, 'cal_err_nv'))}, held-out "
              f"{_pct(errs(out, 'cal_err_nv'))}. Goal: median ≤ 5 %, max ≤ 15 %. Memory: in-sample "
              f"{_pct(mem_errs(ins, 'cal_pm'))}, held-out {_pct(mem_errs(out, 'cal_pm'))} (goal: median ≤ 2 %).",
              "By world size (4 ranks share the 2 cores): " + "; ".join(
                  f"{w} ranks: before {_pct(errs([r for r in ins if r['world'] == w], 'et'))}, after "
                  f"{_pct(errs([r for r in ins if r['world'] == w], 'cal_err'))} (in-sample)" for w in (2, 4)
                  if any(r["world"] == w for r in ins)) + ".",
              "Goal check at the pessimistic end (95 % percentile bootstrap over the launches: a draw resamples "
              "launches, each plan's error is its median over the drawn launches): " + "; ".join(
                  f"{w} ranks{' (oversubscribed: 4 ranks on 2 cores)' if w == 4 else ' (one core per rank)'}: "
                  f"before calibration {_boot([r for r in ins if r['world'] == w], 'ets')} (raw, no speed "
                  f"correction: {_boot([r for r in ins if r['world'] == w], 'ers')}); after "
                  f"{_boot([r for r in ins if r['world'] == w], 'cal_errs')}; held-out before "
                  f"{_boot([r for r in out if r['world'] == w], 'ets')}; held-out after "
                  f"{_boot([r for r in out if r['world'] == w], 'cal_errs')}" for w in (2, 4)
                  if any(r["world"] == w for r in ins)) + ".",
              "The same measurements at the speed of the probes around each profile run (the reference from "
              "6565948 to 2026-12-06, see the notes), before calibration: " + "; ".join(
                  f"{w} ranks: in-sample {_boot([r for r in ins if r['world'] == w], 'eas')}, held-out "
                  f"{_boot([r for r in out if r['world'] == w], 'eas')}" for w in (2, 4)
                  if any(r["world"] == w for r in ins)) + ".",
              offsets_line(ins),
              budget_sweep(rows, grid_mib),
              phase_table(rows),
              f"Factors fitted on all in-sample plans of each world (first launch): {facts}."]
    prof = ("a fresh profile per launch and world size, taken right before that launch's plans run"
            if fresh else "one cached profile per world size")
    notes = (f"Each time: {launches} independent launches per world size (fresh processes, plan order rotated per "
             f"launch; {prof}), per launch the median of {steps} steps after {warmup} warm-up steps (slowest rank), "
             f"each step scaled to the speed of the launch's profile; the table gives the median over launches and the 95 % "
             f"t-interval of their mean. Memory from the first launch.")
    return notes + "\n\n" + "\n".join(lines)


NOTES = """Model: reference LLaMA, dim 256, 4 layers, 8 heads (4 kv), ffn 768, vocab 512, seq 128, fp32, Adam,
global batch 8, gloo, 1 thread per rank, 2 vCPUs (a VM on a shared host). Profiles are measured inside a
2-rank and a 4-rank launch with every rank busy: HardwareProfiler (collectives 64 KiB..16 MiB, fitted by
relative error), ModelProfiler (block at 1-4 samples x seq 64/128, head, optimizer bandwidth on the model's
parameter volume) and ShardedLayerProfiler (the real parallelized block for every (tp, sp) at 2-8 samples:
per-rank compute with the predicted collectives subtracted, saved activations with/without checkpointing, the
recompute peak, FSDP2's own overhead per ZeRO stage (per unit of two chained under a shared root since 9fa6f05,
and of one alone since 6bbbf36); all variants timed interleaved, 5 rounds). Each world's plans are predicted from that world's
profiles with `GalvatronCostModel(..., runtime="native")`; nothing is fitted to the plans' step times except
in the calibrated columns. A profile run shifts every prediction of its world alike (the same plan was
predicted at 243, 303 and 492 ms from three profile runs in issue 17's re-measurement), so with `--fresh-profiles`
every launch profiles both world sizes anew right before measuring its plans, and each plan's error is the median
over launches of (that launch's prediction vs that launch's measurement); the predicted column shows the median
and the range over the launches' profiles.

In-sample plans run the profiled shape; held-out cases change the global batch (16), the depth (2 or 6
blocks; the profile's block repeated), the sequence length (64 or 256 tokens at global batch 16 or 4, the
tokens per step of the profiled shape; the profile carried there by `ModelProfile.with_seq_len`: each measured
point read at its token count, block passes times the attention span's growth -- since 0d94279 its share of the
block's time measured by the ShardedLayerProfiler's attention probe (`LayerTypeProfile.span_factor`; a tensor-parallel
variant by its own share, `variant_span_factor`, since the commit after e559375), before it the span's share of the
FLOPs --, activations in proportion to the length; their speed probes stay at the profiled length, so that probe and reference time one pass) or the
width (192 or 384 at heads of the profiled size and the FFN at 3x, the profile carried by
`ModelProfile.with_width`: per-token work split by the matmul rate timed beside the profile's block variants
into the weights' matmuls, times the weight ratio, and the rest, times the width ratio (until 2026-12-07: all of
it times the block's forward FLOP ratio), the measured per-call overhead kept, FSDP2's overhead times the weight ratio (since 9cc12e4 the whole fit;
before, its per-token slope only), activations and the ends in proportion to the width but for the head's logits; probed at the profiled
width).

Speed correction: the VM's speed drifts (the same launch ran 45 ms and 75 ms per forward minutes apart), so a
compute probe (the unsharded block's fwd+bwd at 2 samples on every rank at once, timed as the ShardedLayerProfiler
times its variants: a fresh input, all ranks starting each pass together, a warm-up and 5 timed passes (2 for the
MoE decoder, as automatic mode profiles it), each pass's slowest rank's forward + backward, then the median --
since a1d10ad, as the profiler now reduces its passes; before, each rank's median forward and backward, then the
slowest rank's of each, which at 4 ranks read 0.894 [0.856, 0.931] of the blocks back to back, section
`pass_reduction`) runs before every step and after the last; "at profile speed" scales each step's time
by the profile's reference / the geometric mean of the probes right before and right after that step, then
takes the median over steps ("load" = median probe / profile reference; the phase columns use that one factor per
plan). The reference (since 2026-12-06) is the ShardedLayerProfiler's own raw median of its `tp1/none` variant at
2 samples, the pass the probe repeats, timed during the rounds that time every block variant the predictions are
made of. From 6565948 to 2026-12-06 it was the median of 3 probes right before and 3 right after the profile run;
those bracket a run of a minute or more and missed spells inside it (at 5e9ee88 one 4-rank profile's interleaved
timing read 1.24x the probes around it, and that launch's predictions stood +23.5 % off); the line "at the speed
of the probes around" gives this run's errors against that reference too. From 257c0e1 to 6565948 the
interleaved timing was the reference already, but the probe then reduced its passes otherwise and read ~8 % faster
at equal speed (probe / it = 0.915 [0.865, 0.964] at 2 ranks and 0.924 [0.900, 0.948] at 4, section
`probe_offset`), which scaled every measured step up by ~8 %; since a1d10ad both reduce passes alike (the line
under the table gives the ratio for this run's profiles); before 257c0e1 it was the fit at 2 samples. Raw errors are shown too. Memory: "live-tensor peak" = per-rank peak (max over
ranks) of live tensor bytes during one step by torch's MemTracker (parameters + gradients kept between steps +
optimizer states + activations + temporaries + buffers), which is what the prediction counts; "RSS peak growth"
= the process's resident-set high-water mark during the plan's steps minus its RSS before the plan was built
(freed heap trimmed and the high-water mark reset first): what the process really held on top of the
interpreter and libraries -- allocator and malloc slack and gloo's buffers included, which the prediction does
not itemize on CPU. The user's budget (`memory_budget`) is compared with the prediction, i.e. refers to tensor
bytes (plus the profile's framework bytes, 0 here).

Calibration (issue 13): each in-sample plan is predicted with a `Calibration` fitted by least squares on the
*other* in-sample plans of its world (leave-one-out; every sharding of the block occurs in at least two
in-sample plans per world, so the fit has seen each one); each held-out case with one fitted on all in-sample plans
of its world -- out of sample either way. Two forms: with a compute factor per measured sharding of the block
(`Calibration.fit_plans` default) and with shared factors only (one compute scale per layer type, one
collective scale, memory slack)."""


MOE_MODEL_LINES = {
    "moe": """Model: the MoE decoder, dim 128, 4 blocks all MoE (8 SwiGLU experts of width 256, top-2, dropless,
aux/z-loss on), attention 4 heads (2 kv), vocab 256, seq 64, fp32, Adam, global batch 8, random tokens (the""",
    "moe-wide": """Model: the dense section's model with every FFN replaced by 8 SwiGLU experts of width 384 (half the dense
FFN's 768), top-2 (so a token's active FFN width is the dense one), dropless, aux/z-loss on: dim 256, 4 blocks all
MoE, attention 8 heads (4 kv), vocab 512, seq 128, fp32, Adam, global batch 8. Why this model besides the small one
(`--model moe`, dim 128, seq 64): that one's speed reference is a 6-7 ms pass and its steps take ~60 ms; on this VM
a pass that short jitters, and in its 20-launch run at 045cbe2 both a profile's own ratio prediction / reference and
a measurement's step / probe spread with sd 7-11 % over launches (1-2 % for the dense model). Random tokens (the""",
}

MOE_NOTES = """{model}
the cost model assumes balanced routing, as the profiler's random hidden states give it; the benchmark's batch
does not: at the models' initialization the busiest EP rank gets 1.1-1.6x its group's mean of routed copies, section
"Routing skew" (benchmarks/moe_routing_skew.py; until 2026-12-08 this note said random tokens give even routing,
which was never measured). Profiles as
automatic mode takes them (HardwareProfiler incl. all-to-all, ModelProfiler per block kind with the MoE facts,
then each block kind as the runtime shards it by the ShardedLayerProfiler, `auto.sharded_profile`, which for an
MoE block also times every expert-parallel degree, and FSDP2's overhead at each of them as the runtime wraps the
experts), both at the sample counts automatic mode takes (`auto.profile_batch_sizes`: 1, 2 and the loader's
per-rank batch -- 1/2/4 samples at 2 ranks, 1/2 at 4; since 8ea3e32 a tp-t variant at the t x larger batch its
blocks run, `auto.tp_batch_sizes`: tp2 at 1/2/8 on 2 ranks, 1/2/4 on 4; since f798122 every fit returns its
measured times at the measured batches), the sharded variants over `auto.SHARDED_PROFILE_ROUNDS`
rounds (4 since 2026-11-28; 2 before, and the probe took as many passes), since 2026-12-04 more while they fit in
`auto.SHARDED_PROFILE_BUDGET_S` seconds per layer type, up to `auto.SHARDED_PROFILE_MAX_ROUNDS` (the line
under the table gives the rounds taken; the probe keeps `SHARDED_PROFILE_ROUNDS` passes);
everything else as in the dense section above (MemTracker peak, leave-one-out calibration, speed correction),
except that the probe times the decoder's own MoE block (unsharded, every expert local, its router statistics
all-reduced over the world as the profiler times it); the reference is the profiler's timing of that block's
`tp1/none` variant at the probe's shape, as above (the probes around the profile run from 6565948 to 2026-12-06; from 0a74b18 to 6565948 the profiler's timing of that block's `tp1/none` variant at the probe's shape:
its fit until 257c0e1, then its raw median; until 0a74b18 the median of probes taken around profiling, but of a
dense block's, while the steps' probes timed the MoE block)."""


def write_results(report: str, model: str = "llama", rounds: int = 5, budget_s: float | None = None,
                  skews: dict[int, dict[int, float]] | None = None) -> None:
    from _results import write_section

    timing = (f"timed interleaved, {rounds} rounds" if budget_s is None else
              f"timed interleaved, at least {rounds} rounds and more while they fit in {budget_s:g} s, up to "
              f"{max(rounds, SHARDED_PROFILE_MAX_ROUNDS)} (`profiling.profilers.rounds_within_budget`; the line under "
              "the table gives the rounds taken)")

    if model != "llama":
        notes = MOE_NOTES.replace("{model}", MOE_MODEL_LINES[model])
        flag = ""
        if skews:
            flag = " --routing-skew measured"
            notes += ("\n\nRouting skew: each world's profiles carry the skew measured on the plans' own batch "
                      "(`profiling.measure_routing_skew`, every rank a data shard; `ModelProfile.with_routing_skew`), "
                      "which the cost model prices as the busiest EP rank's extra expert work at the profile's matmul "
                      "rate (`cost.ep_skew_time`): " + "; ".join(
                          f"{w} ranks " + ", ".join(f"ep{e} {f:.2f}" for e, f in sk.items()) for w, sk in skews.items())
                      + ". The same batch, measured before any plan runs: no step time enters it.")
        write_section(MODELS[model][2] + ("_skew" if skews else ""), "## Cost-model accuracy for MoE / expert "
                      f"parallelism (benchmarks/costmodel_accuracy.py --model {model}{flag})\n\n{notes}\n\n{report}")
        return
    write_section("costmodel", "## Cost-model accuracy on this machine (benchmarks/costmodel_accuracy.py)\n\n"
                  f"{NOTES.replace('timed interleaved, 5 rounds', timing)}\n\n{report}")


if __name__ == "__main__":
    main()
