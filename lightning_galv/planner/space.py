"""What the search may choose from: the search space and the strategies it enumerates per stage.

The per-layer strategy space of a stage (Galvatron VLDB'23, Galvatron-BMW TKDE'24) is every tp x dp
factorization of the stage's ranks, Megatron or Ulysses sequence parallelism, a ZeRO stage,
activation checkpointing and the tp rank order -- a decision tree, enumerated here and pruned:
Galvatron's guideline rules (tp inside a node, consecutive tp groups; ``heuristic_pruning``) here,
and an exact dominance rule (a strategy slower *and* larger than another with the same activation
layout can never be part of an optimum) in the searcher, once costs are known
(:func:`~lightning_galv.planner.pareto.pareto_keep`). The embedding and the head have a smaller space
of their own (:func:`end_strategies`): what the runtime can apply to them.

Expert parallelism is one more dimension of the same tree, searched jointly with the others: for a
model with MoE layer types every (tp, dp, sp, rank order) node branches into each ep that divides the
layer's data group and some layer type's expert count (:func:`candidate_strategies` with ``experts``).
The strategy list is shared by all layer types of a stage; a strategy with ep > 1 simply does not apply
to a layer type without experts (or whose expert count it does not divide, :func:`applies`), and the
searcher gives such pairs no finite cost. A dense model enumerates exactly what it did before.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import bad_value
from typing import Sequence

from ..plan import SCHEDULES, SP_MODES, LayerStrategy, ModelShape, divisors
from .profiles import HardwareProfile, LayerTypeProfile


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose from. Defaults: the full space."""

    max_tp: int | None = None  # None: up to the stage size
    max_pp: int | None = None
    pp_degrees: tuple[int, ...] | None = None  # None: every divisor of the world size
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b")
    virtual_stages: tuple[int, ...] = (2,)
    micro_batches: tuple[int, ...] | None = None  # None: every divisor of the global batch
    max_micro_batches: int | None = None
    sp_modes: tuple[str, ...] = SP_MODES
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    checkpoint: tuple[bool, ...] = (False, True)
    tp_consecutive: tuple[bool, ...] = (True, False)
    uniform: bool = False  # one strategy for every layer (the "3-D" space)
    uneven_partition: bool = True
    heuristic_pruning: bool = True
    memory_bins: int = 2048
    embed_tp: int | None = None  # vocabulary-parallel degree of embedding and head; None: searched
    embed_zero: int | None = None  # ZeRO stage of embedding and head; None: searched over zero_stages
    vocab_padding: bool = False  # allow vocab-parallel degrees that do not divide the vocabulary (Megatron pads it)
    vocab_parallel_loss: bool = False  # the loss takes vocab-sharded logits: priced, and set on the emitted plans
    ep_degrees: tuple[int, ...] | None = None  # expert-parallel degrees of MoE layers; None: every valid one
    # Galvatron's search context (search_engine.py parallelism_optimization): layer and vocabulary tp degrees
    # from min_tp to max_tp. It changes what Galvatron's cost model charges (its micro-batch size is the one
    # of a min_tp-wide group), so a Galvatron-compatible search runs once per context.
    min_tp: int = 1
    tied_ends: bool = False  # one strategy for embedding and head, as Galvatron's one vtp / vsp / embed_sdp
    # whether the ends are sequence-split (Galvatron's vsp, sp_space 'tp+sp': sp='ulysses' over the vtp group,
    # weights replicated, ZeRO over the whole stage; at vtp 1 a SequenceSplitEnd, emitted as
    # ParallelPlan.vocab_sp, tied ends only). Our runtime cannot run such ends: a Galvatron-model option.
    vocab_sp: tuple[bool, ...] = (False,)

    def __post_init__(self) -> None:
        if isinstance(self.min_tp, bool) or not isinstance(self.min_tp, int) or self.min_tp < 1 or \
                (self.max_tp is not None and self.min_tp > self.max_tp):
            raise bad_value(f"min_tp={self.min_tp}, max_tp={self.max_tp}", "min_tp must be a positive int <= max_tp",
                            "e.g. min_tp=1 (every degree) or min_tp=2, max_tp=8.")
        if self.ep_degrees is not None:
            bad = [k for k in self.ep_degrees if isinstance(k, bool) or not isinstance(k, int) or k < 1]
            if bad or 1 not in self.ep_degrees:
                raise bad_value(f"ep_degrees={self.ep_degrees}", "must be positive ints and include 1",
                                "ep=1 is what dense layers take; e.g. ep_degrees=(1, 2, 4, 8).")
        for s in self.schedules:
            if s not in SCHEDULES:
                raise bad_value(f"schedule={s}", f"must be one of {SCHEDULES}", "e.g. schedules=('1f1b',).")
        for s in self.sp_modes:
            if s not in SP_MODES:
                raise bad_value(f"sp_mode={s}", f"must be one of {SP_MODES}", "e.g. sp_modes=('none', 'megatron').")
        for z in self.zero_stages:
            if z not in (0, 1, 2, 3):
                raise bad_value(f"zero={z}", "ZeRO stages are 0..3", "e.g. zero_stages=(0, 2, 3).")
        if not self.zero_stages or not self.schedules or not self.checkpoint or not self.tp_consecutive:
            raise bad_value(self, "zero_stages, schedules, checkpoint and tp_consecutive need >= 1 choice",
                            "leave a field at its default to search it.")
        if not self.vocab_sp or any(not isinstance(v, bool) for v in self.vocab_sp):
            raise bad_value(f"vocab_sp={self.vocab_sp}", "must be a non-empty tuple of bools",
                            "use (False,) (default), (True,) or (False, True).")
        if self.memory_bins < 16:
            raise bad_value(f"memory_bins={self.memory_bins}", "must be >= 16", "use 2048 (default) or more.")

    @property
    def default_embed_zero(self) -> int:
        """ZeRO stage of the embedding and head when it is not searched (``embed_tp``/``embed_zero`` set,
        and the default cost model's): the highest allowed stage up to 2, since ZeRO-3 would gather
        those usually largest weights again on every micro-batch."""
        if self.embed_zero is not None:
            return self.embed_zero
        return max([z for z in self.zero_stages if z <= 2] or [min(self.zero_stages)])

    @classmethod
    def three_d(cls, zero: int = 2, **kw: object) -> "SearchSpace":
        """Galvatron's "3-D" space: one (pp, tp, dp) for all layers, one ZeRO stage, no SP or recomputation.
        The vocabulary's tp degree is searched on its own, as Galvatron searches vtp beside the layers' tp
        (search_engine.py: vtp from min_tp to max_tp); ``embed_tp=`` fixes it."""
        return cls(sp_modes=("none",), zero_stages=(zero,), checkpoint=(False,), tp_consecutive=(True,),
                   uniform=True, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SequenceSplitEnd(LayerStrategy):
    """An end strategy with Galvatron's ``vsp`` on a vocab-tp-1 end: the plan-level flag
    :attr:`~lightning_galv.plan.ParallelPlan.vocab_sp`, carried by the end strategy while the search runs.

    Why a type of its own: a :class:`LayerStrategy` cannot say it (Ulysses needs ``tp > 1``), yet Galvatron's
    search proposes vsp with any vtp its context allows, 1 included (search_engine.py parallelism_optimization
    loops vsp beside vtp = min_tp..max_tp), and prices it apart from no vsp -- the ends' gradient traffic is
    sized by the last stage's one-way table (cost_model.py OtherTimeCostModel.estimate_dp_time), and the plan
    enters the Ulysses-only context (sp_search 2), the only one without Megatron-SP's global buffer. It
    compares unequal to the plain strategy of the same fields (dataclass equality checks the class), so
    the search's caches keep both apart; the search emits it as a plain end plus ``vocab_sp=True``
    (:meth:`plain`). Our runtime ignores the flag: a 1-way sequence split is no split.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tp != 1 or self.sp != "none":
            raise bad_value(f"SequenceSplitEnd({self.short_dims()})", "marks vsp on a vocab-tp-1 end only",
                            "use LayerStrategy(tp=vtp, sp='ulysses') for a sequence-split end with vtp > 1.")

    @classmethod
    def of(cls, s: LayerStrategy) -> "SequenceSplitEnd":
        """The sequence-split form of the tp-1 end ``s``."""
        return cls(**s.to_dict())

    def plain(self) -> LayerStrategy:
        """The same end as a plain :class:`LayerStrategy` (what a :class:`ParallelPlan` holds)."""
        return LayerStrategy(**self.to_dict())

    def short(self) -> str:
        return super().short() + "·vsp"


def is_sequence_split(s: LayerStrategy) -> bool:
    """Whether end strategy ``s`` is sequence-split (Galvatron's vsp): Ulysses over vtp > 1, or a
    :class:`SequenceSplitEnd` at vtp 1."""
    return s.ulysses or isinstance(s, SequenceSplitEnd)


def applies(layer: LayerTypeProfile, s: LayerStrategy) -> bool:
    """Whether ``s`` can be applied to a layer of this type: expert parallelism needs the layer's experts,
    and as many of them on every EP rank (the runtime's rule, ``parallel/expert.py check_ep``)."""
    if s.ep == 1:
        return True
    return layer.moe is not None and layer.moe.num_experts % s.ep == 0


def ep_degrees(data_group: int, experts: Sequence[int], space: SearchSpace) -> list[int]:
    """Expert-parallel degrees a strategy with this data group may take: 1, and every divisor of the data
    group (EP is carved out of it, Megatron-LM / DeepSpeed-MoE) that divides some MoE layer's expert count."""
    out = [k for k in divisors(data_group) if k == 1 or any(e % k == 0 for e in experts)]
    if space.ep_degrees is not None:
        out = [k for k in out if k in space.ep_degrees]
    return out


def candidate_strategies(shape: ModelShape, stage_size: int, micro_batch: int, space: SearchSpace,
                         hw: HardwareProfile | None = None, experts: Sequence[int] = ()) -> list[LayerStrategy]:
    """Every per-layer strategy of a stage that is valid for this model and micro-batch.

    With ``space.heuristic_pruning`` (Galvatron VLDB'23 Sec. 3.2 guidelines): tensor/sequence groups
    stay inside a node, and tp groups are consecutive ranks. ``experts``: the expert counts of the model's
    MoE layer types (``ModelProfile.num_experts``); with none, every strategy has ep = 1. Expert-parallel
    groups are not pruned by a guideline: whether an all-to-all across nodes pays off is what the cost
    model decides, and dominated ep options are dropped by the exact rule like any other.
    """
    out: list[LayerStrategy] = []
    max_tp = space.max_tp or stage_size
    for tp in divisors(stage_size):
        dp = stage_size // tp
        if tp > max_tp or tp < space.min_tp or micro_batch % dp:
            continue
        for sp in (("none",) if tp == 1 else space.sp_modes):
            need = [shape.num_heads, shape.num_kv_heads]
            if sp != "ulysses":
                need.append(shape.ffn_hidden)
            if sp != "none":
                need.append(shape.seq_len)
            if any(n % tp for n in need):
                continue
            consecs = (True,) if tp == 1 or dp == 1 else space.tp_consecutive
            for consec in consecs:
                if space.heuristic_pruning and tp > 1:
                    if not consec:
                        continue
                    if hw is not None and not hw.is_intra_node(tp, 1) and dp > 1:
                        continue
                d = dp * tp if sp == "ulysses" else dp
                for ep in (ep_degrees(d, experts, space) if experts else (1,)):
                    for zero in ((0,) if d == 1 else space.zero_stages):
                        for ck in space.checkpoint:
                            out.append(LayerStrategy(tp, dp, sp, zero, ck, consec, ep))
    return out


def end_strategies(shape: ModelShape, stage_size: int, micro_batch: int, space: SearchSpace,
                   hw: HardwareProfile | None = None) -> list[LayerStrategy]:
    """Strategies the embedding and the head may take on a stage of ``stage_size`` ranks.

    What the runtime supports (parallel/tensor.py apply_tp_embedding / apply_tp_head, plan rules):
    vocab-parallel degree tp (no sequence parallelism, consecutive ranks) times data parallel dp
    with any ZeRO stage. A fixed ``embed_tp`` keeps the old behaviour: that degree, raised to the
    next divisor when the micro-batch is too small to split. With ``heuristic_pruning`` and ``hw``,
    vocab-parallel groups stay inside a node, as the layers' tp groups do. ``vocab_sp`` adds (or, with
    ``(True,)``, keeps only) Galvatron's sequence-split ends, which only its cost model prices: Ulysses ends
    for vtp > 1 and, with ``tied_ends`` (the plan has one ``vocab_sp`` flag), :class:`SequenceSplitEnd` for
    vtp 1 -- so the space holds every (vtp, vsp) pair Galvatron's search visits.
    """
    S, mb, sp, vocab = stage_size, micro_batch, space, shape.vocab_size
    out: list[LayerStrategy] = []
    for vtp in divisors(S):
        dp = S // vtp
        if mb % dp or vtp < sp.min_tp or (vtp > 1 and vocab % vtp and not sp.vocab_padding):
            continue
        if sp.embed_tp is not None:
            if vtp < sp.embed_tp and S % sp.embed_tp == 0:
                continue
        elif vtp > (sp.max_tp or S) or (sp.heuristic_pruning and vtp > 1 and hw is not None
                                        and not hw.is_intra_node(vtp, 1)):
            continue
        for vsp in sp.vocab_sp:
            if vsp and vtp == 1 and not sp.tied_ends:  # vocab_sp is one flag for both ends of a plan
                continue
            group = S if vsp else dp
            zeros = (0,) if group == 1 else (sp.default_embed_zero,) if sp.embed_tp is not None or \
                sp.embed_zero is not None else sp.zero_stages
            if vsp and vtp == 1:  # Galvatron's vsp at vtp 1: no LayerStrategy of ours (Ulysses needs tp > 1)
                out += [SequenceSplitEnd(tp=1, dp=dp, zero=z) for z in zeros]
            else:
                out += [LayerStrategy(tp=vtp, dp=dp, sp="ulysses" if vsp else "none", zero=z) for z in zeros]
        if sp.embed_tp is not None:
            break
    return out
