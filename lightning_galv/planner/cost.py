"""Time and memory of hybrid-parallel plans, from profiles (no torch, no processes).

:class:`CostModel` is the interface the search prices plans through; :class:`GalvatronCostModel` is the
Galvatron-style implementation (VLDB'23, refined in Galvatron-BMW, TKDE'24): a plan's step time is
built from per-layer costs, each layer's cost from its strategy, and the layers are glued together by
inter-layer transition costs and the pipeline schedule. ``planner/contract.py`` checks any
implementation against what the search assumes of it.

Every formula is a short function with a one-line comment naming the source it follows. Units are
seconds and bytes; ``mb`` is the number of samples in one pipeline micro-batch (the whole stage's),
``b = mb / dp`` the samples one rank sees.

Mixture-of-Experts layer types (``LayerTypeProfile.moe``) are priced with the runtime's expert
parallelism (``parallel/expert.py``): the measured block time already holds the expert compute (balanced
routing gives every EP rank tokens x top_k rows whatever ep is), so ep changes what moves between
ranks -- the dispatch / combine all-to-alls, the count exchange, the expert gradients' smaller group --
and where the expert states live (E/ep experts per rank, ZeRO over the expert-data group); when the
profile holds a fit of the block measured under ep (``tp1/none/ep<k>``, ShardedLayerProfiler), its
compute is that fit, which adds the dispatcher's own work.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from ..errors import bad_value
from ..plan import LayerStrategy, ModelShape, ParallelPlan, Prediction
from .profiles import (HardwareProfile, LayerTypeProfile, MoELayerFacts, ModelProfile, TimeFit, act_key,
                       parse_zero_key, transient_key)

# Bumped whenever a change moves the predictions of plans that were priced before. A ``Calibration`` records the
# version it was fitted against: its factors and memory slack absorb what that model got wrong, so applied to
# a model that now prices the same bytes or seconds itself they would count them twice (version 2: the
# embedding and head priced with FSDP2's own bytes, 7870610 -- a slack fitted before it covers those bytes;
# version 3: the native runtime's prefetched FSDP2 all-gathers priced as overlapped on inline backends;
# version 4: a checkpointed layer priced from its own timed variant, forward and recompute; version 5: a
# recompute repeats only the share of the forward's collectives the profiler counted; version 6: an MoE block's
# activations and recompute peak at the plan's ep where measured -- a slack fitted before covers those bytes;
# version 7: routed experts on a one-rank expert-data group pay no FSDP2 overhead -- the runtime stopped giving
# them FSDP2 states, so a factor fitted before absorbed work that no longer runs; version 8: an MoE block's FSDP2
# overhead from its measurement at the plan's ep, as the runtime wraps it, where the profile has one; version 9:
# a model whose replicated gradients fit fewer buckets than their bytes fill pays one whole all-reduce latency per
# bucket -- a collectives factor fitted before absorbed it).
COST_MODEL_VERSION = 9


# ---------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageContext:
    """Where a layer runs: its stage and the pipeline around it."""

    stage_size: int
    micro_batch: int  # samples per pipeline micro-batch
    micro_batches: int  # m
    pp: int = 1
    stage: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1

    @property
    def inflight(self) -> float:
        return inflight_microbatches(self.pp, self.stage, self.micro_batches, self.schedule, self.virtual_stages)


@dataclass(frozen=True)
class LayerCost:
    """One layer under one strategy: per-micro-batch times, per-step extra, memory."""

    fwd: float  # s per micro-batch, compute + exposed communication
    bwd: float  # s per micro-batch (includes recomputation)
    step_extra: float  # s per step: gradient sync not hidden by backward + optimizer step
    states: float  # bytes: parameters, gradients, optimizer states
    act: float  # bytes of activations kept per in-flight micro-batch
    transient: float = 0.0  # bytes briefly alive: a block's recompute / FSDP2 peak (the largest counts), the head's
    # FSDP2 bytes at the start of backward, the embedding's under a pipeline (stage_fixed adds them to the peak)
    in_backward: float = 0.0  # s per step of ``step_extra`` that runs inside the last micro-batch's backward (the
    # runtime's gradient hooks, and how much slower backward runs beside the gradient all-reduces it launched):
    # counted in step_extra, so no total changes; it only tells a measured phase split

    def step_time(self, m: int) -> float:
        return m * (self.fwd + self.bwd) + self.step_extra

    def memory(self, inflight: float) -> float:
        return self.states + inflight * self.act


@dataclass(frozen=True)
class PlanCost:
    """Prediction for a whole plan."""

    step_time_s: float
    stage_mb_time_s: tuple[float, ...]  # per micro-batch, per stage
    stage_extra_s: tuple[float, ...]  # per step, per stage
    stage_memory_bytes: tuple[float, ...]
    global_batch: int
    breakdown: Mapping[str, float] = field(default_factory=dict)
    # per stage, the part of stage_extra_s that runs inside the last backward (LayerCost.in_backward); () when the
    # model does not tell it
    stage_in_backward_s: tuple[float, ...] = ()

    def phases(self, stage: int, micro_batches: int) -> tuple[float, float]:
        """(forward + backward of all micro-batches, what follows the last backward) of ``stage``, the split a
        profiler of the running step measures: work the runtime does from backward's hooks (the bucket copies)
        moves from the per-step part to the first."""
        inside = self.stage_in_backward_s[stage] if self.stage_in_backward_s else 0.0
        return self.stage_mb_time_s[stage] * micro_batches + inside, self.stage_extra_s[stage] - inside

    @property
    def throughput(self) -> float:
        return self.global_batch / self.step_time_s

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.stage_memory_bytes)


class CostModel(ABC):
    """What the search asks of a cost model -- and all it asks.

    The search never prices a whole plan while it looks for one: it tabulates per-layer costs once
    per (stage size, micro-batch), glues layers together with transition costs, adds what a pipeline
    stage carries besides its blocks, and runs its layer DP and stage partition on those numbers. Only
    the plans it keeps are priced whole. Hence four parts to implement, and a whole-plan price that by
    default is assembled from them:

    * :meth:`layer_cost` -- the per-layer table the layer DP runs on.
    * :meth:`transition_time` -- the edge weights of the layer DP (re-laying out activations).
    * :meth:`end_cost` -- embedding and head alone, so the search can drop dominated end strategies
      before trying them on every stage.
    * :meth:`stage_fixed` -- the fixed part of one stage's time and memory (ends, pipeline sends,
      framework bytes): what is left of the budget for the layers. Unlike a layer's ``transient`` (only the
      largest counts), an end's is added in full: it is alive at the stage's peak.
    * :meth:`stage_sync_time` -- per-step gradient-sync cost of how a stage's parts share collectives (default
      none): what the parts cannot see alone.
    * :meth:`backward_freed` -- memory released before the blocks' backward, which a recomputing
      block can reuse (default: the head's activations on the last stage).
    * :meth:`boundary_time` -- re-layouts at a pipeline chunk's edges (embedding into the first block, the
      last block into the head; default free, as in Galvatron). The layer DP cannot see them; a model that
      prices them says so (:attr:`prices_boundaries`) and the search also weighs uniform plans priced with them.
    * :meth:`evaluate` -- the final price of a plan the search keeps; :meth:`predict` attaches it.

    An implementation that re-prices the parts (the tuner's calibrated model will wrap another model
    and scale its times by measured factors) inherits :meth:`evaluate` and so stays consistent with
    what the search optimized; one with its own whole-plan formula (a Galvatron-2.4-compatible model)
    overrides it. The search assumes, and :func:`lightning_galv.planner.contract.check_cost_model`
    checks, that:

    * ``layer_cost`` depends on ``layer`` only through the profile's layer type, and on ``ctx`` only
      through ``stage_size``, ``micro_batch`` and :meth:`context_key` (one table serves every pipeline
      position and every micro-batch count of equal key); ``end_cost`` depends on ``ctx`` the same way;
    * ``transition_time`` depends on its strategies only through :func:`batch_layout` and is 0 when
      the layouts are equal (the search prices one transition per pair of layouts);
    * ``stage_fixed`` does not get better when an end's ``end_cost`` gets worse at the same dp
      (dominated end strategies can be dropped), and with a pipeline it sees only the ends on its
      stage -- a middle stage only the embedding's dp, which sizes its boundary sends;
    * ``backward_freed`` is 0 without the head and at most the head's activations;
    * ``stage_sync_time`` is never negative;
    * ``evaluate`` of a plan equals the sums of its parts per stage, and its step time is never
      below the pipeline formula (:func:`pipeline_time`) of those stages -- the search's bounds
      and partition assume it -- unless the model declares ``step_time_vs_pipeline = "at_most"``
      (its own whole-plan formula, never above that objective: Galvatron 2.4's);
    * ``admits`` says which (stage size, micro-batch) pairs the model prices at all.
    """

    @abstractmethod
    def layer_cost(self, layer: int, s: LayerStrategy, ctx: StageContext) -> LayerCost:
        """Cost of transformer block ``layer`` under strategy ``s`` in context ``ctx``."""

    @abstractmethod
    def transition_time(self, a: LayerStrategy, b: LayerStrategy, ctx: StageContext) -> float:
        """Seconds per micro-batch (fwd + bwd) to re-layout activations between layers ``a`` -> ``b``."""

    @abstractmethod
    def end_cost(self, s: LayerStrategy, ctx: StageContext, first: bool, last: bool,
                 vocab_parallel_loss: bool = False) -> LayerCost:
        """The embedding (``first``) and/or the final norm + output projection + loss (``last``) under
        ``s``; a tp > 1 head computes the loss on vocab-sharded logits if ``vocab_parallel_loss``."""

    @abstractmethod
    def stage_fixed(self, plan_embed: LayerStrategy, plan_head: LayerStrategy, ctx: StageContext,
                    vocab_parallel_loss: bool = False) -> tuple[float, float, float]:
        """(seconds per micro-batch, seconds per step, bytes) of everything on stage ``ctx.stage`` that is
        not a transformer block: the ends it holds, its pipeline sends, the framework's own memory."""

    #: How :meth:`evaluate`'s step time relates to :func:`pipeline_time` of the stages' parts, the objective the
    #: search's bounds and partition optimize: ``"at_least"`` (the default assembly) -- the bounds are valid and
    #: the search never overrates a plan; ``"at_most"`` -- the model's own formula is never worse than that
    #: objective (Galvatron 2.4's, whose bubble counts only the first and the last stage), so a returned plan
    #: is priced no worse than the search saw it, but bound pruning is a heuristic for it.
    step_time_vs_pipeline: str = "at_least"
    #: The one world size the model prices plans for (a model whose hardware coefficients are keyed by group
    #: sizes, like Galvatron's); None: any.
    world_size: int | None = None

    def context_key(self, ctx: StageContext) -> tuple:
        """What, beyond stage size and micro-batch, of the pipeline configuration a layer's (and an end's) cost
        depends on -- the search builds one cost table per (stage size, micro-batch, key). Default: nothing, one
        table serves every pipeline position and micro-batch count."""
        return ()

    def admits(self, stage_size: int, micro_batch: int) -> bool:
        """Whether the model prices stages of ``stage_size`` ranks at ``micro_batch`` samples at all; the
        search skips the (pipeline degree, micro-batch) pairs it does not (default: every pair). Galvatron's
        model, for one, is defined only where its micro-batches split evenly over its min_tp-wide groups."""
        return True

    def chunk_boundary_time(self, plan: ParallelPlan, chunk: int, ctx: StageContext) -> float:
        """Seconds per micro-batch (fwd + bwd) to re-lay-out activations at the edges of pipeline chunk
        ``chunk``: into its first block from the embedding (later chunks: from the data loader's layout,
        in which activations cross stages) and out of its last block into the head (earlier chunks: back
        to that layout) -- :meth:`boundary_time` of those four strategies."""
        layers = plan.stage_layers(chunk)
        if not len(layers):
            return 0.0
        assert plan.embed is not None and plan.head is not None
        entry, exit_ = chunk_ends(chunk, plan.pp * plan.virtual_stages, plan.embed, plan.head,
                                  data_strategy(plan.stage_size, plan.data_parallel_size))
        return self.boundary_time(entry, plan.layers[layers[0]], plan.layers[layers[-1]], exit_, ctx)

    def boundary_time(self, entry: LayerStrategy, first: LayerStrategy, last: LayerStrategy, exit_: LayerStrategy,
                      ctx: StageContext) -> float:
        """Seconds per micro-batch to re-lay-out from ``entry`` into a chunk whose blocks start at ``first``
        and end at ``last``, and from there to ``exit_``. Default: free, as in Galvatron, whose transitions
        are only between blocks."""
        return 0.0

    @property
    def prices_boundaries(self) -> bool:
        """Whether :meth:`boundary_time` can be non-zero (the search then also weighs uniform plans priced
        with it, which its layer DP cannot see)."""
        return False

    def stage_sync_time(self, plan: ParallelPlan, stage: int, ctx: StageContext) -> float:
        """Seconds per step that stage ``stage``'s gradient synchronisation costs beyond what its layers and ends
        price each on its own: a cost of how they share collectives, which no part sees alone (the layer DP does
        not either; plans are priced with it once found). Default: none. Never negative, so the search's bounds
        stay bounds."""
        return 0.0

    def backward_freed(self, plan_head: LayerStrategy, ctx: StageContext, vocab_parallel_loss: bool = False) -> float:
        """Bytes of the head's activations (logits, loss) of one micro-batch, freed before any block runs
        its backward -- so a checkpointed block's recompute peak does not stack on top of them."""
        if ctx.stage != ctx.pp - 1:
            return 0.0
        return self.end_cost(plan_head, ctx, False, True, vocab_parallel_loss).act

    def evaluate(self, plan: ParallelPlan) -> PlanCost:
        """Predicted step time and per-stage peak memory of a complete plan, assembled from the parts:
        per stage the fixed part plus its layers (model order within each chunk) and the transitions
        between unequal neighbours; memory adds the largest recompute transient not covered by
        :meth:`backward_freed`; the stages combine by :func:`pipeline_time`."""
        if plan.global_batch is None:
            raise bad_value("global_batch=None", "the cost of a plan depends on its global batch",
                            "set plan.global_batch (e.g. plan.with_(global_batch=64)).")
        m = plan.micro_batches
        mb = plan.global_batch // m
        v = plan.virtual_stages
        assert plan.embed is not None and plan.head is not None
        mb_times, extras, mems = [], [], []
        breakdown = {"compute_and_comm": 0.0, "transitions": 0.0, "other": 0.0}
        for st in range(plan.pp):
            ctx = StageContext(plan.stage_size, mb, m, plan.pp, st, plan.pipeline_schedule, v)
            inflight = ctx.inflight
            vpl = plan.vocab_parallel_loss
            t, e, mem = self.stage_fixed(plan.embed, plan.head, ctx, vpl)
            e += self.stage_sync_time(plan, st, ctx)
            breakdown["other"] += t
            transient = 0.0
            for chunk in range(st, plan.pp * v, plan.pp):  # this stage's chunks, layers in model order
                edges = self.chunk_boundary_time(plan, chunk, ctx)
                t += edges
                breakdown["transitions"] += edges
                prev: LayerStrategy | None = None
                for i in plan.stage_layers(chunk):
                    s = plan.layers[i]
                    c = self.layer_cost(i, s, ctx)
                    t += c.fwd + c.bwd
                    breakdown["compute_and_comm"] += c.fwd + c.bwd
                    e += c.step_extra
                    mem += c.memory(inflight)
                    transient = max(transient, c.transient)
                    if prev is not None and prev != s:  # equal strategies never re-layout
                        tr = self.transition_time(prev, s, ctx)
                        t += tr
                        breakdown["transitions"] += tr
                    prev = s
            mb_times.append(t)
            extras.append(e)
            mems.append(mem + max(0.0, transient - self.backward_freed(plan.head, ctx, vpl)))
        step = pipeline_time(mb_times, extras, m, v)
        return PlanCost(step, tuple(mb_times), tuple(extras), tuple(mems), plan.global_batch, breakdown)

    def predict(self, plan: ParallelPlan) -> ParallelPlan:
        """The plan with its ``prediction`` filled in from :meth:`evaluate`."""
        c = self.evaluate(plan)
        return plan.with_(prediction=Prediction(c.step_time_s, c.throughput, c.stage_memory_bytes))


# ---------------------------------------------------------------------------------------------------
# formulas
# ---------------------------------------------------------------------------------------------------
# Mixed-precision Adam keeps 2 (param) + 2 (grad) + 12 (fp32 master, momentum, variance) bytes per
# parameter; plain fp32 keeps 4 + 4 + 8 (ZeRO, Rajbhandari et al. SC'20, Sec. 3.1).
STATE_BYTES = {"mixed": (2.0, 2.0, 12.0), "fp32": (4.0, 4.0, 8.0)}
# The optimizer step reads master weights, both moments and the gradient and writes three of them back
# plus the 16-bit copy: about 28 bytes of memory traffic per parameter (memory-bound update).
OPTIMIZER_TRAFFIC_BYTES = 28.0


def state_bytes_per_param(zero: int, d: int, precision: str) -> float:
    """Bytes of model states per parameter under ZeRO stage ``zero`` over ``d`` ranks (ZeRO SC'20, Fig. 1)."""
    p, g, o = STATE_BYTES["fp32" if precision == "fp32" else "mixed"]
    if zero == 0:
        return p + g + o
    if zero == 1:
        return p + g + o / d
    if zero == 2:
        return p + (g + o) / d
    return (p + g + o) / d


def dtensor_step_overhead(lt: LayerTypeProfile, s: LayerStrategy, d: int) -> float:
    """Seconds the optimizer step of layer ``lt`` adds under ``s`` because the native runtime keeps its
    parameters as DTensors (tensor parallel, or FSDP2 for ZeRO-2/3 over more than one rank): measured per
    layer type (``LayerTypeProfile.optimizer_overhead``); both at once are charged once, at the larger."""
    keys = (["tp"] if s.tensor_parallel > 1 else []) + (["zero"] if s.zero >= 2 and d > 1 else [])
    over = {k: lt.optimizer_overhead.get(k, 0.0) for k in keys}
    if lt.moe is not None and "zero" in over and d // s.ep == 1:
        # the routed experts stay plain tensors: FSDP2 does not shard over a one-rank expert-data group
        over["zero"] *= 1.0 - lt.moe.expert_tensor_share
    return max(over.values(), default=0.0)


def inflight_microbatches(pp: int, stage: int, m: int, schedule: str, v: int = 1) -> float:
    """Micro-batches whose activations a stage holds at peak (Narayanan SC'21; Korthikanti '22 Sec. 4.2.3)."""
    if pp == 1:
        return 1.0  # gradient accumulation runs one micro-batch at a time
    if schedule == "gpipe":
        return float(m)  # all forwards before any backward
    if schedule == "1f1b":
        return float(min(m, pp - stage))  # warm-up depth of stage i
    # interleaved: (2(p-i-1) + (v-1)p + 1) chunk-forwards in warm-up, each 1/v of the stage's layers
    return float(min(m, (2 * (pp - stage - 1) + (v - 1) * pp + 1) / v))


def overlapped(compute: float, comm: float, slowdown: float) -> float:
    """Compute and communication run concurrently, both slowed by ``slowdown`` while overlapped (Galvatron VLDB'23, Sec. 3.3)."""
    return max(compute, comm) + (slowdown - 1.0) * min(compute, comm)


def overlap_slowdown_from(compute: float, comm: float, both: float) -> float:
    """The ``slowdown`` for which :func:`overlapped` gives the measured ``both`` (its inverse; at least 1: perfect
    overlap, 2: serial, above 2: contention worse than serial)."""
    lo = min(compute, comm)
    return max(1.0, 1.0 + (both - max(compute, comm)) / lo) if lo > 0 else 1.0


def pipeline_time(stage_mb: list[float], stage_extra: list[float], m: int, v: int = 1) -> float:
    """Step time of a pipeline with per-stage micro-batch times: bubble (p-1)/v stage-times (Narayanan SC'21, Sec. 2.2)."""
    slowest = max(stage_mb)
    return m * slowest + (sum(stage_mb) - slowest) / v + max(stage_extra)


def sharded_compute(fit_const: float, fit_total: float, ways: int) -> float:
    """Tensor/sequence parallel ranks each do 1/ways of the math; launch overhead is not shared (Megatron-LM SC'21)."""
    return fit_const + (fit_total - fit_const) / ways


def megatron_tp_comm(hw: HardwareProfile, nbytes: float, tp: int, stride: int, n_allreduce: int) -> float:
    """``n_allreduce`` all-reduces of the layer activations over the tp group: 2 fwd + 2 bwd per block (Megatron-LM SC'19/SC'21)."""
    return n_allreduce * hw.collective_time("allreduce", nbytes, tp, stride)


def megatron_sp_comm(hw: HardwareProfile, nbytes: float, tp: int, stride: int, n_allreduce: int) -> float:
    """Sequence parallelism turns each all-reduce into all-gather + reduce-scatter, same volume (Korthikanti '22, Sec. 4.2.2)."""
    return n_allreduce * (hw.collective_time("allgather", nbytes, tp, stride)
                          + hw.collective_time("reducescatter", nbytes, tp, stride))


def ulysses_comm(hw: HardwareProfile, nbytes: float, sp: int, stride: int, kv_ratio: float, passes: int) -> float:
    """q, k, v in and the output back by all-to-all, each 1/sp of the activations per rank (DeepSpeed-Ulysses '23, Sec. 3)."""
    per_pass = (2.0 + 2.0 * kv_ratio) * hw.collective_time("alltoall", nbytes / sp, sp, stride)
    return passes * per_pass


def block_comm_time(hw: HardwareProfile, shape: ModelShape, s: LayerStrategy, act_bytes: float,
                    moe: MoELayerFacts | None = None) -> float:
    """Collectives of one forward pass of a block under ``s`` (the backward mirrors them): tp/sp only;
    ``moe``: the block's feed-forward is that MoE layer, replicated over tp (:func:`moe_block_tp_comm`)."""
    t = s.tp
    if t == 1:
        return 0.0
    stride = 1 if s.tp_consecutive else s.dp
    if moe is not None and not s.ulysses:
        return moe_block_tp_comm(hw, act_bytes, t, stride, s.sp == "megatron")
    if s.sp == "none":
        return megatron_tp_comm(hw, act_bytes, t, stride, 2)
    if s.sp == "megatron":
        return megatron_sp_comm(hw, act_bytes, t, stride, 2)
    return ulysses_comm(hw, act_bytes, t, stride, shape.num_kv_heads / shape.num_heads, 1)


def moe_block_tp_comm(hw: HardwareProfile, nbytes: float, tp: int, stride: int, megatron_sp: bool) -> float:
    """An MoE block's tp collectives per forward: attention's half of a dense block's, and nothing for the MoE layer, which runs replicated on the full tokens -- but under Megatron-SP its input chunk is all-gathered (its output slice is free) (Megatron-LM MoE with expert tensor parallelism 1; Korthikanti '22 for attention)."""
    if megatron_sp:
        return megatron_sp_comm(hw, nbytes, tp, stride, 1) + hw.collective_time("allgather", nbytes, tp, stride)
    return megatron_tp_comm(hw, nbytes, tp, stride, 1)


def moe_compute_share(lt: LayerTypeProfile) -> float:
    """Share of an MoE block's per-token FLOPs in its MoE layer: 2 FLOPs per weight a token passes through -- router, top_k experts, shared expert -- against the block's other weights (Kaplan et al. '20, C = 2N per token; Fedus et al. JMLR'22 for sparse layers)."""
    assert lt.moe is not None
    dense = max(0, lt.params - lt.moe.params)
    active = lt.moe.active_params
    return active / (dense + active) if dense + active > 0 else 0.0


def moe_sharded_compute(fit_const: float, per_token: float, ctx_term: float, tp: int, share: float) -> float:
    """Per-rank time of an MoE block under tp (TP / Megatron-SP): attention's math splits over tp, the replicated MoE layer's does not, launch overhead is not shared (Megatron-LM SC'21; parallel/tensor.py "replicated")."""
    return fit_const + per_token * (share + (1.0 - share) / tp) + ctx_term / tp


def moe_block_activation(lt: LayerTypeProfile, tp: int, sp: str, checkpoint: bool, seq: int, el: int) -> float:
    """Bytes per local sample of an MoE block: measured when profiled at (tp, sp); else the MoE layer's share (MoELayerFacts.saved_bytes_per_token) stays whole under TP and Megatron-SP -- it holds the full sequence -- and is split by Ulysses, while the rest shrinks by the dense rule (Korthikanti et al. '22, Table 2)."""
    if lt.moe is None or checkpoint or tp == 1 or act_key(tp, sp, False) in lt.activation_bytes:
        return lt.activation(tp, sp, checkpoint)
    full = lt.activation_bytes[act_key(1, "none", False)]
    moe = min(full, seq * lt.moe.saved_bytes_per_token(el))
    rest = (full - moe) * (lt.activation(tp, sp, False) / full) if full > 0 else 0.0
    return rest + (moe / tp if sp == "ulysses" else moe)


def expert_local_params(moe: MoELayerFacts, ep: int) -> float:
    """Routed-expert parameters one rank holds: E/ep whole experts (GShard, Lepikhin et al. ICLR'21, Sec. 2.2; DeepSpeed-MoE, Rajbhandari et al. ICML'22, Sec. 4.1)."""
    return moe.routed_params / ep


def fsdp_managed_params(lt: LayerTypeProfile, tp: int, ep: int, edp: int) -> float:
    """Parameters of one rank's share of the layer that FSDP2 states manage under ZeRO-2/3 in the native
    runtime: the whole layer (split by tp); for an MoE block at ep > 1 the dense part, plus the local experts
    only when their expert-data group has two or more ranks (else they stay plain, parallel/parallelize.py)."""
    moe = lt.moe
    if moe is None:
        return lt.params / tp
    dense = (lt.params - moe.params) / tp + moe.shared_params + moe.router_params  # router, shared: tp-replicated
    return dense + (expert_local_params(moe, ep) if ep == 1 or edp > 1 else 0.0)


def zero_overhead_entry(lt: LayerTypeProfile, zero: int, tp: int, ep: int, edp: int
                        ) -> tuple[Mapping[str, TimeFit], float] | None:
    """The measured FSDP2 overhead (``LayerTypeProfile.zero_overhead``) that best matches a ZeRO-``zero`` layer
    at (tp, ep, expert-data degree edp), and the factor to scale it by: this rank's FSDP2-managed parameters over
    those of the measured layout (:func:`fsdp_managed_params`); None when none was measured.

    Why per ep: much of FSDP2's work is per unit and per tensor (hooks, one copy-in/out per parameter), not per
    byte. Scaling the whole block's overhead down to the dense part left when experts stay plain priced a
    4-rank ep4·zero3 MoE decoder's forward + backward 16 % low (143 vs 171 ms, costmodel_accuracy.py --model moe
    at bbec4f1). So an MoE block at ep > 1 takes the entry measured at its own ep with the same expert wrapping
    (experts plain, or FSDP2 units of their own); otherwise the whole block's, scaled by bytes as before."""
    over = lt.zero_overhead
    if ep > 1:
        for key, fits in over.items():
            z, e, d = parse_zero_key(key)  # type: ignore[misc]  # validated by LayerTypeProfile
            if z == zero and e == ep and (d > 1) == (edp > 1):
                return fits, fsdp_managed_params(lt, tp, ep, edp) / fsdp_managed_params(lt, 1, e, d)
    fits = over.get(f"zero{zero}")
    if fits is None:
        return None
    return fits, fsdp_managed_params(lt, tp, ep, edp) / lt.params


def ep_alltoall_bytes(tokens: float, moe: MoELayerFacts, el: int) -> float:
    """Bytes a rank puts into one dispatch (or combine) all-to-all: every routed copy of its tokens, tokens x top_k rows of dim (GShard Sec. 2.2; DeepSpeed-MoE Sec. 4.1); (ep-1)/ep of it leaves the rank when routing is balanced."""
    return tokens * moe.top_k * moe.dim * el


def ep_forward_comm(hw: HardwareProfile, a2a_bytes: float, num_experts: int, ep: int, stride: int) -> float:
    """One MoE forward under ep: all-gather of the ep x E int64 expert counts (the uneven split sizes), then dispatch and combine all-to-alls, all on the critical path -- experts wait for their tokens (Megatron-LM all-to-all token dispatcher; NetMoE, Liu et al. ICLR'25: all-to-all dominates MoE training time)."""
    return hw.collective_time("allgather", 8.0 * num_experts * ep, ep, stride) + \
        2.0 * hw.collective_time("alltoall", a2a_bytes, ep, stride)


def ep_backward_comm(hw: HardwareProfile, a2a_bytes: float, ep: int, stride: int) -> float:
    """One MoE backward under ep: the gradients of combine and dispatch travel back by two all-to-alls of the same size (DeepSpeed-MoE Sec. 4.1; parallel/expert.py _AllToAll)."""
    return 2.0 * hw.collective_time("alltoall", a2a_bytes, ep, stride)


def ep_skew_time(moe: MoELayerFacts, tokens: float, ep: int, matmul_flops: float) -> tuple[float, float]:
    """(forward, backward) seconds the busiest rank of an EP group spends on experts beyond a balanced rank: its
    (skew - 1) x mean routed copies (tokens x top_k) through one expert's weights at the profiled matmul rate, 2
    FLOPs per weight forward and 4 backward (Kaplan et al. '20); the group waits for it in the combine all-to-all
    (Lepikhin et al. ICLR'21 Sec. 2.2; the imbalance LAER-MoE re-lays experts against). 0 when balanced or the
    matmul rate was not measured."""
    skew = moe.skew(ep)
    if skew <= 1.0 or matmul_flops <= 0:
        return 0.0, 0.0
    flops = (skew - 1.0) * tokens * moe.top_k * moe.expert_params
    return 2.0 * flops / matmul_flops, 4.0 * flops / matmul_flops


def router_stats_time(hw: HardwareProfile, num_experts: int, d: int, stride: int) -> float:
    """Per MoE forward, with or without ep: one all-reduce of 2(E+1) float64 (counts, token count, probability
    and z sums) over the data group, so the balancing loss is the global batch's (Switch, Fedus et al. JMLR'22,
    eq. 4; parallel/expert.py GlobalRouterStats) -- latency-bound. It starts after routing and is waited for
    after the experts, so it mostly hides; priced whole, as if exposed (a fraction of a millisecond)."""
    return hw.collective_time("allreduce", 16.0 * (num_experts + 1), d, stride)


def moe_layer_comm(hw: HardwareProfile, lt: LayerTypeProfile, s: LayerStrategy, b: float, seq: int, el: int,
                   stride: int) -> tuple[float, float]:
    """(forward, backward) seconds of an MoE layer's own collectives per micro-batch on ``b`` local samples:
    router statistics over the data group, and under ep the count exchange and the four all-to-alls of the
    tokens entering this rank's MoE layer (a Ulysses rank holds 1/tp of the sequence); (0, 0) for a dense layer."""
    moe = lt.moe
    if moe is None:
        return 0.0, 0.0
    fwd = router_stats_time(hw, moe.num_experts, s.data_group, stride)
    if s.ep == 1:
        return fwd, 0.0
    tokens = b * seq / (s.tp if s.ulysses else 1)
    nbytes = ep_alltoall_bytes(tokens, moe, el)
    return fwd + ep_forward_comm(hw, nbytes, moe.num_experts, s.ep, stride), ep_backward_comm(hw, nbytes, s.ep, stride)


def layer_compute(lt: LayerTypeProfile, kind: str, s: LayerStrategy, b: float, seq: int) -> float:
    """Per-rank compute of one ``"forward"`` / ``"backward"`` / ``"recompute"`` pass of a layer under ``s``: the
    measured sharded fit if profiled, else the unsharded fit divided by tp (:func:`sharded_compute`; an MoE
    layer's own share undivided under TP / Megatron-SP, :func:`moe_sharded_compute`).

    A checkpointed layer (``s.checkpoint``) takes the fits of its checkpointed variant where it was timed: its
    forward, and as the recompute what its backward takes beyond the plain one (non-reentrant checkpointing
    skips the ops after the last saved tensor: a sharded block's recompute ran 64-90 % of its forward on 2-4
    CPU ranks); else a recompute costs one more forward (Chen et al. 2016, sublinear memory)."""
    sp = s.sp if s.tp > 1 else "none"
    if s.checkpoint and kind in ("forward", "recompute"):
        ck = lt.sharded_fit("checkpoint_forward" if kind == "forward" else "recompute", s.tp, sp, s.ep)
        if ck is not None:
            # a checkpointed forward runs the same math as the plain one: never priced below it (fitted apart
            # from few batch sizes, the two can cross where extrapolated, and the search would then pick
            # checkpointing for speed)
            plain = lt.sharded_fit("forward", s.tp, sp, s.ep)
            return max(ck(b, seq), plain(b, seq)) if kind == "forward" and plain is not None else ck(b, seq)
    fit = lt.sharded_fit("forward" if kind == "recompute" else kind, s.tp, sp, s.ep)
    if fit is not None:
        return fit(b, seq)
    full = {"forward": lt.forward, "backward": lt.backward, "recompute": lt.recompute_fit()}[kind]
    if lt.moe is not None and s.tp > 1 and not s.ulysses:  # the MoE layer is replicated over tp
        return moe_sharded_compute(full.const, full.per_token * b * seq, full.per_token_ctx * b * seq * seq,
                                   s.tp, moe_compute_share(lt))
    return sharded_compute(full.const, full(b, seq), s.tp)


def recompute_comm_share(lt: LayerTypeProfile, s: LayerStrategy) -> float:
    """Share of a layer's forward collectives its recompute repeats: 0 unless checkpointed; measured per
    variant (non-reentrant checkpointing stops at the last tensor the backward needs, so a block's closing
    row-parallel collective is skipped: 1/2 of a Megatron-TP block's all-reduces, 3/4 of a Megatron-SP block's
    collectives on 2-4 CPU ranks), else all of them (Chen et al. 2016, sublinear memory: one more forward)."""
    if not s.checkpoint:
        return 0.0
    return lt.recompute_comm_share(s.tp, s.sp if s.tp > 1 else "none", s.ep)


def vocab_parallel_head(hw: HardwareProfile, logit_bytes: float, tokens: float, tp: int, stride: int,
                        vocab_parallel_loss: bool) -> tuple[float, float]:
    """(forward seconds, share of the logits a rank saves) of a tp-way head: vocab-parallel loss = MAX all-reduce of b*s fp32 maxima + SUM all-reduce of 2*b*s fp32 (sum-exp, target logit), logits /tp; else an all-gather of the full logits (Megatron-LM, Shoeybi et al. 2019, vocab-parallel cross entropy)."""
    if tp == 1:
        return 0.0, 1.0
    if vocab_parallel_loss:
        return (hw.collective_time("allreduce", 4.0 * tokens, tp, stride)
                + hw.collective_time("allreduce", 8.0 * tokens, tp, stride)), 1.0 / tp
    return hw.collective_time("allgather", logit_bytes, tp, stride), 1.0


def vocab_parallel_embedding_comm(hw: HardwareProfile, act_bytes: float, tp: int, stride: int) -> float:
    """A tp-way vocab-parallel embedding: each rank looks up the tokens of its vocabulary slice (zeros
    elsewhere), then one all-reduce of the [b, s, h] output sums the slices; the backward needs none
    (Megatron-LM, Shoeybi et al. 2019, VocabParallelEmbedding; parallel/tensor.py RowwiseParallel)."""
    return hw.collective_time("allreduce", act_bytes, tp, stride) if tp > 1 else 0.0


def bucket_copy_time(grad_bytes: float, memory_bandwidth: float) -> float:
    """Flatten gradients into their all-reduce bucket and scale it: 2 reads + 2 writes; the gradients then are
    views of the bucket, so nothing is copied back (DDP's gradient_as_bucket_view, Li et al. VLDB'20, Sec. 3.2.3).
    The flatten half runs in backward when the all-reduces overlap it (:func:`bucket_copy_in_backward`)."""
    return 4.0 * grad_bytes / memory_bandwidth if memory_bandwidth > 0 else 0.0


def bucket_copy_in_backward(grad_bytes: float, memory_bandwidth: float, overlap_sync: bool) -> float:
    """The part of :func:`bucket_copy_time` that runs inside the syncing backward: with the all-reduces overlapped
    (no pipeline), each gradient is moved into its bucket (1 read + 1 write) by a hook as autograd finishes it, and
    only the scaling waits until after backward; under a pipeline both run after the schedule (DDP's
    gradient-ready hooks, Li et al. VLDB'20, Sec. 3.2.3; parallel.data_parallel.GradientSync)."""
    return bucket_copy_time(grad_bytes, memory_bandwidth) / 2.0 if overlap_sync else 0.0


#: Gradients of replicated (ZeRO-0/1) parameters are all-reduced in buckets of about this many bytes (DDP's
#: default ``bucket_cap_mb``; the runtime's ``parallel.data_parallel.GradientSync`` uses the same constant).
GRAD_BUCKET_BYTES = 25 * 2**20


def bucketed_allreduce_time(hw: HardwareProfile, grad_bytes: float, d: int, stride: int,
                            bucket_bytes: float = GRAD_BUCKET_BYTES, stage_bytes: float | None = None) -> float:
    """A layer's share of bucketed gradient all-reduces: the bandwidth term of its bytes and its share of the
    buckets' latencies, one per bucket (DDP, Li et al. VLDB'20, Sec. 3.2.3: small gradients share a bucket's
    collective). ``stage_bytes``: the gradients all buckets of the group hold, ``ceil(stage_bytes /
    bucket_bytes)`` buckets shared by bytes -- a model smaller than one bucket still pays one whole latency
    (at 4 gloo ranks on 2 cores that is ~2-5 ms); None: full buckets, one latency per ``bucket_bytes``."""
    if d <= 1 or grad_bytes <= 0:
        return 0.0
    latency = hw.link("allreduce", d, stride == 1, hw.is_intra_node(d, stride)).latency_s
    return (hw.collective_time("allreduce", grad_bytes, d, stride) - latency
            + bucket_latency(hw, grad_bytes, d, stride, bucket_bytes, stage_bytes))


def block_dp_stride(s: LayerStrategy) -> int:
    """Rank spacing of a block's data group: its tp degree when consecutive ranks form the tp groups (not under
    Ulysses, whose data group spans the sequence ranks too)."""
    return 1 if (s.ulysses or s.tp == 1 or not s.tp_consecutive) else s.tp


def end_dp_stride(s: LayerStrategy) -> int:
    """Rank spacing of an end's (embedding's, head's) data group: as a block's, for its vocab-parallel tp."""
    return s.tp if (s.tp_consecutive and s.tp > 1) else 1


def bucket_latency(hw: HardwareProfile, grad_bytes: float, d: int, stride: int,
                   bucket_bytes: float = GRAD_BUCKET_BYTES, stage_bytes: float | None = None) -> float:
    """The latency part of :func:`bucketed_allreduce_time`: the buckets' latencies shared by bytes."""
    if d <= 1 or grad_bytes <= 0:
        return 0.0
    latency = hw.link("allreduce", d, stride == 1, hw.is_intra_node(d, stride)).latency_s
    if stage_bytes is None or stage_bytes <= 0:
        return latency * grad_bytes / bucket_bytes
    return latency * math.ceil(stage_bytes / bucket_bytes) * grad_bytes / stage_bytes


def bucketed_sync_exposed(bwd: float, comm: float, layers: int, layer_bytes: float, slowdown: float,
                          latency: float = 0.0, bucket_bytes: float = GRAD_BUCKET_BYTES) -> float:
    """Per layer: what bucketed gradient all-reduces launched during the last backward add to it -- the sum of
    :func:`bucketed_sync_split`'s two parts."""
    return sum(bucketed_sync_split(bwd, comm, layers, layer_bytes, slowdown, latency, bucket_bytes))


@functools.lru_cache(maxsize=1 << 16)  # a search prices the same layer in the same group many times: a model of many
# gigabytes fills thousands of buckets, and the loop below walks each (pure: its floats decide the answer)
def bucketed_sync_split(bwd: float, comm: float, layers: int, layer_bytes: float, slowdown: float,
                        latency: float = 0.0, bucket_bytes: float = GRAD_BUCKET_BYTES) -> tuple[float, float]:
    """Per layer: (how much longer the last backward runs beside its all-reduces, what they take after it ends),
    the time bucketed gradient all-reduces launched during the last backward add to it, for a stage of
    ``layers`` layers like this one (``bwd`` its backward compute, ``comm`` its share of the all-reduces, of which
    ``latency`` is latency, ``layer_bytes`` its gradients).

    Why a small simulation and not a share: buckets fill in backward order, ``bucket_bytes`` each and the
    remainder last (the first layers' gradients come last), and a bucket's all-reduce starts when it is full
    and the one before it is done (one queue per group, DDP, Li et al. VLDB'20, Sec. 3.2.3). So what waits for
    the end of backward is the remainder bucket plus whatever earlier buckets still queue: a stage just over one
    bucket fills its big bucket late and may hide little of it, one of many buckets hides all but the small last
    one. The share of a full bucket, priced before, charged a 31 MB stage (one 25 MiB bucket + 6 MB) 0.81 of
    its all-reduce after backward where 0.19 plus what the big one's overlap leaves is right. Gradients are
    taken to arrive in proportion to backward compute; while an all-reduce and backward overlap, both run
    ``slowdown`` times slower (:func:`overlapped`). Why two parts: a profiler of the running step sees the first
    inside backward and only the second after it (``LayerCost.in_backward``)."""
    if comm <= 0 or layers <= 0:
        return 0.0, 0.0
    total = max(layer_bytes * layers, 1.0)
    buckets = max(1, math.ceil(total / bucket_bytes))
    sizes = [bucket_bytes] * (buckets - 1) + [total - bucket_bytes * (buckets - 1)]  # in backward order
    compute, lat, traffic = bwd * layers, latency * layers, (comm - latency) * layers
    ready, work, filled = [], [], 0.0
    for size in sizes:
        filled += size
        ready.append(compute * min(1.0, filled / total))  # backward done when this bucket is full
        work.append(lat / buckets + traffic * size / total)
    t = done = 0.0  # wall clock, backward compute done
    ended: float | None = None  # wall clock when backward ended
    running: float | None = None  # the all-reduce in flight: its work left
    k = 0  # next bucket to launch
    while True:
        if ended is None and done >= compute:
            ended = t
        if running is None and k < buckets and ready[k] <= done:
            running, k = work[k], k + 1
        if running is None and done >= compute:
            assert ended is not None
            return (ended - compute) / layers, (t - ended) / layers
        if running is None:  # backward alone up to the next bucket
            t, done = t + ready[k] - done, ready[k]
        elif done >= compute:  # the all-reduce alone
            t, running = t + running, None
        else:  # both, each slowed: until one of them ends
            step = min(running, compute - done)
            t, done, running = t + step * slowdown, done + step, running - step
            if running <= 1e-15:
                running = None


def zero_post_backward_bytes(grad_bytes: float, accumulated: bool) -> float:
    """Bytes a ZeRO-2/3 unit briefly adds when its backward ends: the unsharded gradient autograd produced and
    the flat reduce-scatter input FSDP2 copies it into (ZeRO SC'20, Sec. 5.2: gradients reduced per bucket as
    they are produced); an unsharded gradient accumulated over micro-batches is already counted as kept."""
    return grad_bytes if accumulated else 2.0 * grad_bytes


def dp_sync_bytes_time(hw: HardwareProfile, grad_bytes: float, d: int, stride: int) -> float:
    """Gradient all-reduce (ZeRO-0/1) or reduce-scatter + parameter all-gather (ZeRO-2): equal volume (ZeRO SC'20, Sec. 7)."""
    return hw.collective_time("allreduce", grad_bytes, d, stride)


def zero3_gather_time(hw: HardwareProfile, param_bytes: float, d: int, stride: int) -> float:
    """ZeRO-3 all-gathers parameters before forward and again before backward (ZeRO SC'20, Sec. 7.2.2)."""
    return hw.collective_time("allgather", param_bytes, d, stride)


def p2p_time(hw: HardwareProfile, nbytes: float, stage_size: int) -> float:
    """One activation (or gradient) send between neighbouring stages (Galvatron VLDB'23, pipeline cost)."""
    return hw.p2p_time(nbytes, hw.is_intra_node(2, stage_size))


def batch_layout(s: LayerStrategy) -> tuple[int, bool]:
    """Which batch shard each rank holds: its dp degree and whether the shards are arranged as with
    consecutive tp groups (lightning_galv.layout.RankLayout). Activations move only when it changes."""
    return s.dp, (s.tp_consecutive or s.tp == 1 or s.dp == 1)


def data_strategy(stage_size: int, data_parallel_size: int) -> LayerStrategy:
    """The layout the data loader serves and activations cross pipeline stages in (layout.RankLayout.data_strategy)."""
    return LayerStrategy(tp=stage_size // data_parallel_size, dp=data_parallel_size)


def chunk_ends(chunk: int, chunks: int, embed: LayerStrategy, head: LayerStrategy,
               data: LayerStrategy) -> tuple[LayerStrategy, LayerStrategy]:
    """(layout into, layout out of) pipeline chunk ``chunk``'s blocks: the embedding's into the first chunk,
    the head's out of the last, the data loader's ``data`` elsewhere (parallel/parallelize.py step 4)."""
    return (embed if chunk == 0 else data), (head if chunk == chunks - 1 else data)


def _shard_of(s: LayerStrategy, rank: int) -> int:
    """The batch shard stage-local ``rank`` holds under ``s`` (lightning_galv.layout.RankLayout.coords)."""
    return rank // s.tp if s.tp_consecutive else rank % s.dp


@functools.lru_cache(maxsize=4096)
def shards_nested(outer: LayerStrategy, inner: LayerStrategy) -> bool:
    """Whether on every rank of the stage the batch shard under ``inner`` lies inside the one under ``outer``
    (parallel/redistribute.py ``_nested``): re-laying out from ``outer`` to ``inner`` is then a local slice."""
    if inner.dp % outer.dp:
        return False
    k = inner.dp // outer.dp
    return all(_shard_of(inner, r) // k == _shard_of(outer, r) for r in range(outer.width))


def native_transition_time(hw: HardwareProfile, a: LayerStrategy, b: LayerStrategy, sample_bytes: float,
                           mb: int) -> float:
    """What parallel/redistribute.py does per micro-batch when the batch layout changes from ``a`` to ``b``:
    forward, unless ``b``'s shard lies inside ``a``'s on every rank, an all-gather over the stage of every
    rank's ``a`` shard; backward, unless ``a``'s shard lies inside ``b``'s, one of every rank's ``b``-shard
    gradient (replicas included: a tp group's ranks all send theirs)."""
    if batch_layout(a) == batch_layout(b):
        return 0.0
    w = a.width
    fwd = 0.0 if shards_nested(a, b) else hw.collective_time("allgather", w * mb / a.dp * sample_bytes, w, 1)
    bwd = 0.0 if shards_nested(b, a) else hw.collective_time("allgather", w * mb / b.dp * sample_bytes, w, 1)
    return fwd + bwd


def transition_bytes_time(hw: HardwareProfile, a: LayerStrategy, b: LayerStrategy, sample_bytes: float,
                          mb: int) -> float:
    """Re-shard activations when the batch layout changes: all-gather of the larger shard, once fwd or bwd (Galvatron VLDB'23, Sec. 3.4)."""
    if batch_layout(a) == batch_layout(b):
        return 0.0
    lo, hi = min(a.dp, b.dp), max(a.dp, b.dp)
    size = mb / lo * sample_bytes
    if lo == hi:  # same shard size, different arrangement: a permutation inside the stage
        return hw.collective_time("alltoall", size, a.width, 1)
    return hw.collective_time("allgather", size, hi // lo, 1)


# ---------------------------------------------------------------------------------------------------
# the Galvatron-style model
# ---------------------------------------------------------------------------------------------------
def _ep_floor(lt: LayerTypeProfile, base: float, ep: int, key_of: Callable[[int], str]) -> float:
    """``base`` (bytes per sample with the experts whole), or the largest figure ``lt.activation_bytes`` holds at an
    expert-parallel degree dividing ``ep`` (``key_of(e)``), whichever is larger: the rows a rank's experts see do
    not shrink with ep, so a search trusting a noisy smaller measurement would buy ep for memory it does not save."""
    return max([base] + [lt.activation_bytes[k] for e in range(2, ep + 1) if ep % e == 0
                         if (k := key_of(e)) in lt.activation_bytes])


class GalvatronCostModel(CostModel):
    """Layer-wise time and memory following Galvatron (VLDB'23) and Galvatron-BMW (TKDE'24).

    Differences from Galvatron's own model, on purpose: backward time comes from the profile (not
    assumed 2x forward); with gradient accumulation (no pipeline) gradient sync runs once per step and
    overlaps only the *last* micro-batch's backward (under a pipeline, FSDP2 units reduce-scatter in every
    micro-batch's backward); the optimizer step is priced by memory bandwidth, so larger
    batches amortize it; in-flight micro-batches follow the schedule.
    """

    def __init__(self, model: ModelProfile, hw: HardwareProfile, embed_head_zero: int | None = None,
                 runtime: str = "ideal") -> None:
        """``runtime="native"`` prices what lightning_galv's own runtime does beyond the textbook
        (``"ideal"``) model: FSDP2 keeps the sharded ZeRO-2 parameters next to the gathered ones and
        ZeRO-3 holds the gathered current and prefetched layer; ZeRO-1 owners broadcast the updated
        parameters after the step (an all-gather's volume) instead of a reduce-scatter + all-gather."""
        if runtime not in ("ideal", "native"):
            raise bad_value(f"runtime={runtime}", "must be 'ideal' or 'native'",
                            "use 'native' for lightning_galv's runtime.")
        self.runtime = runtime
        if not isinstance(model, ModelProfile):
            raise TypeError(f"model={type(model).__name__}: expected ModelProfile. HINT: build one with "
                            "ModelProfile.from_shape(shape) or the ModelProfiler.")
        if not isinstance(hw, HardwareProfile):
            raise TypeError(f"hw={type(hw).__name__}: expected HardwareProfile. HINT: HardwareProfile.uniform(...)"
                            " or the HardwareProfiler.")
        self.model = model
        self.hw = hw
        self.embed_head_zero = embed_head_zero
        self._cache: dict[tuple, LayerCost] = {}

    # -- per layer --------------------------------------------------------------------------------------
    def context_key(self, ctx: StageContext) -> tuple:
        """Native runtime: (no pipeline, gradient accumulation without a pipeline) -- see :meth:`layer_cost`."""
        if self.runtime != "native":
            return ()
        return (ctx.pp == 1, ctx.pp == 1 and ctx.micro_batches > 1)

    def layer_cost(self, layer: int, s: LayerStrategy, ctx: StageContext) -> LayerCost:
        """Raises ``ValueError`` for ep > 1 on a layer type without experts (or whose expert count ep does not
        divide): the runtime refuses such a plan, so pricing it would only hide the mistake."""
        # the runtime's schedule changes what a layer holds and overlaps: gradient accumulation without a
        # pipeline (FSDP2 keeps unsharded gradients between micro-batches) and bucketed all-reduces
        # overlapped with backward (only without a pipeline, whose schedule owns the backward)
        overlap_sync, accumulates = self.context_key(ctx) or (False, False)
        key = (self.model.layer_type_of[layer], s, ctx.stage_size, ctx.micro_batch, accumulates, overlap_sync)
        hit = self._cache.get(key)
        if hit is None:
            lt = self.model.layer(layer)
            if s.ep > 1 and lt.moe is None:
                raise bad_value(f"layers[{layer}] ({lt.name}): ep={s.ep}", "expert parallelism splits a layer's "
                                "experts and this layer type has none", "keep ep=1 on dense layers; the search "
                                "proposes ep > 1 only for MoE layer types (LayerTypeProfile.moe).")
            if s.ep > 1 and lt.moe is not None and lt.moe.num_experts % s.ep:
                raise bad_value(f"layers[{layer}] ({lt.name}): ep={s.ep}", f"must divide the layer's "
                                f"{lt.moe.num_experts} experts", "pick ep from the common divisors of the experts "
                                "and the data group.")
            hit = self._block_cost(lt, s, ctx.micro_batch, accumulates, overlap_sync)
            self._cache[key] = hit
        return hit

    def _activation(self, lt: LayerTypeProfile, s: LayerStrategy, checkpoint: bool) -> float:
        """Activation bytes per local sample (MoE layer types: measured at the plan's ep where profiled -- the
        dispatcher saves buffers of its own --, else :func:`moe_block_activation`)."""
        if lt.moe is None:
            return lt.activation(s.tp, s.sp, checkpoint)
        whole = moe_block_activation(lt, s.tp, s.sp, checkpoint, self.model.seq_len, self.model.act_dtype_bytes)
        return _ep_floor(lt, whole, s.ep, lambda e: act_key(s.tp, s.sp, checkpoint, e))

    def _recompute_peak(self, lt: LayerTypeProfile, s: LayerStrategy) -> float:
        """Bytes per local sample while a checkpointed layer recomputes and runs backward: measured at (tp, sp)
        and, for an MoE block, at every ep dividing the plan's (never below a smaller ep's, as activations)."""
        if lt.moe is None:
            return lt.recompute_peak(s.tp, s.sp)
        base = lt.recompute_peak(s.tp, s.sp) if transient_key(s.tp, s.sp) in lt.activation_bytes \
            else self._activation(lt, s, False)
        return _ep_floor(lt, base, s.ep, lambda e: transient_key(s.tp, s.sp, e))

    def _moe_comm(self, lt: LayerTypeProfile, s: LayerStrategy, b: float, stride: int) -> tuple[float, float]:
        """(forward, backward) seconds of an MoE layer's own collectives per micro-batch (:func:`moe_layer_comm`)."""
        return moe_layer_comm(self.hw, lt, s, b, self.model.seq_len, self.model.act_dtype_bytes, stride)

    def _param_groups(self, lt: LayerTypeProfile, s: LayerStrategy, d: int,
                      stride: int) -> list[tuple[float, int, int, int]]:
        """This rank's parameters of the layer by the group that reduces their gradients, as (parameters,
        ranks, stride, separate collectives). Dense: one group, the data group. MoE: attention split by
        tp, router and shared expert replicated over tp (parallel/tensor.py "replicated"); with ep > 1 the
        routed experts form their own group, the expert-data group of |D|/ep ranks ep positions apart,
        where FSDP2 (ZeRO-2/3) shards each expert on its own -- on a group of two or more ranks; on a one-rank
        group the experts stay plain (parallel/parallelize.py)."""
        moe = lt.moe
        if moe is None:
            return [(lt.params / s.tensor_parallel, d, stride, 1)]
        dense = (lt.params - moe.params) / s.tensor_parallel + moe.shared_params + moe.router_params
        experts = expert_local_params(moe, s.ep)
        if s.ep == 1:  # the experts are ordinary block parameters: same bucket / same FSDP unit
            return [(dense + experts, d, stride, 1)]
        pieces = moe.num_experts // s.ep if s.zero >= 2 else 1
        return [(dense, d, stride, 1), (experts, d // s.ep, stride * s.ep, pieces)]

    def _overlap(self, compute: float, comm: float) -> float:
        """Overlapped when the hardware runs collectives beside compute, else one after the other."""
        if not self.hw.async_collectives:
            return compute + comm
        return overlapped(compute, comm, self.hw.overlap_slowdown)

    def _block_cost(self, lt: LayerTypeProfile, s: LayerStrategy, mb: int, accumulates: bool = False,
                    overlap_sync: bool = False, alone: bool = False) -> LayerCost:
        """``alone``: the block is the plan's only ZeRO-2/3 unit, its own FSDP2 root (:meth:`lone_unit_time`)."""
        m, hw = self.model, self.hw
        b = mb / s.dp
        t = s.tp
        seq = m.seq_len
        fwd = layer_compute(lt, "forward", s, b, seq)
        bwd = layer_compute(lt, "backward", s, b, seq)
        rec = layer_compute(lt, "recompute", s, b, seq) if s.checkpoint else 0.0
        act_bytes = b * m.seq_len * lt.hidden * m.act_dtype_bytes
        repeated = recompute_comm_share(lt, s)  # of the forward's collectives, run again by a recompute
        fwd_comm = block_comm_time(hw, m.shape, s, act_bytes, lt.moe)
        fwd_t = fwd + fwd_comm
        bwd_t = bwd + rec + fwd_comm * (1.0 + repeated)  # backward mirrors the forward collectives
        # data parallel: gradients of this rank's weight shard over the data group
        d = s.data_group
        dp_stride = block_dp_stride(s)
        if lt.moe is not None:  # synchronous in the forward path: added, never overlapped
            moe_f, moe_b = self._moe_comm(lt, s, b, dp_stride)
            fwd_t += moe_f
            bwd_t += moe_b + moe_f * repeated
            if s.ep > 1:  # the busiest EP rank's extra expert work under the measured routing skew
                sk_f, sk_b = ep_skew_time(lt.moe, b * seq / (t if s.ulysses else 1), s.ep, m.matmul_flops)
                fwd_t += sk_f
                bwd_t += sk_b + (sk_f if s.checkpoint else 0.0)  # a recompute runs the experts again
        groups = self._param_groups(lt, s, d, dp_stride)
        precision = "fp32" if m.precision == "fp32" else "mixed"
        fwd_t, bwd_t, extra, inside = self._data_parallel_groups(groups, s.zero, fwd_t, bwd_t, overlap_sync,
                                                                 accumulates, prefetched=not alone, block=True)
        native = self.runtime == "native"
        entry = zero_overhead_entry(lt, s.zero, t, s.ep, d // s.ep) if native and d > 1 and s.zero >= 2 else None
        if entry is not None:  # FSDP2's own work around its collectives, on this rank's FSDP2-managed share
            over, share = entry
            of, ob = over["forward"](b, m.seq_len) * share, over["backward"](b, m.seq_len) * share
            if alone and "forward_alone" in over:  # its own root's work too (measured on one unit alone)
                of, ob = over["forward_alone"](b, m.seq_len) * share, over["backward_alone"](b, m.seq_len) * share
            # the micro-batches before the last reduce-scatter nothing, and skip FSDP2's copies around it too: a
            # 2-rank LLaMA block's backward at 2 samples carried 8.5 ms of FSDP2 work with its reduce-scatter and
            # 2.9 ms without (ZeRO-3, beyond the collectives): charged per micro-batch, the difference priced
            # a 2-micro-batch ZeRO-3 plan 9 % slow (costmodel_accuracy.py at f741c80); once per step here
            first = over["backward_nosync"](b, m.seq_len) * share if accumulates and "backward_nosync" in over else ob
            if alone and accumulates and "backward_alone" in over and "backward_nosync" in over:
                first += (over["backward_alone"](b, m.seq_len) - over["backward"](b, m.seq_len)) * share
            fwd_t, bwd_t = fwd_t + of, bwd_t + first  # every micro-batch gathers again (ZeRO-2 and -3 alike)
            extra, inside = extra + ob - first, inside + ob - first
        if native:
            extra += dtensor_step_overhead(lt, s, d)
        states = 0.0
        for p, g, _, _ in groups:
            states += p * state_bytes_per_param(s.zero, g, precision)
        act = (lt.activation(t, s.sp, s.checkpoint) if lt.moe is None else self._activation(lt, s, s.checkpoint)) * b
        # recomputing a checkpointed layer briefly holds its activations again (+ gradient temporaries)
        transient = max(0.0, self._recompute_peak(lt, s) * b - act) if s.checkpoint else 0.0
        kept, held = self._fsdp_bytes(groups, s.zero, accumulates, gathered_units=2)
        return LayerCost(fwd_t, bwd_t, extra, states + kept, act, transient + held, inside)

    def _fsdp_bytes(self, groups: list[tuple[float, int, int, int]], zero: int, accumulates: bool,
                    gathered_units: int) -> tuple[float, float]:
        """(kept, transient) bytes the native runtime's FSDP2 units hold beyond the textbook ZeRO accounting of
        :func:`state_bytes_per_param`, for this rank's parameter ``groups`` (see :meth:`_param_groups`).

        Kept through the step's peak: a ZeRO-2 unit's sharded parameter next to the gathered one it keeps
        from forward to backward; under accumulation without a pipeline, the unsharded gradient (no
        reduce-scatter before the last micro-batch: FSDP2 accumulates it beside the sharded one). Transient,
        while the unit runs: ``gathered_units`` gathered copies of a ZeRO-3 unit's parameters (a block: its
        own + the prefetched neighbour's) and the post-backward reduce-scatter buffers
        (:func:`zero_post_backward_bytes`)."""
        if self.runtime != "native" or zero < 2:
            return 0.0, 0.0
        el = 4.0 if self.model.precision == "fp32" else 2.0
        kept = transient = 0.0
        for p, g, _, _ in groups:
            if g <= 1:
                continue
            if zero == 2:
                kept += p * el / g
            else:
                transient += gathered_units * (p * el) * (1.0 - 1.0 / g)
            if accumulates:
                kept += p * el
            transient += zero_post_backward_bytes(p * el, accumulates)
        return kept, transient

    def _data_parallel(self, local_params: float, zero: int, d: int, stride: int, fwd: float,
                       bwd: float, overlap_sync: bool = False, tail_share: float | None = None,
                       accumulates: bool = False) -> tuple[float, float, float, float]:
        """(fwd, bwd, per-step extra, its part inside the last backward) once this rank's ``local_params`` are data
        parallel over ``d`` ranks."""
        return self._data_parallel_groups([(local_params, d, stride, 1)], zero, fwd, bwd, overlap_sync,
                                          accumulates=accumulates, tail_share=tail_share)

    def _data_parallel_groups(self, groups: list[tuple[float, int, int, int]], zero: int, fwd: float,
                              bwd: float, overlap_sync: bool = False,
                              accumulates: bool = False, tail_share: float | None = None,
                              prefetched: bool = False, block: bool = False) -> tuple[float, float, float, float]:
        """(fwd, bwd, per-step extra, the part of that extra inside the last micro-batch's backward -- see
        ``LayerCost.in_backward``: the bucket copies the gradient hooks make (:func:`bucket_copy_in_backward`),
        FSDP2's exposed last reduce-scatter and, when accumulating, the last micro-batch's reduce-scatters, which
        FSDP2 runs from its backward hooks) of parameter groups each data parallel over its own ranks, given as
        (parameters, ranks, stride, separate collectives): the collectives of all groups share one overlap
        with the compute (they queue on the same link), each pays its own latency -- but for the native ZeRO-0/1
        all-reduces after backward, which each group runs on its own communicator (:meth:`_sync_exposures`). ``overlap_sync``: the
        native runtime's ZeRO-0/1 all-reduces run beside the last backward (no pipeline, see
        ``parallel.data_parallel.GradientSync``). ``accumulates``: gradient accumulation without a pipeline,
        where the runtime turns gradient sync off for all but the last micro-batch -- ZeRO-2/3 units then
        gather in every micro-batch (FSDP2 re-shards after each backward) but reduce-scatter only in the last
        one's backward (FSDP2's ``set_requires_gradient_sync``), so that reduce-scatter is a per-step cost,
        not a per-micro-batch one.
        ``tail_share``: the share of these collectives that waits for the end of backward, when the caller knows
        it (the embedding's: all); default: a block's (:func:`bucketed_sync_exposed`, 1/layers under FSDP2).
        ``block``: the groups are a transformer block's, whose ZeRO-0/1 all-reduce buckets the stage's blocks
        share (:func:`bucketed_allreduce_time`'s ``stage_bytes``; the ends ride in them).
        ``prefetched``: a block's FSDP2 all-gathers, which the native runtime prefetches (no pipeline): where the
        backend runs collectives inline (gloo), ``parallel.data_parallel._overlap_all_gathers`` issues them
        asynchronously, unit ``i+1``'s during unit ``i``'s forward and unit ``i-1``'s during unit ``i``'s backward,
        so they overlap compute at the profiled slowdown like the bucketed all-reduces; the first unit of each
        direction has nothing before it, so each block pays 1/layers of its gathers in full (exact when every
        block is a ZeRO-2/3 unit and the ends are not). Assumed, not seen from one layer: that the runtime made
        a shared FSDP2 root, which it does for two or more ZeRO-2/3 units under the model's container
        (``shared_root_container``), and the ShardedLayerProfiler times its ZeRO blocks so (a chain of two under
        one root, ``profilers._UnitChain``); with a single such unit its gathers run inline and are priced low here.
        Routed experts' nested states are outside the forward chain (inline in forward, hidden in backward)."""
        hw = self.hw
        native = self.runtime == "native"
        el = 4.0 if self.model.precision == "fp32" else 2.0
        extra = inside = 0.0
        fwd_comm = bwd_comm = last_comm = 0.0
        gathered = overlapped_last = False
        # native ZeRO-0/1 all-reduces launched asynchronously during the last backward, per data group (one
        # queue each): (their time, its latency part, this rank's gradient bytes)
        queues: list[tuple[float, float, float]] = []
        last_rs = 0.0  # ZeRO-2/3 reduce-scatters that only the last micro-batch's backward runs (``accumulates``)
        # FSDP2 (ZeRO-2/3, one unit per layer) reduce-scatters each unit's gradients when its backward ends; the
        # last unit's has no backward left to hide behind: each layer pays 1/layers of its own in full (no
        # pipeline: the stage is the whole model; under a pipeline the schedule's timing is kept as it was)
        rs_tail_share = (1.0 / self.model.num_layers if tail_share is None else tail_share) \
            if (native and overlap_sync) else 0.0
        exposed = 0.0
        # gathers run beside compute (async prefetch on an inline backend; see ``prefetched``), and their share
        # that nothing hides
        hide = prefetched and native and overlap_sync and not hw.async_collectives
        first_share = 1.0 / self.model.num_layers
        fwd_hidden = bwd_hidden = 0.0
        for i, (params, d, stride, pieces) in enumerate(groups):
            extra += self._optimizer_time(params, zero, d)
            if d == 1 or params == 0:
                continue
            grad_bytes = params * el
            nb = grad_bytes / pieces  # ``pieces`` equal collectives over the group (FSDP2 per expert)
            if zero == 1 and native:  # owners broadcast updated parameters (data.OptimizerStateSharding)
                extra += pieces * hw.collective_time("allgather", nb, d, stride)
            if zero == 3 or (zero == 2 and native):
                # FSDP2 unit: all-gather before every micro-batch's forward (ZeRO-2 too: FSDP2 re-shards after
                # every backward, also while accumulating), again before backward for ZeRO-3 (re-sharded after
                # forward); reduce-scatter in backward -- every micro-batch's, or only the last one's when
                # accumulating without a pipeline
                if zero == 3:
                    gather = pieces * zero3_gather_time(hw, nb, d, stride)
                else:
                    gather = pieces * hw.collective_time("allgather", nb, d, stride)
                inline = gather * first_share if hide else gather
                # routed experts (group 1) have FSDP2 states of their own, nested in the block's: the forward
                # prefetch chain names the blocks' states only, so they gather inline in forward; backward's
                # implicit prefetch follows every state's post-forward order, theirs included
                fwd_inline = gather if i > 0 else inline
                fwd_comm += fwd_inline
                fwd_hidden += gather - fwd_inline
                scatter = pieces * hw.collective_time("reducescatter", nb, d, stride)
                tail = scatter * rs_tail_share
                exposed += tail
                bwd_comm += (inline if zero == 3 else 0.0) + (0.0 if accumulates else scatter - tail)
                bwd_hidden += gather - inline if zero == 3 else 0.0
                last_rs += scatter - tail if accumulates else 0.0
                gathered = True
            elif native and zero <= 1:  # data.GradientSync: bucketed all-reduces, during or after the last backward
                extra += bucket_copy_time(grad_bytes, hw.memory_bandwidth)
                inside += bucket_copy_in_backward(grad_bytes, hw.memory_bandwidth, overlap_sync)
                queue = self._sync_queue(params, d, stride, pieces, block)
                if overlap_sync:
                    queues.append(queue)
                else:
                    extra += queue[0]
            else:
                last_comm += pieces * dp_sync_bytes_time(hw, nb, d, stride)
                overlapped_last = True
        if queues:  # async on every backend (gloo too): beside backward at the profiled overlap slowdown,
            # the buckets queued after it paid in full (overlap_sync: no pipeline, so the stage is the whole model)
            if tail_share is None:
                # the slowest group's; its backward slowed beside them is inside backward (phases only)
                stretch, after = max(self._sync_splits(queues, bwd), key=sum)
                extra += stretch + after
                inside += stretch
            else:
                sync_comm = sum(q[0] for q in queues)
                tail = sync_comm * tail_share
                extra += tail + overlapped(bwd, sync_comm - tail, hw.overlap_slowdown) - bwd
        extra += exposed
        inside += exposed
        if gathered:
            if fwd_hidden > 0:  # prefetched gathers beside compute (Galvatron VLDB'23's overlap slowdown, an
                # all-gather's: HardwareProfile.gather_slowdown)
                fwd = overlapped(fwd, fwd_hidden, hw.gather_slowdown)
            if bwd_hidden > 0:
                bwd = overlapped(bwd, bwd_hidden, hw.gather_slowdown)
            bwd_mb = self._overlap(bwd, bwd_comm)
            if last_rs > 0:  # the last micro-batch's backward also reduce-scatters: its increment, once per step
                increment = self._overlap(bwd, bwd_comm + last_rs) - bwd_mb
                extra += increment
                inside += increment
            return self._overlap(fwd, fwd_comm), bwd_mb, extra, inside
        if overlapped_last:
            return fwd, bwd, extra + self._overlap(bwd, last_comm) - bwd, inside
        return fwd, bwd, extra, inside

    def _sync_queue(self, params: float, d: int, stride: int, pieces: int, block: bool
                    ) -> tuple[float, float, float]:
        """(time, its latency part, this rank's gradient bytes) of one data group's bucketed ZeRO-0/1 all-reduces
        of ``params`` parameters in ``pieces`` collectives. A block's buckets: the stage's gradients taken as
        ``num_layers`` blocks like this one (as for :func:`bucketed_sync_exposed`); an end (``block`` False) rides
        in the blocks' buckets (a full bucket's latency share)."""
        el = 4.0 if self.model.precision == "fp32" else 2.0
        nb = params * el / pieces
        stage = nb * self.model.num_layers if block else None
        return (pieces * bucketed_allreduce_time(self.hw, nb, d, stride, stage_bytes=stage),
                pieces * bucket_latency(self.hw, nb, d, stride, stage_bytes=stage), params * el)

    def _sync_splits(self, queues: list[tuple[float, float, float]], bwd: float) -> list[tuple[float, float]]:
        """:meth:`_sync_exposures`, each split into its part inside the last backward and after it
        (:func:`bucketed_sync_split`)."""
        return [bucketed_sync_split(bwd, comm, self.model.num_layers, nbytes, self.hw.overlap_slowdown,
                                    latency=latency) for comm, latency, nbytes in queues]

    def _sync_exposures(self, queues: list[tuple[float, float, float]], bwd: float) -> list[float]:
        """Per data group of a block, what its bucketed all-reduces add to the last backward (per layer,
        :func:`bucketed_sync_exposed`), each group simulated as its own queue.

        Why per group and then the largest, not one queue: ``GradientSync`` runs each data group's buckets on
        that group's communicator, so an MoE block's dense gradients (over the data group) and its experts'
        (over the expert-data group) reduce side by side and the step waits for the slower. Measured at 4 gloo
        ranks (moe ep2, costmodel_accuracy.py --model moe at a789094): 8.9 ms waited after backward where one
        queue of both priced 15 ms and the slower group alone 8.8 ms."""
        return [sum(split) for split in self._sync_splits(queues, bwd)]

    def _optimizer_time(self, local_params: float, zero: int, d: int) -> float:
        """Memory-bound optimizer update of this rank's shard (ZeRO SC'20: stages >= 1 shard the update)."""
        if self.hw.memory_bandwidth <= 0:
            return 0.0
        shard = local_params / d if zero >= 1 else local_params
        return OPTIMIZER_TRAFFIC_BYTES * shard / self.hw.memory_bandwidth

    def transition_time(self, a: LayerStrategy, b: LayerStrategy, ctx: StageContext) -> float:
        """Galvatron's one all-gather (ideal), or what the native runtime's re-layout does (both directions)."""
        sample_bytes = self.model.seq_len * self.model.shape.hidden * self.model.act_dtype_bytes
        if self.runtime == "native":
            return native_transition_time(self.hw, a, b, sample_bytes, ctx.micro_batch)
        return transition_bytes_time(self.hw, a, b, sample_bytes, ctx.micro_batch)

    def chunk_boundary_time(self, plan: ParallelPlan, chunk: int, ctx: StageContext) -> float:
        """The re-layouts at the chunk's edges (:meth:`boundary_time`), plus :meth:`lone_unit_time`."""
        return super().chunk_boundary_time(plan, chunk, ctx) + self.lone_unit_time(plan, ctx)

    def lone_unit_time(self, plan: ParallelPlan, ctx: StageContext) -> float:
        """Native runtime, no pipeline: seconds per micro-batch (fwd + bwd) that a plan's only ZeRO-2/3 unit costs
        beyond its :meth:`layer_cost`.

        ``layer_cost`` prices a ZeRO-2/3 block as one of a model of such blocks under a shared FSDP2 root
        (``parallelize`` makes one for two or more units): its gathers prefetched beside compute but for the
        first unit's share, the root's work split among the units (``LayerTypeProfile.zero_overhead`` is
        measured so). A single such unit is its own root: every gather inline, the root's pre-forward and
        post-backward work on it alone (``zero_overhead``'s "forward_alone" / "backward_alone", measured on one
        unit alone). The difference is charged here, once per plan, at the chunk's edges -- where the step runs
        it: in the unit's FSDP2 hooks, before its forward and backward. Measured (2 gloo ranks, the accuracy
        benchmark's LLaMA, one launch): [dp2, tp2, dp2, ulysses2·ckpt] took 20 ms per step more with the third
        block under ZeRO-3 (it alone), where its layer cost added 10 ms. The search's per-layer tables do not see
        it (a plan-level term, like :meth:`stage_sync_time`); ``evaluate`` does. An end that is the only
        ZeRO-2/3 unit is priced by :meth:`end_cost` as before."""
        if self.runtime != "native" or ctx.pp != 1:
            return 0.0
        # FSDP2 states the runtime makes (a one-rank data group's too: parallelize._sharded_modules); the head's
        # unit is two modules (final norm + head), so a ZeRO-2/3 end always shares a root
        units = [i for i, s in enumerate(plan.layers) if s.zero >= 2]
        if len(units) != 1 or any(e is not None and e.zero >= 2 for e in (plan.embed, plan.head)):
            return 0.0
        i = units[0]
        s = plan.layers[i]
        if s.data_group == 1:  # nothing gathered, no overhead priced either way
            return 0.0
        overlap_sync, accumulates = self.context_key(ctx) or (False, False)
        shared = self.layer_cost(i, s, ctx)
        alone = self._block_cost(self.model.layer(i), s, ctx.micro_batch, accumulates, overlap_sync, alone=True)
        return max(0.0, (alone.fwd + alone.bwd) - (shared.fwd + shared.bwd))

    def boundary_time(self, entry: LayerStrategy, first: LayerStrategy, last: LayerStrategy, exit_: LayerStrategy,
                      ctx: StageContext) -> float:
        """Native runtime: parallel/parallelize.py step 4 re-lays out the embedding's (or the loader's) layout
        into a chunk's first block and its last block into the head's (or back) like any neighbours."""
        if self.runtime != "native":
            return 0.0
        return self.transition_time(entry, first, ctx) + self.transition_time(last, exit_, ctx)

    @property
    def prices_boundaries(self) -> bool:
        return self.runtime == "native"

    def stage_sync_time(self, plan: ParallelPlan, stage: int, ctx: StageContext) -> float:
        """Native runtime: the latencies of gradient all-reduce buckets that the parts priced only a share of,
        where no other group's collective after backward hides them.

        ``GradientSync`` buckets each data group's ZeRO-0/1 gradients on its own, one latency a bucket. A part
        prices its share of the latencies as if its group held the stage's blocks (a block: as one of
        ``num_layers`` like it; an end: riding in the blocks' buckets). That holds for a uniform data-parallel
        plan; where the ends (or a few blocks) reduce over a group no other part shares -- ends over the world
        beside tensor-parallel blocks, a heterogeneous plan -- their group still runs one whole collective,
        launched when its last gradient is ready (for the embedding's, made last: after backward). The groups'
        last buckets then run side by side (one communicator each) and the step waits for the slowest, where the
        parts add up what each priced: this charges ``max(tail) - sum(tail priced)`` over the groups, a tail being
        a group's last all-reduce, never below zero. Measured at 4 gloo ranks on 2 cores (a latency: 2-9 ms):
        every plan whose blocks sync nothing beside the ends' 4 ranks took ~5 ms per step more than priced (4r
        tp4 15 vs 9 ms after backward, costmodel_accuracy.py at f741c80), and charging every group its missing
        latency in full priced the plans whose blocks sync over 2 ranks meanwhile 5-9 ms high (4r tp2·dp2 30 vs
        25 ms, at b2ebb39). A block with two groups (an MoE block's dense and expert gradients) charges only its
        slower queue beside backward, so the other group counts as priced only for the parts that charged it."""
        if self.runtime != "native":
            return 0.0
        assert plan.embed is not None and plan.head is not None
        el = 4.0 if self.model.precision == "fp32" else 2.0
        key = self.context_key(ctx)
        overlap_sync = bool(key and key[0])
        # (ranks, stride) -> [gradient bytes, of them in parts that charged this group's tail, latencies those paid]
        groups: dict[tuple[int, int], list[float]] = {}

        def add(params: float, d: int, stride: int, pieces: int, block: bool, charged: bool) -> None:
            if d <= 1 or params <= 0:
                return
            nb = params * el / pieces
            latency = self.hw.link("allreduce", d, stride == 1, self.hw.is_intra_node(d, stride)).latency_s
            paid = bucket_latency(self.hw, nb, d, stride, stage_bytes=nb * self.model.num_layers if block else None)
            g = groups.setdefault((d, stride), [0.0, 0.0, 0.0])
            g[0] += params * el
            if charged:
                g[1] += params * el
                g[2] += pieces * paid / latency if latency > 0 else 0.0

        for chunk in range(stage, plan.pp * plan.virtual_stages, plan.pp):
            for i in plan.stage_layers(chunk):
                s = plan.layers[i]
                if s.zero > 1:
                    continue
                lt = self.model.layer(i)
                block_groups = self._param_groups(lt, s, s.data_group, block_dp_stride(s))
                # beside backward, a block's part charges only its slowest group's queue (_sync_exposures)
                winner = self._sync_winner(block_groups, self.layer_cost(i, s, ctx).bwd) if overlap_sync else None
                for k, (params, d, stride, pieces) in enumerate(block_groups):
                    add(params, d, stride, pieces, True, winner is None or k == winner)
        ends = ([(plan.embed, self.model.embed_params)] if stage == 0 else []) + \
            ([(plan.head, self.model.head_params)] if stage == plan.pp - 1 else [])
        for s, params in ends:
            if s.zero <= 1:
                add(params / s.tp, s.dp, end_dp_stride(s), 1, False, True)
        tails, priced = [], 0.0
        for (d, stride), (nbytes, charged, paid) in groups.items():
            latency = self.hw.link("allreduce", d, stride == 1, self.hw.is_intra_node(d, stride)).latency_s
            buckets = max(1, math.ceil(nbytes / GRAD_BUCKET_BYTES - 1e-9))
            tail = self.hw.collective_time("allreduce", nbytes - GRAD_BUCKET_BYTES * (buckets - 1), d, stride)
            tails.append(tail)
            # the parts that charged this group paid their bytes' share of it but the missing latencies
            share = charged / nbytes
            priced += max(0.0, tail * share - max(0.0, buckets * share - paid) * latency)
        return max(0.0, max(tails, default=0.0) - priced)

    def _sync_winner(self, groups: list[tuple[float, int, int, int]], bwd: float) -> int | None:
        """Index of the data group whose all-reduce queue a block's part charges (the slowest; see
        :meth:`_data_parallel_groups`), or None when it has one group or none syncing."""
        queues, index = [], []
        for k, (params, d, stride, pieces) in enumerate(groups):
            if d > 1 and params > 0:
                queues.append(self._sync_queue(params, d, stride, pieces, True))
                index.append(k)
        if len(queues) < 2:
            return None
        exposures = self._sync_exposures(queues, bwd)
        return index[exposures.index(max(exposures))]

    # -- embedding + head ----------------------------------------------------------------------------
    def end_cost(self, s: LayerStrategy, ctx: StageContext, first: bool, last: bool,
                 vocab_parallel_loss: bool = False) -> LayerCost:
        """Embedding (first stage) and final norm + output projection + loss (last stage); a tp > 1 head
        gathers its logits unless ``vocab_parallel_loss`` (``ParallelPlan.vocab_parallel_loss``)."""
        m, hw = self.model, self.hw
        b = ctx.micro_batch / s.dp
        seq = m.seq_len
        fwd = bwd = extra = states = act = peak_transient = hooked = 0.0
        precision = "fp32" if m.precision == "fp32" else "mixed"
        d = s.dp
        dp_stride = end_dp_stride(s)
        head_t, head_share = 0.0, 1.0
        if last:  # logits gathered (default) or vocab-parallel loss
            head_t, head_share = vocab_parallel_head(hw, b * seq * m.shape.vocab_size * m.act_dtype_bytes, b * seq,
                                                     s.tp, 1 if s.tp_consecutive else s.dp, vocab_parallel_loss)
        # as for a block (see layer_cost): ZeRO-2/3 ends reduce-scatter only in the last micro-batch's backward
        # when accumulating without a pipeline
        overlap_sync, accumulates = self.context_key(ctx) or (False, False)
        # the embedding registers first, so its gradient is the last one backward makes: its all-reduce bucket
        # (ZeRO-0/1) or its FSDP2 unit's reduce-scatter waits for the end of backward, all of it
        for embed, present, params, fit, bwd_fit, act_per_sample, bwd_ratio, tail, at_peak in (
                (True, first, m.embed_params, m.embed_forward, m.embed_backward, m.embed_act_bytes, 1.0, 1.0, False),
                (False, last, m.head_params, m.head_forward, m.head_backward, m.head_act_bytes, 2.0, None, True)):
            if not present:
                continue
            local = params / s.tp
            f = sharded_compute(fit.const, fit(b, seq), s.tp)
            # measured where profiled; else embedding backward ~ a scatter-add as long as the lookup, head
            # backward = 2 matmuls (SC'21)
            if bwd_fit is None:
                bw = bwd_ratio * f
            elif embed:
                # a vocab-parallel embedding's backward scatter-adds every token into its 1/tp of the rows: the
                # per-token part stays whole, the fit's constant (the V x h gradient's fill) shrinks with tp
                bw = bwd_fit.const / s.tp + (bwd_fit(b, seq) - bwd_fit.const)
            else:
                bw = sharded_compute(bwd_fit.const, bwd_fit(b, seq), s.tp)
            pf, pb, pe, pin = self._data_parallel(local, s.zero, d, dp_stride, f, bw, overlap_sync, tail,
                                                  accumulates)
            fwd, bwd, extra, hooked = fwd + pf, bwd + pb, extra + pe, hooked + pin
            states += local * state_bytes_per_param(s.zero, d, precision)
            # FSDP2's own bytes (as for a block, :meth:`_fsdp_bytes`). The head's transient ones (its gathered
            # ZeRO-3 parameters, its reduce-scatter buffers) are alive when backward starts, with every
            # micro-batch's activations -- the stage's peak -- so :meth:`stage_fixed` adds them to the peak. Without
            # a pipeline the embedding gathers and reduces when no activations are left (or none yet): only its kept
            # bytes count; under a pipeline stage 0 runs it while other micro-batches' activations are alive.
            kept, held = self._fsdp_bytes([(local, d, dp_stride, 1)], s.zero, accumulates, gathered_units=1)
            states += kept
            peak_transient += held if (at_peak or not overlap_sync) else 0.0
            act += act_per_sample * b * (head_share if last else 1.0)
        embed_t = vocab_parallel_embedding_comm(hw, b * seq * m.shape.hidden * m.act_dtype_bytes, s.tp,
                                                1 if s.tp_consecutive else s.dp) if first else 0.0
        return LayerCost(fwd + head_t + embed_t, bwd, extra, states, act, peak_transient, hooked)

    def stage_fixed(self, plan_embed: LayerStrategy, plan_head: LayerStrategy, ctx: StageContext,
                    vocab_parallel_loss: bool = False) -> tuple[float, float, float]:
        first, last = ctx.stage == 0, ctx.stage == ctx.pp - 1
        mb_t = extra = 0.0
        mem = self.model.framework_bytes
        inflight = ctx.inflight
        costs = []
        if first and last and plan_embed == plan_head:
            costs.append(self.end_cost(plan_embed, ctx, True, True, vocab_parallel_loss))
        else:
            if first:
                costs.append(self.end_cost(plan_embed, ctx, True, False))
            if last:
                costs.append(self.end_cost(plan_head, ctx, False, True, vocab_parallel_loss))
        for c in costs:
            mb_t += c.fwd + c.bwd
            extra += c.step_extra
            mem += c.memory(inflight) + c.transient  # an end's transient is alive at the peak (end_cost)
        if ctx.pp > 1:  # send activations forward and gradients backward across each stage boundary
            # p2p carries the boundary layer's local shard; use the stage size as the shard count bound
            sample = self.model.seq_len * self.model.shape.hidden * self.model.act_dtype_bytes
            nbytes = ctx.micro_batch / max(1, plan_head.dp if last else plan_embed.dp) * sample
            hops = (0 if first else 1) + (0 if last else 1)
            mb_t += hops * p2p_time(self.hw, nbytes, ctx.stage_size) * ctx.virtual_stages
        return mb_t, extra, mem

    # -- whole plan -----------------------------------------------------------------------------------
    def evaluate(self, plan: ParallelPlan) -> PlanCost:
        if len(plan.layers) != self.model.num_layers:
            raise bad_value(f"{len(plan.layers)} layers in plan", f"the profile has {self.model.num_layers}",
                            "evaluate the plan against the profile of the same model.")
        return replace(super().evaluate(plan), stage_in_backward_s=self._in_backward(plan))

    def _in_backward(self, plan: ParallelPlan) -> tuple[float, ...]:
        """Per stage, the per-step seconds its blocks and ends spend inside the last backward (``in_backward``)."""
        assert plan.global_batch is not None and plan.embed is not None and plan.head is not None
        mb = plan.global_batch // plan.micro_batches
        out = []
        for st in range(plan.pp):
            ctx = StageContext(plan.stage_size, mb, plan.micro_batches, plan.pp, st, plan.pipeline_schedule,
                               plan.virtual_stages)
            t = sum(self.layer_cost(i, plan.layers[i], ctx).in_backward
                    for chunk in range(st, plan.pp * plan.virtual_stages, plan.pp) for i in plan.stage_layers(chunk))
            if st == 0:
                t += self.end_cost(plan.embed, ctx, True, False).in_backward
            if st == plan.pp - 1:
                t += self.end_cost(plan.head, ctx, False, True, plan.vocab_parallel_loss).in_backward
            out.append(t)
        return tuple(out)
