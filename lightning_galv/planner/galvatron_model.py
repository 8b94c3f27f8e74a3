"""Galvatron 2.4's cost model as a :class:`~lightning_galv.planner.cost.CostModel` the search runs on.

A Galvatron user judges a planner by Galvatron's own numbers. :class:`Galvatron24CostModel` prices layers,
ends and stages with the rules of :class:`~lightning_galv.planner.galvatron_accounting.GalvatronAccounting`
-- the same functions, called for one layer or one end at a time, so the search and the scorer cannot drift
apart -- and prices a whole plan with Galvatron's own 1F1B formula. The native model
(:class:`~lightning_galv.planner.cost.GalvatronCostModel`) stays the default: it prices what our runtime
does; this one prices what Galvatron's search believes.

Galvatron's numbers depend on more than a plan: the global batch (its ZeRO-2 rule keeps accumulated
gradients unsharded when there is more than one micro-batch), the world size (its hardware coefficients are
keyed by group sizes and pipeline degrees) and the search context ``(min_tp, max_tp)`` (its micro-batch is
the one of a min_tp-wide group; under Megatron-SP the global buffer grows with max_tp). The model is built
for one of each; :func:`galvatron_search` runs the search once per context, as Galvatron does
(search_engine.py parallelism_optimization), and keeps the best plan that fits.

Galvatron's layer space is chosen by ``sp_space``: 'tp' (its default, and ours) or 'tp+sp', where each
layer is tensor-parallel or Ulysses (``use_sp``), the ends may be sequence-split (``vsp``) and every tp /
Ulysses collective is priced from the measured sp_time tables. A 'tp+sp' context has a third coordinate,
``sp_search`` (1 = tp layers only, 2 = Ulysses layers only with sequence-split ends and no Megatron-SP
buffer, 3 = both); prices do not depend on it except for that buffer, so 3 covers 1 at the same price
(see :func:`galvatron_contexts`).

Galvatron's ``--pipeline_type`` is a search-wide choice too, so the model is built for one: 'pipedream_flush'
(1F1B, the default here) or 'gpipe'. They share the time formula (cost_model.py pipeline_costmodel is the same
for both); under GPipe Galvatron keeps the activations of one micro-batch on every stage -- the first chunk
of a local batch taken per min_tp-wide group -- and one micro-batch of the ends' activations on the first
stage too (cost_model.py MemoryCostModel.initialize / estimate_other_memory_cost; dynamic_programming.py
prices every stage with the same per-layer memory).

What differs from the scorer, on purpose: Galvatron prices the embedding and the head of a one-stage plan
as one table entry; our search may pick them separately, so each end of a one-stage plan is charged half of
its strategy's entry (both halves of one strategy add up to Galvatron's number exactly). Galvatron's final
price has no transition cost between layers (its DP uses one as a tie-breaker only), so neither has this model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

from ..errors import bad_value
from ..plan import LayerStrategy, ModelShape, ParallelPlan
from .cost import CostModel, LayerCost, PlanCost, StageContext
from .galvatron_accounting import (CONTEXT_MB, MB, GalvatronAccounting, GalvatronHardware, layer_chunks,
                                   pipeline_step, torch_chunks)
from .layer_dp import FrontsMemo
from .profiles import HardwareProfile, ModelProfile
from .space import SearchSpace, SequenceSplitEnd, is_sequence_split

PIPELINE_TYPES = {"pipedream_flush": "1f1b", "gpipe": "gpipe"}  # Galvatron's --pipeline_type -> our schedule


@dataclass(frozen=True)
class CeiledLayerCost(LayerCost):
    """A layer's cost whose memory is rounded up to whole MB, as Galvatron's DP takes every layer's memory
    (dynamic_programming.py _build_dp_and_run_multi_layer_type: ``np.ceil(...).astype(int)``)."""

    def memory(self, inflight: float) -> float:
        return math.ceil((self.states + inflight * self.act) / MB) * MB


def galvatron_contexts(world: int, max_tp: int = 8, sequence_parallel: bool = True,
                       sp_space: str = "tp") -> list[tuple[int, ...]]:
    """(min_tp, max_tp) pairs Galvatron's search visits with its global memory buffer on, powers of two up to
    the world and max_tp (search_engine.py parallelism_optimization). Without Megatron-SP max_tp changes only
    which tp degrees are allowed (the buffer is 0), so the widest context of each min_tp covers the others.

    With ``sp_space='tp+sp'``: (min_tp, max_tp, sp_search) triples. sp_search 3 (any mix) covers 1 (tp only)
    at the same price; 2 (Ulysses only) differs only in having no Megatron-SP buffer, so it is needed with
    Megatron-SP alone, and then, the buffer being 0 for any max_tp, in the widest context of each min_tp."""
    tps, t = [], 1
    while t <= world and t <= max_tp:
        tps.append(t)
        t *= 2
    if sp_space == "tp+sp":
        if not sequence_parallel:
            return [(a, tps[-1], 3) for a in tps]
        return [(a, b, c) for a in tps for b in tps if a <= b for c in ((2, 3) if b == tps[-1] else (3,))]
    if not sequence_parallel:
        return [(a, tps[-1]) for a in tps]
    return [(a, b) for a in tps for b in tps if a <= b]


class Galvatron24CostModel(CostModel):
    """Galvatron 2.4.0's time and memory rules, for one (world, global batch, budget, search context).

    ``memory_gb`` is Galvatron's ``memory_constraint``: plans must fit :attr:`usable_bytes` (the budget less
    Galvatron's 20 % allocator reserve above 20 GB); search with ``memory_budget_bytes=usable_bytes,
    memory_margin=0`` and :meth:`search_space` (or use :func:`galvatron_search`). ``sp_space='tp+sp'`` prices
    Ulysses layers and sequence-split ends (Galvatron's ``--sp_space tp+sp``) in context ``sp_search``
    (default 3: any mix); the default 'tp' prices exactly as before. ``pipeline_type`` is Galvatron's:
    'pipedream_flush' (1F1B, default) or 'gpipe'; the search space then holds that schedule only.
    """

    step_time_vs_pipeline = "at_most"  # Galvatron's bubble counts the first and last stage only (pipeline_step)

    def __init__(self, model: ModelProfile, hw: GalvatronHardware, memory_gb: float, global_batch: int,
                 min_tp: int = 1, max_tp: int | None = None, sequence_parallel: bool = False,
                 default_dp_type: str = "zero2", sp_space: str = "tp", sp_search: int | None = None,
                 pipeline_type: str = "pipedream_flush") -> None:
        if not isinstance(hw, GalvatronHardware):
            raise TypeError(f"hw={type(hw).__name__}: expected GalvatronHardware. HINT: "
                            "compat.galvatron.read_galvatron_hardware(dir, nodes, gpus_per_node).")
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise bad_value(f"global_batch={global_batch}", "must be a positive int (Galvatron prices one batch)",
                            "e.g. global_batch=64; sweep batches with one model each.")
        world = hw.world
        max_tp = min(8, world) if max_tp is None else max_tp
        for name, v in (("min_tp", min_tp), ("max_tp", max_tp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1) or world % v:
                raise bad_value(f"{name}={v}", f"must be a power of two dividing the world size {world}",
                                "Galvatron's contexts: see galvatron_contexts(world).")
        if min_tp > max_tp:
            raise bad_value(f"min_tp={min_tp}, max_tp={max_tp}", "min_tp must be <= max_tp", "e.g. min_tp=1, max_tp=8.")
        sp_search = (3 if sp_space == "tp+sp" else 1) if sp_search is None else sp_search
        if sp_search not in ((1, 2, 3) if sp_space == "tp+sp" else (1,)):
            raise bad_value(f"sp_search={sp_search}", f"sp_space {sp_space!r} has contexts "
                            f"{(1, 2, 3) if sp_space == 'tp+sp' else (1,)} (1 tp, 2 Ulysses, 3 both)",
                            "leave sp_search=None, or use sp_space='tp+sp' for Ulysses contexts.")
        if pipeline_type not in PIPELINE_TYPES:
            raise bad_value(f"pipeline_type={pipeline_type!r}", "Galvatron's pipeline types are "
                            f"{sorted(PIPELINE_TYPES)} (arguments.py --pipeline_type)", "use 'pipedream_flush' (1F1B) or 'gpipe'.")
        self.pipeline_type, self.schedule = pipeline_type, PIPELINE_TYPES[pipeline_type]
        self.acc = GalvatronAccounting(model, hw, memory_gb, sequence_parallel, default_dp_type, max_tp, sp_space)
        self.sp_space, self.sp_search = sp_space, sp_search
        self.model, self.hw, self.global_batch = model, hw, global_batch
        self.world_size = world
        self.min_tp, self.max_tp = min_tp, max_tp
        self.default_zero = 2 if default_dp_type == "zero2" else 0
        self._cache: dict[tuple, LayerCost] = {}

    # -- configuration ----------------------------------------------------------------------------------
    @property
    def usable_bytes(self) -> float:
        """What a stage may use: Galvatron's budget less its allocator reserve (dynamic_programming.py DpOnModel.__init__)."""
        return self.acc.usable_mb * MB

    @property
    def pp_degrees(self) -> tuple[int, ...]:
        """Pipeline degrees Galvatron has p2p coefficients for (config_utils.py read_p2p_bandwidth_config)."""
        return tuple(sorted({1} | {p for p in self.hw.p2p_coe if self.world_size % p == 0}))

    def search_space(self, grid_mb: float = 4.0, **overrides: object) -> SearchSpace:
        """Galvatron's space in this context, plus ours: per-layer tp / ZeRO-3 / checkpointing (as Galvatron),
        uneven stage division and any tp / pp degree (ours), one strategy for both ends (as Galvatron: one
        vtp and embed_sdp), the model's pipeline schedule. Memory on a ``grid_mb`` grid (Galvatron: 1 MB; a
        coarser grid is faster and conservative). Under sp_space 'tp+sp' also Ulysses per layer and
        sequence-split ends (vsp), as the context's sp_search allows, vtp 1 included
        (:class:`~.space.SequenceSplitEnd`). ``overrides`` replace any field."""
        tp_mode = "megatron" if self.acc.sp else "none"
        sp_modes = {1: (tp_mode,), 2: ("ulysses",), 3: (tp_mode, "ulysses")}[self.sp_search]
        vocab_sp = {1: (False,), 2: (True,), 3: (False, True)}[self.sp_search]
        kw: dict[str, object] = dict(
            min_tp=self.min_tp, max_tp=self.max_tp, schedules=(self.schedule,), pp_degrees=self.pp_degrees,
            sp_modes=sp_modes, zero_stages=(self.default_zero, 3),
            tp_consecutive=(True, False), tied_ends=True, vocab_padding=True, uneven_partition=True,
            memory_bins=max(16, int(math.ceil(self.acc.usable_mb / grid_mb))))
        if vocab_sp != (False,):  # the field stays at its default in 'tp' mode
            kw["vocab_sp"] = vocab_sp
        kw.update(overrides)
        return SearchSpace(**kw)  # type: ignore[arg-type]

    def _batches(self, stage_size: int, micro_batch: int) -> tuple[int, int, int, int]:
        """(pp, micro-batches, Galvatron's mbsz, its chunk count) of a stage size and micro-batch
        (search_engine.py parallelism_optimization: mbsz of a min_tp-wide group)."""
        pp = self.world_size // stage_size
        m = self.global_batch // micro_batch
        g = stage_size // self.min_tp
        mbsz = (self.global_batch // g + m - 1) // m
        return pp, m, mbsz, layer_chunks(self.global_batch, self.min_tp, g, mbsz, self.min_tp)

    def admits(self, stage_size: int, micro_batch: int) -> bool:
        """Galvatron's model is defined where the stage size divides the world at a pipeline degree it has
        coefficients for, min_tp divides the stage, and each micro-batch splits evenly over the min_tp-wide
        groups (so torch.chunk makes equal micro-batches and the search's chunk is the real one,
        search_engine.py: 'strict mode')."""
        if stage_size < 1 or self.world_size % stage_size or stage_size % self.min_tp:
            return False
        pp = self.world_size // stage_size
        if pp not in self.pp_degrees or self.global_batch % micro_batch:
            return False
        return micro_batch % (stage_size // self.min_tp) == 0

    # -- validation ----------------------------------------------------------------------------------------
    def _check_layer(self, layer: int, s: LayerStrategy) -> None:
        if s.ep > 1:
            raise bad_value(f"layers[{layer}]: ep={s.ep}", "Galvatron's cost model has no expert parallelism",
                            "keep ep=1 (this model prices dense layers only).")
        if s.ulysses and self.sp_search == 1:
            raise bad_value(f"layers[{layer}]: sp='ulysses'", f"Galvatron prices Ulysses layers (use_sp) in sp_space "
                            f"'tp+sp' contexts with sp_search 2 or 3; this model has sp_space {self.sp_space!r}, "
                            f"sp_search {self.sp_search}", "build Galvatron24CostModel(..., sp_space='tp+sp'), or "
                            "use sp 'none' / 'megatron'.")
        if self.sp_search == 2 and s.tp > 1 and not s.ulysses:
            raise bad_value(f"layers[{layer}]: sp={s.sp!r}", "context sp_search 2 holds Ulysses layers only "
                            "(search_engine.py parallelism_optimization)", "use sp_search 3 for a mix.")
        want = "megatron" if self.acc.sp else "none"
        if s.tp > 1 and not s.ulysses and s.sp != want:
            raise bad_value(f"layers[{layer}]: sp={s.sp!r}", f"Galvatron applies Megatron-SP to every tp layer or "
                            f"none (--sequence_parallel); this model was built with sequence_parallel={self.acc.sp}",
                            f"use sp={want!r} on tp > 1 layers, or build the model to match.")
        if s.data_group > 1 and s.zero not in (self.default_zero, 3):
            raise bad_value(f"layers[{layer}]: zero={s.zero}", f"Galvatron's layers take its default DP type "
                            f"(ZeRO-{self.default_zero}) or ZeRO-3", f"use zero {self.default_zero} or 3.")
        if not self.min_tp <= s.tp <= self.max_tp:
            raise bad_value(f"layers[{layer}]: tp={s.tp}", f"outside this search context's tp range "
                            f"[{self.min_tp}, {self.max_tp}]", "price it with a model of a context that holds it.")

    def _end(self, s: LayerStrategy) -> tuple[int, bool, bool]:
        """(vtp, vsp, embed_sdp) of an end strategy; vsp is Ulysses over vtp > 1 or a SequenceSplitEnd at vtp 1."""
        if s.sp not in ("none", "ulysses") or s.ep > 1 or not self.min_tp <= s.tp <= self.max_tp:
            raise bad_value(f"end strategy {s.short()}", f"Galvatron's ends take vtp in [{self.min_tp}, "
                            f"{self.max_tp}], optionally sequence-split (vsp)", "use end_strategies of search_space().")
        if s.data_group > 1 and s.zero not in (self.default_zero, 3):
            raise bad_value(f"end zero={s.zero}", f"Galvatron's ends take ZeRO-{self.default_zero} or ZeRO-3 "
                            "(embed_sdp)", f"use zero {self.default_zero} or 3.")
        vsp = is_sequence_split(s)
        if vsp != (self.sp_search == 2) and self.sp_search != 3:
            raise bad_value(f"end strategy {s.short()}", f"context sp_search {self.sp_search} (sp_space "
                            f"{self.sp_space!r}) takes {'only' if self.sp_search == 2 else 'no'} sequence-split ends "
                            "(vsp) (search_engine.py parallelism_optimization)",
                            "use end_strategies of search_space(), or sp_space='tp+sp' for vsp.")
        return s.tp, vsp, s.zero == 3 and s.data_group > 1

    # -- parts ------------------------------------------------------------------------------------------------
    def layer_cost(self, layer: int, s: LayerStrategy, ctx: StageContext) -> LayerCost:
        """Time as Galvatron's pipeline model takes it: ``fwd`` = the layer's compute for one micro-batch
        (forward + backward, with its tp and p2p traffic), ``step_extra`` = what its gradient reduction adds
        (cost_model.py TimeCostModel.gen_result with and without no_comm); memory per Galvatron's rules:
        ``act`` is what one of the schedule's in-flight micro-batches adds (under GPipe with a pipeline,
        Galvatron's one kept micro-batch divided by the m in flight)."""
        key = (self.model.layer_type_of[layer], s, ctx.stage_size, ctx.micro_batch)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        self._check_layer(layer, s)
        S, mb = ctx.stage_size, ctx.micro_batch
        pp, m, mbsz, chunks = self._batches(S, mb)
        real = len(torch_chunks(int(self.global_batch / (S // self.min_tp)), chunks)) if chunks > 1 else 1
        gchunk = self.global_batch / real
        comp = self.acc.layer_time(layer, s, pp, gchunk, True)
        full = self.acc.layer_time(layer, s, pp, gchunk, False)
        states = self.acc.layer_states_mb(layer, s, chunks) * MB
        if self.schedule == "gpipe" and pp > 1:
            # Galvatron keeps one (min_tp-group) micro-batch on every stage (MemoryCostModel.initialize); the
            # search multiplies `act` by the schedule's in-flight count (m for GPipe), so spread it over those
            samples = self.acc.act_samples(s, pp, 0, self.global_batch, mbsz, self.min_tp, "gpipe") / m
        else:
            samples = mb / s.dp  # 1F1B: one in-flight micro-batch of local samples
        act = self.acc.layer_act_mb(layer, s) * samples * MB
        hit = self._cache[key] = CeiledLayerCost(comp, 0.0, max(0.0, full - comp), states, act)
        return hit

    def transition_time(self, a: LayerStrategy, b: LayerStrategy, ctx: StageContext) -> float:
        """0: Galvatron's price of a plan has no re-layout cost (pipeline_costmodel sums the layers alone)."""
        return 0.0

    def _ends_parts(self, s: LayerStrategy, S: int, mb: int, schedule: str) -> tuple[tuple, tuple, list[float]]:
        """((states MB, act MB) first, (states MB, act MB) last, other time per stage) of end strategy ``s``."""
        vtp, vsp, esdp = self._end(s)
        pp, _, mbsz, chunks = self._batches(S, mb)
        first, last = self.acc.ends_memory(pp, S, self.global_batch, chunks, vtp, vsp, esdp, schedule)
        return first, last, self.acc.other_time(pp, vtp, vsp, esdp, mbsz, self.min_tp)

    def end_cost(self, s: LayerStrategy, ctx: StageContext, first: bool, last: bool,
                 vocab_parallel_loss: bool = False) -> LayerCost:
        """Galvatron's ends on the first / last stage (OtherTimeCostModel no-comm time, MemoryCostModel other
        memory without the context); activations of one micro-batch. A one-stage model's two ends share one
        table entry in Galvatron, so each alone is half of it."""
        S, mb = ctx.stage_size, ctx.micro_batch
        f, l_, times = self._ends_parts(s, S, mb, "gpipe")  # "gpipe": one micro-batch of the ends' activations
        if len(times) == 1:
            share = (0.5 if first else 0.0) + (0.5 if last else 0.0)
            return LayerCost(times[0] * share, 0.0, 0.0, f[0] * share * MB, f[1] * share * MB)
        t = (times[0] if first else 0.0) + (times[-1] if last else 0.0)
        states = (f[0] if first else 0.0) + (l_[0] if last else 0.0)
        act = (f[1] if first else 0.0) + (l_[1] if last else 0.0)
        return LayerCost(t, 0.0, 0.0, states * MB, act * MB)

    def stage_fixed(self, plan_embed: LayerStrategy, plan_head: LayerStrategy, ctx: StageContext,
                    vocab_parallel_loss: bool = False) -> tuple[float, float, float]:
        """The ends on this stage + Galvatron's 1 GB context + the Megatron-SP global buffer, rounded up to MB
        as its DP does (dynamic_programming.py: ``other_mem_cost`` ceil'ed, ``int(global_memory)`` added). The
        ends' activations follow the model's pipeline type, as :meth:`layer_cost` (whose contract keeps it
        blind to ``ctx.schedule``) does."""
        S, mb = ctx.stage_size, ctx.micro_batch
        first, last = ctx.stage == 0, ctx.stage == ctx.pp - 1
        t, mem = 0.0, CONTEXT_MB
        for present, s, is_first in ((first, plan_embed, True), (last, plan_head, False)):
            if not present:
                continue
            f, l_, times = self._ends_parts(s, S, mb, self.schedule)
            if len(times) == 1:  # one stage: each end half of its strategy's one-stage entry
                t += times[0] / 2
                mem += sum(f) / 2
            else:
                t += times[0] if is_first else times[-1]
                mem += sum(f if is_first else l_)
        _, _, mbsz, _ = self._batches(S, mb)
        return t, 0.0, (math.ceil(mem) + self.acc.global_buffer_mb(mbsz, self.min_tp, self.max_tp, self.sp_search)) * MB

    # -- whole plan ---------------------------------------------------------------------------------------------
    def evaluate(self, plan: ParallelPlan) -> PlanCost:
        """Per-stage parts as the search sums them; the step by Galvatron's pipeline formula (the same for
        1F1B and GPipe) over the stages' compute (layers without gradient reduction, plus the ends) and the
        layers' time with it (cost_model.py pipeline_costmodel). A plan with ``vocab_sp`` (vsp at vtp 1) is
        priced with its ends as :class:`~.space.SequenceSplitEnd`, as the search saw them."""
        if plan.global_batch is None:
            raise bad_value("global_batch=None", "Galvatron prices a fixed global batch", "set plan.global_batch.")
        if plan.global_batch != self.global_batch or plan.world_size != self.world_size:
            raise bad_value(f"global_batch={plan.global_batch}, world_size={plan.world_size}",
                            f"this model prices batch {self.global_batch} on {self.world_size} ranks",
                            "build a Galvatron24CostModel for the plan's batch and world.")
        if plan.pp > 1 and plan.pipeline_schedule != self.schedule:
            other = {v: k for k, v in PIPELINE_TYPES.items()}.get(plan.pipeline_schedule)
            raise bad_value(f"pipeline_schedule={plan.pipeline_schedule}", f"this model prices Galvatron's "
                            f"pipeline_type {self.pipeline_type!r} ({self.schedule}); Galvatron searches one "
                            "pipeline type at a time", f"build Galvatron24CostModel(..., pipeline_type={other!r})"
                            if other else "Galvatron has no interleaved schedule; use '1f1b' or 'gpipe'.")
        if len(plan.layers) != self.model.num_layers:
            raise bad_value(f"{len(plan.layers)} layers in plan", f"the profile has {self.model.num_layers}",
                            "evaluate the plan against the profile of the same model.")
        if not self.admits(plan.stage_size, plan.global_batch // plan.micro_batches):
            raise bad_value(f"pp={plan.pp}, micro_batches={plan.micro_batches}", f"Galvatron's model is undefined "
                            f"here in context min_tp={self.min_tp} (uneven micro-batches per min_tp group, or no "
                            "p2p coefficient)", "pick micro-batches dividing global_batch / (stage / min_tp).")
        if plan.vocab_sp:  # the flag is the plan's; the parts see it on the ends, as the search does
            assert plan.embed is not None and plan.head is not None
            plan = replace(plan, embed=SequenceSplitEnd.of(plan.embed), head=SequenceSplitEnd.of(plan.head),
                           vocab_sp=False)
        parts = super().evaluate(plan)
        assert plan.embed is not None and plan.head is not None
        mb = plan.global_batch // plan.micro_batches
        other = [self.stage_fixed(plan.embed, plan.head, StageContext(plan.stage_size, mb, plan.micro_batches,
                                                                      plan.pp, st))[0] for st in range(plan.pp)]
        comp = list(parts.stage_mb_time_s)
        full = [e + c - o for e, c, o in zip(parts.stage_extra_s, comp, other)]
        step = pipeline_step(comp, full, plan.micro_batches)
        return replace(parts, step_time_s=step)


@dataclass(frozen=True)
class ContextResult:
    """One search context of :func:`galvatron_search`: its best plan (None: nothing fits) and wall time."""

    min_tp: int
    max_tp: int
    plan: ParallelPlan | None
    wall_s: float
    sp_search: int = 1  # sp_space 'tp+sp': 2 Ulysses only, 3 any mix


@dataclass(frozen=True)
class GalvatronSearchResult:
    """The fastest plan over all contexts (under Galvatron's model), the context it came from, every context."""

    plan: ParallelPlan | None
    context: tuple[int, ...] | None  # (min_tp, max_tp), plus sp_search under sp_space 'tp+sp'
    contexts: tuple[ContextResult, ...]
    wall_s: float


def galvatron_search(model: ModelProfile | ModelShape, hw: HardwareProfile, ghw: GalvatronHardware,
                     memory_gb: float, global_batch: int, *, sequence_parallel: bool = False,
                     default_dp_type: str = "zero2", max_tp: int = 8, top_k: int = 3, grid_mb: float = 4.0,
                     refine_mb: float | None = None, contexts: Sequence[tuple[int, ...]] | None = None,
                     sp_space: str = "tp", pipeline_type: str = "pipedream_flush",
                     **space: object) -> GalvatronSearchResult:
    """Our search under Galvatron 2.4's cost model: once per search context ``(min_tp, max_tp)``, as Galvatron's
    own search loops them (search_engine.py parallelism_optimization), keeping the fastest plan that fits
    Galvatron's usable memory. ``hw`` (our hardware profile of the same cluster) only serves the guideline
    pruning (tp inside a node); prices come from ``ghw``. ``space`` overrides fields of the search space.

    Memory is searched on a ``grid_mb`` grid, rounding every layer up (fast, conservative); with ``refine_mb``
    the best context's top configurations (pipeline degree, micro-batches) are searched again on that finer
    grid -- Galvatron's own is 1 MB, and its plans can leave less than a coarse grid's rounding free
    (gpt-2.7b 2x8 24 GB: 0.9995 of Galvatron's throughput on the 4 MB grid, 1.0000 with ``refine_mb=1``, at
    about twice the search time; off by default, benchmarks/vs_galvatron.py runs without it).

    ``sp_space='tp+sp'`` searches Galvatron's other layer space (Ulysses per layer, sequence-split ends) over
    the contexts of :func:`galvatron_contexts`; ``contexts`` may then name (min_tp, max_tp[, sp_search]).
    ``pipeline_type`` is Galvatron's: 'pipedream_flush' (1F1B) or 'gpipe' (plans with pp > 1 take it)."""
    from .search import search

    if not isinstance(model, ModelProfile):
        raise TypeError(f"model={type(model).__name__}: expected a ModelProfile with Galvatron's end tables. "
                        "HINT: compat.galvatron.read_model_profile(...).")
    t0 = time.perf_counter()
    world = ghw.world
    memo = FrontsMemo()  # the contexts' stages repeat each other's layer DPs (same costs, other capacities)
    out: list[ContextResult] = []
    tops_of: list[list[ParallelPlan]] = []
    default_sps = 3 if sp_space == "tp+sp" else 1
    ctxs = [(c[0], c[1], c[2] if len(c) > 2 else default_sps)  # type: ignore[misc]
            for c in (contexts or galvatron_contexts(world, max_tp, sequence_parallel, sp_space))]
    for lo, hi, sps in ctxs:
        c0 = time.perf_counter()
        cost = Galvatron24CostModel(model, ghw, memory_gb, global_batch, lo, hi, sequence_parallel, default_dp_type,
                                    sp_space, sps, pipeline_type)
        try:
            res = search(model, hw, world, cost.usable_bytes, global_batch=global_batch, top_k=top_k,
                         space=cost.search_space(grid_mb, **space), cost_model=cost, memory_margin=0.0, memo=memo)
            plan = max(res, key=lambda p: p.prediction.throughput)  # type: ignore[union-attr]
            tops_of.append(list(res))
        except ValueError as exc:
            if "no plan fits" not in str(exc) and "no pipeline configuration" not in str(exc):
                raise
            plan = None
            tops_of.append([])
        out.append(ContextResult(lo, hi, plan, time.perf_counter() - c0, sps))
    def faster(a: ParallelPlan | None, b: ParallelPlan | None) -> bool:
        return a is not None and (b is None or a.prediction.throughput > b.prediction.throughput)  # type: ignore[union-attr]

    if refine_mb is not None and refine_mb < grid_mb:
        for i, c in enumerate(out):
            if c.plan is None or any(faster(o.plan, c.plan) for o in out):
                continue
            c0 = time.perf_counter()
            cost = Galvatron24CostModel(model, ghw, memory_gb, global_batch, c.min_tp, c.max_tp, sequence_parallel,
                                        default_dp_type, sp_space, c.sp_search, pipeline_type)
            tops = tops_of[i]
            fine = search(model, hw, world, cost.usable_bytes, global_batch=global_batch, top_k=1,
                          space=cost.search_space(refine_mb, **{**space, "pp_degrees": tuple(sorted({p.pp for p in tops})),
                                                                "micro_batches": tuple(sorted({p.micro_batches
                                                                                               for p in tops}))}),
                          cost_model=cost, memory_margin=0.0, memo=memo)[0]
            out[i] = replace(c, plan=fine if faster(fine, c.plan) else c.plan, wall_s=c.wall_s + time.perf_counter() - c0)
            break
    if pipeline_type == "gpipe":  # Galvatron writes its --pipeline_type into every plan, one-stage plans too
        # (search_engine.py save_results); the search labels those 1F1B, which prices the same at pp 1
        out = [replace(c, plan=replace(c.plan, pipeline_schedule="gpipe"))
               if c.plan is not None and c.plan.pp == 1 else c for c in out]
    best = None
    for c in out:  # strict '>': the first context in search order wins ties (search_engine.py)
        if c.plan is not None and (best is None or c.plan.prediction.throughput >  # type: ignore[union-attr]
                                   best.plan.prediction.throughput):  # type: ignore[union-attr]
            best = c
    where = None
    if best is not None:
        where = (best.min_tp, best.max_tp) + ((best.sp_search,) if sp_space == "tp+sp" else ())
    return GalvatronSearchResult(best.plan if best else None, where, tuple(out), time.perf_counter() - t0)
