"""The core test: every plan kind trains to the losses and weights of a single process (fp32, 1e-5).

Each launch runs many plans (start-up dominates a gloo launch on CPU); inside each rank the same
model is also trained single-process on the full batch, and the two are compared.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lightning_galv.demo.run import demo_plan
from lightning_galv.plan import LayerStrategy as L
from lightning_galv.plan import ModelShape, ParallelPlan
from lightning_galv.testing import assert_matches_one_process, random_plan, run_distributed

CHECKS = str(Path(__file__).parent / "dist_runtime_checks.py") + "::run_many"
TOL = 1e-5
STEPS4 = 6  # optimizer steps per case of the 4-rank launch (a case may name fewer)
OPTIMIZERS = ("sgd", "sgd_foreach", "adam_foreach", "adamw_fused", "adagrad", "rmsprop_foreach", "adamax", "nadam",
              "radam_foreach")  # dist_runtime_checks.OPTIMIZERS' names


def _with_steps(cases: list[tuple[str, dict, dict]], steps: int) -> list[tuple[str, dict, dict]]:
    """The cases with ``steps`` optimizer steps, except those that name their own."""
    return [(name, plan, {"steps": steps, **kw}) for name, plan, kw in cases]


def _cases4() -> list[tuple[str, dict, dict]]:
    u = ParallelPlan.uniform
    return [
        ("dp", u(4, 3).to_dict(), {}),
        ("zero1", u(4, 3, L(dp=4, zero=1)).to_dict(), {}),
        ("zero2_accum", u(4, 3, L(dp=4, zero=2)).to_dict(), {"accumulate": 2}),
        ("zero3_gpt2", u(4, 3, L(dp=4, zero=3)).to_dict(), {"kind": "gpt2"}),
        ("tp2", u(4, 3, L(tp=2, dp=2)).to_dict(), {}),
        ("tp4", u(4, 3, L(tp=4)).to_dict(), {}),
        ("tp4_megatron_sp", u(4, 3, L(tp=4, sp="megatron")).to_dict(), {}),
        ("tp2_sp_gpt2", u(4, 3, L(tp=2, dp=2, sp="megatron")).to_dict(), {"kind": "gpt2"}),
        ("ulysses2", u(4, 3, L(tp=2, dp=2, sp="ulysses")).to_dict(), {}),
        ("ulysses4", u(4, 3, L(tp=4, sp="ulysses")).to_dict(), {}),
        ("tp2_x_zero3", u(4, 3, L(tp=2, dp=2, zero=3)).to_dict(), {}),
        # issue 9 item 8: the README's tp=2 x zero=3 with vocab-parallel embedding/head under FSDP2 (whose
        # outputs were views), checkpointed, and next to layers that need a batch re-layout, including a
        # tp=4 dp=1 ZeRO-3 layer (FSDP2 on one rank used to divide its gradient twice: 1/4 of the truth)
        ("tp2_x_zero3_ckpt_gpt2", u(4, 3, L(tp=2, dp=2, zero=3, checkpoint=True)).to_dict(), {"kind": "gpt2"}),
        ("zero3_relayout_tp4dp1", ParallelPlan(4, (L(dp=4, zero=3), L(tp=2, dp=2, zero=3, checkpoint=True),
                                                   L(tp=4, zero=3)), embed=L(tp=2, dp=2, zero=3),
                                               head=L(tp=2, dp=2, zero=3)).to_dict(), {"kind": "gpt2"}),
        ("zero3_relayout_llama", ParallelPlan(4, (L(tp=2, dp=2, zero=3), L(tp=4, zero=2), L(dp=4, zero=3)),
                                              embed=L(tp=2, dp=2, zero=3), head=L(tp=4, zero=3)).to_dict(), {}),
        ("tp2_strided_gpt2", u(4, 3, L(tp=2, dp=2, tp_consecutive=False)).to_dict(), {"kind": "gpt2"}),
        # issue 17 item 5: the ZeRO-2/3 units' FSDP2 states share one root (the model), with accumulation; per-layer
        # meshes under that root: ZeRO-3 on dp4, ZeRO-3 x tp2 on dp2, ZeRO-0, a ZeRO-1 embedding, a ZeRO-2 tp head
        ("zero3_shared_root_accum", u(4, 3, L(dp=4, zero=3)).to_dict(), {"accumulate": 2}),
        ("hetero_shared_root_accum", ParallelPlan(4, (L(dp=4, zero=3), L(tp=2, dp=2, zero=3), L(dp=4)),
                                                  embed=L(dp=4, zero=1), head=L(tp=2, dp=2, zero=2)).to_dict(),
         {"accumulate": 2, "clip": 0.05}),
        ("ckpt_mixed_clip", ParallelPlan(4, (L(dp=4, checkpoint=True), L(dp=4), L(dp=4, zero=3, checkpoint=True)))
         .to_dict(), {"clip": 0.05}),
        ("hetero3", ParallelPlan(4, (L(tp=4), L(tp=2, dp=2), L(dp=4, zero=3))).to_dict(), {"clip": 0.05}),
        ("hetero_demo_clip", demo_plan(4).to_dict(), {"layers": 4, "clip": 0.05}),
        # issue 9: TP weights re-sharded by ZeRO (strided shards) under norm clipping; value clipping on
        # DTensor gradients; ZeRO-2/3 over one-rank data groups (also inside a stage as wide as its tp)
        ("tp2_zero3_norm_clip_gpt2", u(4, 3, L(tp=2, dp=2, zero=3)).to_dict(), {"kind": "gpt2", "clip": 0.3}),
        ("embed_tp2_zero2_norm_clip", ParallelPlan(4, (L(dp=4),) * 3, embed=L(tp=2, dp=2, zero=2)).to_dict(),
         {"clip": 0.3}),
        ("hetero_value_clip_accum", ParallelPlan(4, (L(tp=2, dp=2, zero=3), L(tp=4, sp="ulysses"), L(dp=4, zero=1)),
                                                 embed=L(tp=4, zero=2), head=L(tp=2, dp=2)).to_dict(),
         {"clip": 0.01, "clip_algorithm": "value", "accumulate": 2}),
        # manual optimization: a gradient sync after each of two backwards before one step (and once more); on
        # data groups smaller than the loader's dp (tp4: one rank; tp2 ZeRO-1: two) the second sync used to
        # divide the first backward's part again
        ("sync_each_hetero_clip", ParallelPlan(4, (L(tp=4), L(tp=2, dp=2, zero=1), L(dp=4, zero=3)),
                                               embed=L(dp=4, zero=1), head=L(tp=2, dp=2)).to_dict(),
         {"accumulate": 2, "sync_each": True, "clip": 0.05}),
        ("zero_one_rank_data_group", ParallelPlan(4, (L(dp=4), L(tp=4, zero=2), L(tp=4, sp="megatron", zero=3)))
         .to_dict(), {}),
        # keyed dropout (p=0.1): every rank draws the masks one process draws for its rows and positions
        ("dropout_tp2_gpt2", u(4, 3, L(tp=2, dp=2)).to_dict(), {"kind": "gpt2", "dropout": 0.1}),
        ("dropout_tp_sp4", u(4, 3, L(tp=4, sp="megatron")).to_dict(), {"dropout": 0.1}),
        ("dropout_ulysses2_ckpt_gpt2", u(4, 3, L(tp=2, dp=2, sp="ulysses", checkpoint=True)).to_dict(),
         {"kind": "gpt2", "dropout": 0.1}),
        ("dropout_pp2_gpt2", ParallelPlan(4, (L(tp=2, checkpoint=True), L(dp=2), L(tp=2, sp="megatron")), pp=2,
                                          micro_batches=2, embed=L(dp=2), head=L(tp=2)).to_dict(),
         {"kind": "gpt2", "dropout": 0.1}),
        ("pp2_zero_one_rank_data_group", ParallelPlan(4, (L(tp=2, zero=3), L(tp=2, zero=2), L(dp=2), L(tp=2, zero=3)),
                                                      pp=2, micro_batches=2, embed=L(tp=2, zero=2),
                                                      head=L(dp=2, zero=3)).to_dict(), {"layers": 4, "clip": 0.05}),
        # multi-tensor / fused optimizer kernels (CUDA's defaults) over groups mixing plain tensors and DTensors
        # on several meshes (tp, FSDP2 dp); the reference steps with the per-tensor loop
        ("adam_foreach_hetero_clip", ParallelPlan(4, (L(tp=2, dp=2, zero=3), L(tp=4), L(dp=4, zero=1)),
                                                  embed=L(dp=4), head=L(tp=2, dp=2)).to_dict(),
         {"optimizer": "adam_foreach", "clip": 0.05}),
        ("adamw_fused_tp2_zero2", u(4, 3, L(tp=2, dp=2, zero=2)).to_dict(), {"optimizer": "adamw_fused"}),
        ("sgd_foreach_pp2_zero3", ParallelPlan(4, (L(tp=2), L(dp=2, zero=3), L(dp=2), L(tp=2, zero=2)), pp=2,
                                               micro_batches=2, embed=L(dp=2), head=L(dp=2)).to_dict(),
         {"optimizer": "sgd_foreach", "layers": 4}),
        # pipelines (issue 3): schedules, uneven stages, virtual stages, per-layer strategies inside stages
        ("pp2_gpipe", u(4, 4, L(dp=2), pp=2, micro_batches=2, pipeline_schedule="gpipe").to_dict(), {"layers": 4}),
        ("pp2_1f1b", u(4, 4, L(dp=2), pp=2, micro_batches=4).to_dict(), {"layers": 4}),
        ("pp4_1f1b_uneven", u(4, 6, L(dp=1), pp=4, micro_batches=4, pp_division=(1, 2, 2, 1)).to_dict(),
         {"layers": 6}),
        ("pp2_interleaved", u(4, 4, L(dp=2), pp=2, micro_batches=4, pipeline_schedule="interleaved_1f1b",
                              virtual_stages=2).to_dict(), {"layers": 4}),
        ("pp2_hetero_gpt2", ParallelPlan(4, pp=2, micro_batches=2, embed=L(dp=2),
                                         layers=(L(tp=2), L(tp=2, sp="megatron"), L(dp=2, zero=3),
                                                 L(dp=2, zero=3, checkpoint=True)), head=L(dp=2)).to_dict(),
         {"layers": 4, "kind": "gpt2", "clip": 0.05}),
    ]


def _cases_moe() -> list[tuple[str, dict, dict]]:
    """MoE (issue 11): blocks 0 and 2 are MoE (4 experts, top-2, shared expert; aux and z-loss on), block 1
    dense. Expert parallelism over 2 and 4 ranks, under attention tp / Megatron-SP / Ulysses, ZeRO-1/2/3 on
    the experts (ZeRO over a one-rank expert-data group too), accumulation and clipping; plain DP checks the
    global aux loss alone."""
    def moe(s: L, dense: L = L(dp=4), edge: L = L(dp=4)) -> dict:
        return ParallelPlan(4, (s, dense, s), embed=edge, head=edge).to_dict()

    kw = {"kind": "moe"}
    return [
        ("moe_dp4", moe(L(dp=4)), kw),
        ("moe_ep2", moe(L(dp=4, ep=2)), kw),
        ("moe_ep4_zero3", moe(L(dp=4, ep=4, zero=3)), kw),
        ("moe_ep2_zero1", moe(L(dp=4, ep=2, zero=1), dense=L(tp=2, dp=2)), kw),
        # the three heaviest cases (a minute or more each on 2 cores) take 4-5 steps instead of 10
        ("moe_ep2_zero2_accum_clip", moe(L(dp=4, ep=2, zero=2)), {**kw, "accumulate": 2, "clip": 0.05, "steps": 5}),
        ("moe_ep2_attn_tp2", moe(L(tp=2, dp=2, ep=2), edge=L(tp=2, dp=2)), kw),
        ("moe_ep2_megatron_ckpt", moe(L(tp=2, dp=2, sp="megatron", ep=2, checkpoint=True)), {**kw, "steps": 5}),
        ("moe_ep4_ulysses_value_clip", moe(L(tp=2, dp=2, sp="ulysses", ep=4)),
         {**kw, "clip": 0.01, "clip_algorithm": "value"}),
        # a sync after each backward (manual optimization): experts on a two-rank (ep2) and a one-rank (ep4,
        # ZeRO-3: plain, outside FSDP2) expert-data group, both smaller than the loader's dp
        ("moe_sync_each_ep2_ep4z3", ParallelPlan(4, (L(dp=4, ep=2), L(dp=4), L(dp=4, ep=4, zero=3)), embed=L(dp=4),
                                                 head=L(dp=4)).to_dict(),
         {**kw, "accumulate": 2, "sync_each": True, "steps": 5}),
    ]


def _cases_moe_pp() -> list[tuple[str, dict, dict]]:
    """MoE inside pipeline stages: ep in a stage, ZeRO-2 experts, accumulation over 4 micro-batches, an MoE
    block under Megatron-SP on the last stage (the reference runs the same global micro-batches)."""
    moe = {"kind": "moe", "layers": 4}
    return [
        ("moe_pp2_ep2", ParallelPlan(4, (L(dp=2, ep=2), L(tp=2), L(dp=2, ep=2, zero=2), L(dp=2)), pp=2,
                                     micro_batches=2, embed=L(dp=2), head=L(dp=2)).to_dict(), moe),
        ("moe_pp2_1f1b_accum", ParallelPlan(4, (L(tp=2), L(dp=2), L(dp=2, ep=2), L(tp=2, sp="megatron")), pp=2,
                                            micro_batches=4, embed=L(dp=2), head=L(dp=2)).to_dict(),
         {**moe, "accumulate": 2, "global_batch": 16, "steps": 4}),  # 4 steps = 32 micro-batches per stage
    ]


def _cases8() -> list[tuple[str, dict, dict]]:
    plan = ParallelPlan(
        8,
        embed=L(tp=2, dp=4),
        layers=(L(tp=2, dp=4, zero=3, tp_consecutive=False), L(tp=4, dp=2, sp="megatron"),
                L(tp=2, dp=4, sp="ulysses", checkpoint=True), L(dp=8, zero=1)),
        head=L(tp=4, dp=2),
    )
    pp_tp_dp = ParallelPlan.uniform(8, 4, L(tp=2, dp=2), pp=2, micro_batches=2)
    moe8 = ParallelPlan(8, (L(dp=8, ep=4), L(tp=2, dp=4), L(dp=8, ep=4, zero=2)), embed=L(dp=8), head=L(tp=2, dp=4))
    steps = {"steps": STEPS4}  # as many as a 4-rank case
    return [("hybrid8", plan.to_dict(), {"layers": 4, "global_batch": 16, **steps}),
            ("moe_ep4_x_dp2", moe8.to_dict(), {"kind": "moe", "global_batch": 16, "clip": 0.05, **steps}),
            ("pp2_tp2_dp2", pp_tp_dp.to_dict(), {"layers": 4, "global_batch": 8, **steps})]


def _cases_vocab_loss() -> list[tuple[str, dict, dict]]:
    """Vocab-parallel heads whose loss runs on vocab-sharded logits (issue 9, item 5): the head's batch
    layout differs from the loader's in all but the ZeRO-3 case, so targets and per-token losses are
    re-laid-out; one pipeline, one with label smoothing, one GPT-2."""
    vpl = {"galv_loss": True}
    return [
        ("vpl_head_tp2_dp2", ParallelPlan(4, (L(dp=4), L(tp=2, dp=2), L(dp=4)), embed=L(dp=4), head=L(tp=2, dp=2),
                                          vocab_parallel_loss=True).to_dict(), vpl),
        ("vpl_head_tp4_smooth", ParallelPlan(4, (L(tp=2, dp=2), L(dp=4, zero=1), L(tp=4)), embed=L(tp=4),
                                             head=L(tp=4), vocab_parallel_loss=True).to_dict(),
         {**vpl, "label_smoothing": 0.1, "clip": 0.05}),
        ("vpl_head_tp2_zero3_gpt2", ParallelPlan.uniform(4, 3, L(tp=2, dp=2, zero=3), vocab_parallel_loss=True)
         .to_dict(), {**vpl, "kind": "gpt2"}),
        ("vpl_pp2_head_tp2", ParallelPlan(4, pp=2, micro_batches=2, embed=L(dp=2),
                                          layers=(L(tp=2), L(dp=2), L(dp=2, zero=3), L(tp=2)), head=L(tp=2),
                                          vocab_parallel_loss=True).to_dict(), {**vpl, "layers": 4}),
    ]


# the reference models of dist_runtime_checks.make_model, as the plan generator sees them
SHAPES = {"llama": lambda n: ModelShape(n, 32, 8, 4, 64, 64, 16), "gpt2": lambda n: ModelShape(n, 32, 4, 4, 128, 64, 16),
          "moe": lambda n: ModelShape(n, 32, 8, 4, 64, 64, 16)}
CLIPS = [{}, {"clip": 0.05}, {"clip": 0.02, "norm_type": float("inf")}, {"clip": 0.01, "clip_algorithm": "value"}]


def random_cases(seed: int, world: int, n: int) -> list[tuple[str, dict, dict]]:
    """``n`` seeded random valid plans, each with a random model, depth, accumulation and clipping."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        kind = rng.choice(sorted(SHAPES))
        layers = rng.choice((3, 4))
        # MoE blocks 0, 2, ...: a random ep each. pp = 1 only: the aux loss is per micro-batch, and the
        # single-process reference runs the global batch in one forward
        moe = tuple(range(0, layers, 2)) if kind == "moe" else ()
        plan = random_plan(rng, world, SHAPES[kind](layers), moe_layers=moe, pp_choices=(1,) if moe else (1, 2))
        optimizer = random.Random(seed * 1000 + i + 10**6).choice(OPTIMIZERS)
        kw = {"kind": kind, "layers": layers, "steps": 7 if optimizer.startswith("radam") else 4,
              "global_batch": plan.global_batch,
              "accumulate": rng.choice((1, 2)), "dropout": rng.choice((0.0, 0.1)), **rng.choice(CLIPS),
              # the package's loss is required by a vocab-parallel loss and must equal F.cross_entropy otherwise
              "galv_loss": plan.vocab_parallel_loss or rng.random() < 0.3,
              # gradient buckets from 1 KiB (many per group, launched during backward) to the 25 MiB default;
              # drawn from a separate stream so the seeded plans stay the ones earlier runs checked
              "grad_bucket_bytes": random.Random(seed * 1000 + i).choice((1024, 8192, 25 * 2**20)),
              "optimizer": optimizer}  # RAdam: 7 steps, it rectifies from step 6 on
        # a sync after every backward (manual optimization), where there are several per step and no pipeline;
        # also from a separate stream
        kw["sync_each"] = (kw["accumulate"] > 1 and plan.pp == 1
                           and random.Random(seed * 1000 + i + 2 * 10**6).random() < 0.5)
        cases.append((f"random{world}_{seed}_{i}", plan.to_dict(), kw))
    return cases


def _check(results: list[dict]) -> None:
    # every rank matches the reference (under pp each rank checks the layers its stage holds) ...
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert_matches_one_process(rank, name, r, TOL)
            views = [w for w in r["warnings"] if "view tensor" in w]
            assert not views, (rank, name, views[0])
            assert r["groups_kept"], (rank, name)
            # e.g. a vocab-parallel embedding's gradient came back Replicate: full-size all-reduce and state
            assert not r["grad_layouts"], (rank, name, r["grad_layouts"])
    for name, r in results[0].items():
        assert r["keys_equal"], name
        assert r["grad_err"] or r["pp"] > 1, name  # the gradient check ran
    # ... and all ranks report the same losses
    for other in results[1:]:
        for name in results[0]:
            assert other[name]["losses"] == results[0][name]["losses"], name


def _check_fsdp_root(name: str, plan: ParallelPlan, results: list[dict]) -> None:
    """Without a pipeline, two or more ZeRO-2/3 modules (embedding, blocks, final norm + head) share one FSDP2
    root, the model (``""``), which is the only root; a lone one is its own root, and pipelines keep a root
    per unit (issue 17 item 5)."""
    modules = (plan.embed.zero >= 2) + sum(s.zero >= 2 for s in plan.layers) + 2 * (plan.head.zero >= 2)
    for rank, r in enumerate(results):
        roots = r[name]["fsdp_roots"]
        if plan.pp == 1 and modules >= 2:
            assert roots == [""], (rank, name, roots)
        else:
            assert "" not in roots, (rank, name, roots)


@pytest.mark.slow
@pytest.mark.distributed
def test_parity_4_ranks() -> None:
    """Every plan kind, plus the vocab-parallel-loss plans, in one launch.

    Each case runs ``STEPS4`` optimizer steps unless it names its own: the gradients are compared after the first,
    the weights after the last (with momentum, so the optimizer state takes part). On 2 cores a step of a 4-rank
    plan costs 0.2-0.4 s of collectives, so this launch is the suite's longest."""
    results = run_distributed(CHECKS, 4, (_with_steps(_cases4() + _cases_vocab_loss() + _cases_moe() +
                                                      _cases_moe_pp(), STEPS4),), timeout=1200)
    _check(results)
    for name, plan, _ in _cases_moe():
        # expert parallelism really ran: each rank holds E/ep experts per MoE layer and used the all-to-all
        eps = [ParallelPlan.from_dict(plan).layers[i].ep for i in (0, 2)]  # the MoE blocks'
        for r in results:
            assert r[name]["experts_held"] == [4 // ep for ep in eps], (name, r[name]["experts_held"])
            assert r[name]["all_to_all"] == [ep > 1 for ep in eps], name
            assert r[name]["routing"] and all(all(c.values()) for c in r[name]["routing"]), (name, r[name]["routing"])
    for name, plan, _ in _cases4() + _cases_vocab_loss() + _cases_moe() + _cases_moe_pp():
        _check_fsdp_root(name, ParallelPlan.from_dict(plan), results)
    for r in results:  # one state per unit, the head's two modules in one; the next unit prefetched in forward
        assert r["zero3_shared_root_accum"]["fsdp_states"] == [[""], ["layers.0"], ["layers.1"], ["layers.2"],
                                                               ["norm", "output"], ["tok_embeddings"]], r
        assert r["zero3_shared_root_accum"]["fsdp_prefetch"] == {
            "tok_embeddings": ["layers.0"], "layers.0": ["layers.1"], "layers.1": ["layers.2"],
            "layers.2": ["norm"]}, r["zero3_shared_root_accum"]["fsdp_prefetch"]
        assert r["hetero_shared_root_accum"]["fsdp_states"] == [[""], ["layers.0"], ["layers.1"],
                                                                ["norm", "output"]], r
    for r in results:  # what the cost model prices (planner/cost.py): a ZeRO-2 unit all-gathers in every
        # micro-batch (FSDP2 re-shards after each backward) and reduce-scatters only in the last one; ZeRO-3 gathers
        # for forward and again for backward. 5 units: embedding, 3 blocks, norm + head.
        assert r["zero2_accum"]["fsdp_per_micro"] == [(5, 0), (5, 5)] * STEPS4, r["zero2_accum"]["fsdp_per_micro"]
        z3 = r["zero3_shared_root_accum"]["fsdp_per_micro"]
        assert z3 == [(10, 0), (10, 5)] * STEPS4, z3
    # under a pipeline (counted per schedule run of 2 micro-batches) every micro-batch's backward reduces -- no
    # accumulation outside the schedule -- and a ZeRO-3 unit gathers for forward and backward, a ZeRO-2 one for
    # forward only (the cost model's pp > 1 branch); a unit on a one-rank data group reduces without gathering. The
    # first run gathers once more: the schedule's shape inference runs each stage's forward once.
    def per_run(name: str, rank: int) -> list[tuple[int, int]]:
        runs = results[rank][name]["fsdp_per_micro"]
        assert runs and runs[0][1] == runs[1][1] and runs[0][0] >= runs[1][0], (name, rank, runs)
        return runs[1:]
    for rank in range(4):
        # stage 0: one ZeRO-3 block over 2 ranks; stage 1: a tp=2 ZeRO-2 block on one-rank data groups
        want = (4, 2) if rank < 2 else (0, 2)
        assert per_run("sgd_foreach_pp2_zero3", rank) == [want] * (STEPS4 - 1), \
            per_run("sgd_foreach_pp2_zero3", rank)
        # MoE stage 1: ZeRO-2 over dp=2 for the dense part (gathers and reduces per micro-batch); its 2 experts per
        # rank sit on a one-rank expert-data group (ep=2 of dp=2), so they get no FSDP2 state of their own (nothing
        # to shard or reduce) and add no reductions (before: one unit each, 3 reductions per micro-batch)
        want = (0, 0) if rank < 2 else (2, 2)
        runs = per_run("moe_pp2_ep2", rank)
        assert runs and all(x == want for x in runs), ("moe_pp2_ep2", rank, runs)
    for name, _, _ in _cases_vocab_loss():
        # the loss really got vocab-sharded logits (every step; under pp only on the last stage's ranks)
        seen = [r[name]["sharded_seen"] for r in results]
        assert all(all(s) for s in seen) and sum(map(len, seen)) >= 2 * STEPS4, (name, seen)


def test_gradient_buckets_are_listed_in_backward_order_across_groups() -> None:
    """One process, no collectives: the bucket list (the launch order on every rank) follows backward across
    data groups. A MoE block registers its experts (own group) before its attention (the block's group); in
    flow order the experts come after the attention, so backward fills their bucket first. Group after
    group, or in registration order, the block's buckets would wait behind the embedding's / the experts'."""
    import torch

    from lightning_galv.parallel.data_parallel import GradientSync

    names = ["embed", "attn", "experts", "norm", "head"]  # forward flow order
    ps = {n: torch.nn.Parameter(torch.zeros(8)) for n in names}
    ends, block, expert = object(), object(), object()  # stand-ins for three process groups
    sync = GradientSync(divide_factor=2, bucket_bytes=1)  # one parameter per bucket
    sync.set_flow_order(ps[n] for n in names)
    sync.add([ps["embed"]], ends, 2)
    sync.add([ps["experts"]], expert, 2)  # registered first, as parallelize() does
    sync.add([ps["attn"], ps["norm"]], block, 2)
    sync.add([ps["head"]], ends, 2)
    order = [next(n for n in names if ps[n] is b.params[0]) for b in sync.buckets()]
    assert order == ["head", "norm", "experts", "attn", "embed"], order
    with pytest.raises(RuntimeError, match="HINT"):
        sync.set_flow_order(ps.values())
    fallback = GradientSync(divide_factor=2, bucket_bytes=1)  # without a flow order: registration order
    fallback.add([ps["embed"]], ends, 2)
    fallback.add([ps["attn"]], block, 2)
    fallback.add([ps["head"]], ends, 2)
    assert [b.params[0] for b in fallback.buckets()] == [ps["head"], ps["attn"], ps["embed"]]


def test_gradient_hooks_do_not_keep_a_finished_model_alive() -> None:
    """One process, no collectives. The overlap hooks live in C++ on the parameters, out of the garbage
    collector's sight, so a hook bound to the GradientSync made parameter -> hook -> sync -> parameter a cycle
    nothing freed: every finished Trainer kept its model, optimizer state, meshes and gloo threads (a launch of
    forty checks ended with a thousand threads). Once the sync is dropped it must be freed, and a backward
    through a parameter that outlived it must still run (the hook then does nothing)."""
    import gc
    import weakref

    import torch

    from lightning_galv.parallel.data_parallel import GradientSync

    p = torch.nn.Parameter(torch.ones(4))
    sync = GradientSync(divide_factor=2, bucket_bytes=1)
    sync.add([p], object(), 2)  # a stand-in group: no bucket launches, the sync is disabled below
    sync.overlap_backward()
    sync.enabled = False
    (p * 2).sum().backward()  # the hook runs (and returns at once: not enabled)
    ref = weakref.ref(sync)
    del sync
    gc.collect()
    assert ref() is None, "the parameter's gradient hook keeps the GradientSync alive"
    (p * 3).sum().backward()
    assert p.grad is not None and p.grad.tolist() == [5.0] * 4


@pytest.mark.distributed
def test_gradient_buckets_start_during_backward_and_sum_exactly() -> None:
    """4 ranks, ZeRO-0, 4 KiB buckets. Over all ranks: several buckets, every one launched from the gradient
    hooks inside backward (none left for sync to start), the gradients in flight are views of their bucket,
    and the synced gradients equal an explicit all-reduce mean of the local ones. With two data groups
    (embedding/head dp4, blocks dp2 x tp2): every block bucket is in flight before the embedding's gradient,
    the last of backward, arrives (launched group after group, none would be)."""
    results = run_distributed(CHECKS.replace("run_many", "grad_overlap_check"), 4, (), timeout=400)
    for res in results:
        r = res["uniform"]
        assert r["buckets"] >= 4 and r["launched_in_backward"] == r["buckets"], r
        assert r["in_flight"] > 0 and r["views"] == r["in_flight"], r  # no second copy of the gradients
        assert r["err"] < 1e-6, r
        r = res["groups"]
        assert r["others"] >= 2 and r["others_launched_at_embedding"] == r["others"], r
        assert r["launched_in_backward"] == r["buckets"], r


@pytest.mark.distributed
def test_vocab_parallel_loss_2_ranks() -> None:
    """Exact against F.cross_entropy for every option, and the saved activations of head + loss shrink:
    gathered, log-softmax keeps all N*V fp32 logits; vocab-parallel keeps an N*V/tp softmax slice plus
    what both modes save (head input N*h, the weight shard) and O(N) indices/masks."""
    results = run_distributed(CHECKS.replace("run_many", "vocab_loss_checks"), 2, (), timeout=300)
    for r in results:
        assert max(r["formula"].values()) < 1e-5, r["formula"]
        n, v, h, tp = r["tokens"], r["vocab"], r["hidden"], r["tp"]
        gathered, vpl = r["saved"]["gathered"], r["saved"]["vpl"]
        common = 4 * n * h + 4 * h * v // tp  # head input + local weight shard, saved either way
        assert gathered >= 4 * n * v, r["saved"]
        assert vpl <= 4 * n * v // tp + common + 64 * n, r["saved"]
        assert gathered - vpl >= 4 * n * v * (1 - 1 / tp) - 64 * n, r["saved"]


@pytest.mark.slow
@pytest.mark.distributed
def test_parity_8_ranks() -> None:
    _check(run_distributed(CHECKS, 8, (_cases8(),), timeout=900))


def test_random_cases_are_valid_and_varied() -> None:
    """The generator covers what the random parity tests claim to draw (a pure check, no processes)."""
    cases = random_cases(0, 4, 20) + random_cases(1, 8, 5)
    plans = [ParallelPlan.from_dict(p) for _, p, _ in cases]
    strategies = [s for p in plans for s in p.all_strategies()]
    assert {p.pp for p in plans} == {1, 2}
    assert {s.sp for s in strategies} == {"none", "megatron", "ulysses"}
    assert {s.zero for s in strategies} == {0, 1, 2, 3}
    assert any(s.checkpoint for s in strategies) and any(not s.tp_consecutive for s in strategies)
    assert any(p.embed.tp > 1 for p in plans) and any(p.head.tp > 1 for p in plans)
    assert any(s.zero >= 2 and s.dp == 1 and not s.ulysses for s in strategies)  # ZeRO over a one-rank data group
    assert {kw["accumulate"] for _, _, kw in cases} == {1, 2}
    assert {kw.get("clip_algorithm", "norm") for _, _, kw in cases if "clip" in kw} == {"norm", "value"}
    assert {kw["kind"] for _, _, kw in cases} == {"llama", "gpt2", "moe"}
    assert {s.ep for s in strategies} >= {1, 2, 4}
    assert {kw["dropout"] for _, _, kw in cases} == {0.0, 0.1}
    assert {kw["optimizer"] for _, _, kw in cases} == set(OPTIMIZERS)
    assert any(p.vocab_parallel_loss for p in plans) and any(p.head.tp > 1 and not p.vocab_parallel_loss for p in plans)
    assert len({n for n, _, _ in cases}) == len(cases)


@pytest.mark.slow
@pytest.mark.distributed
def test_parity_random_plans_4_ranks() -> None:
    """20 seeded random valid plans on 4 ranks, each equal to one process (losses, weights, clip norms)."""
    cases = random_cases(0, 4, 20)
    results = run_distributed(CHECKS, 4, (cases,), timeout=1200)
    _check(results)
    for name, plan, _ in cases:
        _check_fsdp_root(name, ParallelPlan.from_dict(plan), results)


@pytest.mark.slow
@pytest.mark.distributed
def test_parity_random_plans_8_ranks() -> None:
    _check(run_distributed(CHECKS, 8, (random_cases(1, 8, 5),), timeout=1200))


@pytest.mark.distributed
def test_a_closed_mesh_factory_frees_its_groups_and_a_new_one_works() -> None:
    """Profiles and benchmark plans build meshes for a temporary model; MeshFactory.close destroys the groups
    (an idle gloo group polls on in its own thread) and a later factory's equal meshes still work."""
    results = run_distributed(CHECKS.replace("run_many", "factory_close_check"), 2, (), timeout=300)
    expected = [[2.0 * (2 * i + j) for j in range(2)] for i in range(4)]
    for rank, res in enumerate(results):
        for round_, r in res.items():
            assert r["built"] >= 2 and r["left"] == 0, (rank, round_, r)
            assert r["threads_open"] >= r["built"] and r["threads_left"] <= 0, (rank, round_, r)
            assert r["full"] == expected and r["flat_sum"] == 3.0 and r["ep_sum"] == 3.0, (rank, round_, r)


@pytest.mark.distributed
def test_a_gradient_missing_on_some_ranks_is_reduced_onto_every_rank() -> None:
    """A parameter used on some ranks only (a model that skips an expert without tokens, a branch) gets the group's
    reduced gradient on every rank, so the replicas step alike (before, the ranks without it skipped it and
    drifted apart); one used nowhere keeps no gradient, as in one process."""
    results = run_distributed(CHECKS.replace("run_many", "unused_param_check"), 2, (), timeout=300)
    for rank, res in enumerate(results):
        for mode, r in res.items():
            assert r["a"] == [1.5] * 5, (rank, mode, r)  # mean of 1 and 2
            assert r["b"] == [1.5] * 5, (rank, mode, r)  # rank 0's 3, rank 1's none, over 2
            assert r["d"] == [2.5] * 5 and r["d_dtensor"], (rank, mode, r)  # rank 0's 5 over 2, still a DTensor
            assert r["c"] is None, (rank, mode, r)
