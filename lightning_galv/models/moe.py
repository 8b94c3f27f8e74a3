"""A Mixture-of-Experts decoder (Mixtral / Qwen-MoE style) that follows the block protocol.

The model is the LLaMA decoder of :mod:`.llama` in which some blocks replace the SwiGLU feed-forward by
a sparse :class:`MoELayer`. Dense blocks *are* :class:`~.llama.LlamaBlock`; MoE blocks reuse
:class:`~.llama.LlamaAttention` and :class:`~.llama.SwiGLU`, so attention gets tensor / sequence
parallelism exactly as in a dense block (same ``galv_tp_plan`` entries, same ``galv_attention``).

Design choices, and why
=======================

**Router.** ``softmax(x W_r)`` over E experts in at least fp32, top-k with k in {1, 2}. For k = 2 the two
kept probabilities are renormalized to sum to one (Mixtral: a softmax over the top-k logits is exactly
that), so the expert mix does not shrink when the router is unsure; ``renormalize=False`` keeps the raw
probabilities (Qwen1.5-MoE's ``norm_topk_prob=False``). For k = 1 the raw probability is always kept
(Switch Transformer): renormalizing one weight would make it 1 and cut the router off from the LM loss.

**Experts** are an ``nn.ModuleList`` of :class:`~.llama.SwiGLU`, not stacked ``[E, ...]`` parameters:

* expert parallelism (each of k EP ranks holding E/k experts) then means *keeping a subset of the
  modules* and replacing the others by placeholders, as pipeline stages already do, so every state-dict
  key names a global expert id (``layers.1.moe.experts.5.w1.weight``) under every ep degree:
  resharding a checkpoint between ep=k, ep=j, dense DP and one process is "which rank loads which key",
  with no tensor slicing;
* ZeRO (FSDP2 ``fully_shard`` per module) and the replicated-gradient sync take expert modules and
  parameters as they take any other, over whatever expert-data group the runtime gives them;
* the key layout is Hugging Face Mixtral's (``experts.{i}.w1/w2/w3``), so weights map one to one.

The price is a Python loop over the local experts (no grouped GEMM); at the sizes this package trains
on CPU that loop is not the bottleneck, and a grouped kernel can stack the local weights on the fly.
Every expert runs every step, on an empty ``[0, hidden]`` chunk if no token chose it, so each expert
parameter always gets a (possibly zero) gradient: gradient sync and ZeRO never see a missing gradient.

**Dispatch** goes through a dispatcher object (:class:`TokenDispatcher`): ``dispatch`` sorts the kept
(token, expert) assignments by expert id (stable, so tokens keep their order within an expert) and
hands back contiguous per-expert chunks with their split sizes; ``combine`` undoes the permutation.
:class:`LocalDispatcher` does this within one process; an all-to-all dispatcher (expert parallelism)
implements the same two calls with ``all_to_all_single`` in between, and the layer does not change.

**Dropless by default.** ``capacity_factor=None`` processes every assignment. With a capacity factor
``cf`` each expert takes at most ``capacity = ceil(cf * T * k / E)`` assignments of the ``T`` tokens of
this forward (the local ``[batch * seq]`` tokens, row-major: sample by sample, position by position).
An expert keeps the *first* ``capacity`` tokens that chose it in that token order and drops the rest;
a dropped assignment contributes zero (the other expert of a k = 2 token still contributes, with its
weight unchanged) and the block's residual carries the token through. The rule is deterministic, but it
depends on which tokens a forward sees: under data / sequence parallelism or micro-batching each rank
drops from its own tokens, so only dropless routing is plan-invariant (parity tests use it).

**Auxiliary losses** (per MoE layer, per forward):

* load balancing (Switch / GShard): ``aux = E * sum_e f_e * P_e`` with ``f_e`` the fraction of the
  ``T * k`` routed assignments that chose expert e (before capacity dropping, as in Switch) and ``P_e``
  the mean router probability of expert e; 1.0 when perfectly balanced. ``f_e`` is not differentiable,
  ``P_e`` is, so the gradient pushes probability away from over-used experts;
* router z-loss (ST-MoE): ``z = mean_t logsumexp(logits_t)^2``, keeping router logits small.

Both are built from *sums* (:class:`RouterSums`: assignments per expert, router probability per expert,
``sum_t lse_t^2``, token count) that first pass through the layer's ``stats_reducer`` (identity by
default). A runtime that wants the global loss (independent of which rank holds which sample) plugs in
an all-reduce there, e.g. :class:`AllReduceStatsReducer`; in one process the result is the plain formula.

**How the aux losses reach the gradient.** Each MoE layer attaches ``aux_loss_weight * aux +
z_loss_weight * z`` to its output with :class:`AttachAuxLoss` (Megatron's ``MoEAuxLossAutoScaler``
idea): forward returns the hidden state unchanged, backward passes the hidden-state gradient through and
gives the aux scalar the gradient ``aux_grad_scale``. So the aux gradient is injected during the normal
backward of whatever loss the last pipeline stage computes, on the stage that owns the layer, without
shipping aux tensors between stages, and the loss the module returns stays the pure cross entropy (aux
values are logged separately, :meth:`MoEDecoder.aux_losses`). Scaling: the injected gradient must be
scaled like the LM loss. Lightning divides the loss by ``accumulate_grad_batches``, so
:class:`~lightning_galv.demo.module.CausalLM` sets ``aux_grad_scale = 1 / accumulate_grad_batches`` each batch;
a ``torch.distributed.pipelining`` schedule divides *all* gradients by its micro-batch count afterwards
(``scale_grads=True``), which covers the injected part too. Net effect: the aux term optimized is the mean
over micro-batches of each micro-batch's aux loss, the same convention as the LM loss.

**Routing statistics** (:class:`RoutingStats`, frozen, plain ints): every forward stores
``layer.last_stats``; if the model's :class:`RoutingLog` is enabled, it is also appended there for a
callback to drain. No collective; the only host reads are of ``[E]`` count vectors, right after the one the
dispatch needs for its split sizes anyway. A forward that runs inside a backward pass is an
activation-checkpoint recompute and records nothing, so every micro-batch appears once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, Callable, Literal, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..plan import ModelShape
from .common import RMSNorm, Rotary, init_weights
from .dropout import KeyedDropout, assign_sites
from .llama import DecoderLayout, LlamaAttention, LlamaBlock, LlamaConfig, SwiGLU

__all__ = ["MoEConfig", "MoEShape", "MoEDecoder", "MoEBlock", "MoELayer", "RouterSums", "RouterStatsReducer",
           "LocalStatsReducer", "AllReduceStatsReducer", "RoutingStats", "RoutingLog", "TokenDispatcher",
           "LocalDispatcher", "DispatchResult", "AttachAuxLoss", "capacity_for"]


# ---------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------
def _bad(what: str, rule: str, hint: str) -> ValueError:
    return ValueError(f"MoEConfig({what}): {rule}. HINT: {hint}")


@dataclass
class MoEConfig:
    """Size of an MoE decoder. Dense fields mean what they mean in :class:`~.llama.LlamaConfig`."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128  # SwiGLU width of the dense blocks
    max_seq_len: int = 64
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    dropout: float = 0.0  # residual dropout after attention and feed-forward (keyed: same mask under any plan)
    num_experts: int = 4
    top_k: int = 2  # 1 (Switch) or 2 (Mixtral / GShard)
    expert_hidden: int | None = None  # SwiGLU width of each routed expert; None = ffn_hidden
    renormalize: bool = True  # k = 2: rescale the two kept probabilities to sum to 1 (Mixtral)
    shared_expert_hidden: int = 0  # > 0 adds an always-on shared SwiGLU expert of this width (Qwen-MoE)
    shared_expert_gate: bool = True  # shared output scaled by sigmoid(x w_g) (Qwen-MoE); False = plain sum
    moe_every: int = 1  # layer i is MoE when (i + 1) % moe_every == 0 (Qwen-MoE's decoder_sparse_step)
    moe_layers: tuple[int, ...] | None = None  # explicit MoE layer indices; overrides moe_every
    capacity_factor: float | None = None  # None = dropless; else capacity = ceil(cf * tokens * k / E)
    aux_loss_weight: float = 0.01  # load-balancing loss weight (Switch uses 1e-2)
    z_loss_weight: float = 0.001  # router z-loss weight (ST-MoE uses 1e-3)

    def __post_init__(self) -> None:
        if self.moe_layers is not None:
            self.moe_layers = tuple(int(i) for i in self.moe_layers)  # YAML / JSON give lists
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError naming the value, the rule and a hint for the first violated rule."""
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise _bad(f"dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}",
                       "dim must be divisible by n_heads and n_heads by n_kv_heads", "e.g. dim=64, n_heads=4, "
                       "n_kv_heads=2")
        if self.n_layers < 1:
            raise _bad(f"n_layers={self.n_layers}", "needs at least one layer", "n_layers=4")
        if self.num_experts < 1:
            raise _bad(f"num_experts={self.num_experts}", "needs at least one expert", "num_experts=8")
        if self.top_k not in (1, 2):
            raise _bad(f"top_k={self.top_k}", "top_k must be 1 (Switch) or 2 (Mixtral)", "top_k=2")
        if self.top_k > self.num_experts:
            raise _bad(f"top_k={self.top_k}, num_experts={self.num_experts}",
                       "top_k cannot exceed num_experts (a token picks k distinct experts)",
                       f"top_k=1 or num_experts>={self.top_k}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise _bad(f"capacity_factor={self.capacity_factor}", "capacity_factor must be > 0 (or None for "
                       "dropless routing)", "capacity_factor=1.25, or None to drop no token")
        hidden = self.expert_hidden if self.expert_hidden is not None else self.ffn_hidden
        if hidden < 1 or self.ffn_hidden < 1:
            raise _bad(f"ffn_hidden={self.ffn_hidden}, expert_hidden={self.expert_hidden}",
                       "feed-forward widths must be >= 1", "expert_hidden=ffn_hidden // top_k keeps active "
                       "compute close to the dense model")
        if self.shared_expert_hidden < 0:
            raise _bad(f"shared_expert_hidden={self.shared_expert_hidden}", "must be >= 0 (0 = no shared "
                       "expert)", "shared_expert_hidden=0 or e.g. 2 * expert_hidden")
        if self.aux_loss_weight < 0 or self.z_loss_weight < 0:
            raise _bad(f"aux_loss_weight={self.aux_loss_weight}, z_loss_weight={self.z_loss_weight}",
                       "loss weights must be >= 0", "aux_loss_weight=0.01, z_loss_weight=0.001 (0 disables)")
        if self.moe_layers is not None:
            bad = [i for i in self.moe_layers if not 0 <= i < self.n_layers]
            if bad:
                raise _bad(f"moe_layers={self.moe_layers}", f"indices {bad} are outside 0..{self.n_layers - 1} "
                           f"(n_layers={self.n_layers})", f"use block indices in range({self.n_layers})")
            if len(set(self.moe_layers)) != len(self.moe_layers):
                raise _bad(f"moe_layers={self.moe_layers}", "indices must be distinct", "list each MoE block once")
        elif not 1 <= self.moe_every <= self.n_layers:
            raise _bad(f"moe_every={self.moe_every}", f"must be in 1..n_layers={self.n_layers} (layer i is MoE "
                       "when (i + 1) % moe_every == 0)", "moe_every=1 (all MoE) or 2 (every other layer), or "
                       "give moe_layers explicitly")

    @property
    def expert_width(self) -> int:
        return self.expert_hidden if self.expert_hidden is not None else self.ffn_hidden

    def moe_layer_ids(self) -> tuple[int, ...]:
        """Sorted indices of the MoE blocks."""
        if self.moe_layers is not None:
            return tuple(sorted(self.moe_layers))
        return tuple(i for i in range(self.n_layers) if (i + 1) % self.moe_every == 0)

    def llama_config(self) -> LlamaConfig:
        """The dense part: attention and the dense blocks are exactly a LLaMA of these sizes."""
        return LlamaConfig(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, ffn_hidden=self.ffn_hidden, max_seq_len=self.max_seq_len,
                           norm_eps=self.norm_eps, rope_theta=self.rope_theta, dropout=self.dropout)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MoEShape:
    """MoE facts a cost model needs beyond :class:`~lightning_galv.plan.ModelShape` (which describes the
    dense blocks; its ``ffn_hidden`` is the dense width). Pure data: no torch."""

    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    expert_hidden: int
    shared_expert_hidden: int
    capacity_factor: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def capacity_for(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments one expert may take in a forward of ``tokens`` tokens: ``ceil(cf * tokens * k / E)``."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


# ---------------------------------------------------------------------------------------------------
# router statistics and their reduction (the hook for globally reduced aux losses)
# ---------------------------------------------------------------------------------------------------
@dataclass
class RouterSums:
    """Additive router statistics of one forward; every field is a sum over tokens, so sums from several
    ranks add up to the sums of their union.

    ``counts`` and ``tokens`` are integers (no gradient); ``prob_sum`` and ``z_sum`` carry the router's
    autograd graph, so a reduction over ranks must be differentiable to keep the aux-loss gradient.
    """

    counts: torch.Tensor  # [E] int64: routed (token, expert) assignments per expert, before capacity
    prob_sum: torch.Tensor  # [E] float: sum over tokens of the router probability of each expert
    z_sum: torch.Tensor  # [] float: sum over tokens of logsumexp(logits)^2
    tokens: torch.Tensor  # [] int64: number of tokens


class RouterStatsReducer(Protocol):
    """Maps the local :class:`RouterSums` of a layer to the sums the aux losses are formed from.

    A reducer that communicates may also offer ``start(sums) -> finish`` (:class:`AsyncStatsReducer`): the
    layer then starts the reduction right after routing and calls ``finish()`` for the result after its
    experts ran, so the collective hides behind the expert work instead of making every rank wait for the
    slowest one at that point of the forward."""

    def __call__(self, sums: RouterSums) -> RouterSums: ...


@runtime_checkable
class AsyncStatsReducer(Protocol):
    """A :class:`RouterStatsReducer` whose reduction can run while the layer's experts compute."""

    def __call__(self, sums: RouterSums) -> RouterSums: ...

    def start(self, sums: RouterSums) -> Callable[[], RouterSums]: ...


class LocalStatsReducer:
    """The default: aux losses from this forward's own tokens (in one process, the plain formula)."""

    def __call__(self, sums: RouterSums) -> RouterSums:
        return sums


class AllReduceStatsReducer:
    """Sum the router statistics over ``group`` so the aux losses are those of the group's tokens together.

    Forward: every rank gets the group's sums (one collective for the counts, one for the float sums).
    The gradient w.r.t. the local ``prob_sum`` / ``z_sum`` depends on how the runtime combines the ranks'
    gradients, which ``grad`` states:

    * ``"sum"`` (data-parallel groups): every rank back-propagates the same global aux loss and the data
      code *averages* gradients over the group. The backward all-reduces (sums) the incoming gradients
      (what ``torch.distributed.nn.functional.all_reduce`` does), so rank r's parameters receive ``n`` times
      its own tokens' share, and the average over the ``n`` ranks is exactly the gradient of the global loss.
    * ``"identity"`` (ranks holding different sequence chunks of the same samples, e.g. Ulysses, whose
      parameter gradients are *summed*): the backward passes the gradient through unchanged, so the sum
      over the group is the gradient of the global loss.

    A runtime with both kinds of group chains two reducers. The group comes from the caller: this module
    keeps no process group of its own.
    """

    def __init__(self, group: Any, grad: Literal["sum", "identity"] = "sum") -> None:
        if grad not in ("sum", "identity"):
            raise ValueError(f"AllReduceStatsReducer(grad={grad!r}): must be 'sum' or 'identity'. HINT: 'sum' "
                             "for a data-parallel group, 'identity' for a sequence-parallel one.")
        self.group = group
        self.grad = grad

    def __call__(self, sums: RouterSums) -> RouterSums:
        import torch.distributed as dist

        ints = torch.cat([sums.counts, sums.tokens.reshape(1)])  # [E + 1] int64, one collective
        ints = ints.clone()
        dist.all_reduce(ints, group=self.group)
        floats = torch.cat([sums.prob_sum, sums.z_sum.reshape(1)])  # [E + 1], one differentiable collective
        floats = _AllReduceSum.apply(floats, self.group, self.grad == "sum")
        e = sums.counts.numel()
        return RouterSums(counts=ints[:e], prob_sum=floats[:e], z_sum=floats[e], tokens=ints[e])


class _AllReduceSum(torch.autograd.Function):
    """Forward: sum over ``group``. Backward: the sum of the incoming gradients over ``group``
    (``sum_grad=True``) or the incoming gradient unchanged (see AllReduceStatsReducer). Synchronous
    collectives on contiguous copies (gloo scrambles non-contiguous buffers)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sum_grad: bool) -> torch.Tensor:  # type: ignore[override]
        import torch.distributed as dist

        ctx.group, ctx.sum_grad = group, sum_grad
        out = x.detach().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        import torch.distributed as dist

        if ctx.sum_grad:
            grad = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


# ---------------------------------------------------------------------------------------------------
# routing statistics API
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutingStats:
    """What one MoE layer routed in one forward (one micro-batch). Plain ints: read-only and cheap to keep.

    ``source_expert_counts[r][e]`` counts the assignments that dispatch-group rank ``r`` sent to expert
    ``e``; a local dispatcher has one source (row 0 = ``tokens_per_expert``), an all-to-all dispatcher fills
    one row per rank of its group. ``expert_splits`` are the per-local-expert chunk sizes the experts ran
    on; ``send_splits`` / ``recv_splits`` the all-to-all split sizes (``None`` without an all-to-all).
    Invariants: ``sum(routed_per_expert) == tokens * top_k`` and ``sum(tokens_per_expert) ==
    tokens * top_k - dropped``.
    """

    layer: int  # block index in the model
    tokens: int  # tokens this forward routed (local batch * local sequence)
    top_k: int
    routed_per_expert: tuple[int, ...]  # [E] assignments chosen by the router (before capacity)
    tokens_per_expert: tuple[int, ...]  # [E] assignments the experts processed
    dropped_per_expert: tuple[int, ...]  # [E] assignments over capacity (all zero when dropless)
    source_expert_counts: tuple[tuple[int, ...], ...]  # [sources][E] processed assignments by source rank
    expert_splits: tuple[int, ...]  # chunk size per expert this rank computed
    send_splits: tuple[int, ...] | None = None
    recv_splits: tuple[int, ...] | None = None
    capacity: int | None = None  # None when dropless
    training: bool = True

    @property
    def num_experts(self) -> int:
        return len(self.routed_per_expert)

    @property
    def dropped(self) -> int:
        return sum(self.dropped_per_expert)

    def source_expert_tensor(self) -> torch.Tensor:
        """``source_expert_counts`` as a ``[sources, E]`` int64 tensor."""
        return torch.tensor(self.source_expert_counts, dtype=torch.int64)


class RoutingLog:
    """Collects :class:`RoutingStats` of every MoE layer, in forward order, while enabled.

    Off by default so a model nobody reads does not grow a list forever. A callback calls ``enable()``
    once and ``drain()`` per step (which returns everything since the last drain and clears it); under
    gradient accumulation or a pipeline a step holds one entry per layer per micro-batch.
    """

    def __init__(self) -> None:
        self.enabled = False
        self._entries: list[RoutingStats] = []

    def enable(self, on: bool = True) -> None:
        self.enabled = on
        if not on:
            self._entries.clear()

    def record(self, stats: RoutingStats) -> None:
        if self.enabled:
            self._entries.append(stats)

    def entries(self) -> tuple[RoutingStats, ...]:
        return tuple(self._entries)

    def drain(self) -> list[RoutingStats]:
        out, self._entries = self._entries, []
        return out

    def __len__(self) -> int:
        return len(self._entries)


# ---------------------------------------------------------------------------------------------------
# dispatcher boundary
# ---------------------------------------------------------------------------------------------------
@dataclass
class DispatchResult:
    """What ``dispatch`` hands the experts, and what ``combine`` needs to undo it."""

    expert_input: torch.Tensor  # [N, hidden] tokens grouped by local expert, contiguous chunks
    splits: list[int]  # chunk size per local expert (sum = N)
    state: Any  # dispatcher-private (permutation, all-to-all splits, ...)
    source_expert_counts: tuple[tuple[int, ...], ...]  # [sources][E]
    send_splits: tuple[int, ...] | None = None
    recv_splits: tuple[int, ...] | None = None


class TokenDispatcher(ABC):
    """Moves (token, expert) assignments to the experts that compute them and the results back.

    ``dispatch(x, expert_ids, token_ids)`` gets the local tokens ``x [T, hidden]`` and the kept
    assignments (``expert_ids[a]`` global expert id, ``token_ids[a]`` row of ``x``); it returns the inputs
    of this rank's experts ``local_experts`` (global ids) in contiguous chunks. ``combine(y, result)``
    gets their outputs in the same layout and returns ``[A, hidden]``: one row per assignment, in the
    order ``dispatch`` received them. Weighting and summing over the k choices stays in the layer.
    """

    @abstractmethod
    def local_experts(self, num_experts: int) -> Sequence[int]:
        """Global ids of the experts this rank computes, in chunk order."""

    def run_experts(self, layer: "MoELayer", result: DispatchResult) -> torch.Tensor:
        """Outputs of this rank's experts on their chunks, ``[N, hidden]``. A dispatcher that computes
        experts this rank does not own (e.g. replicas of hot experts, ``parallel/expert_relayout.py``)
        overrides this; the default runs the layer's own expert modules."""
        return layer.run_experts(result.expert_input, result.splits, self.local_experts(layer.num_experts))

    @abstractmethod
    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, token_ids: torch.Tensor,
                 num_experts: int) -> DispatchResult: ...

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, result: DispatchResult) -> torch.Tensor: ...


class LocalDispatcher(TokenDispatcher):
    """All experts in this process: a stable sort by expert id, and its inverse."""

    def local_experts(self, num_experts: int) -> range:
        return range(num_experts)

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, token_ids: torch.Tensor,
                 num_experts: int) -> DispatchResult:
        order = torch.argsort(expert_ids, stable=True)  # [A]: assignments grouped by expert, token order kept
        counts = torch.bincount(expert_ids, minlength=num_experts)  # [E]
        splits = counts.tolist()  # the one device->host read the chunking needs
        expert_input = x.index_select(0, token_ids.index_select(0, order))  # [A, hidden]
        return DispatchResult(expert_input, splits, order, (tuple(splits),))

    def combine(self, expert_output: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        order: torch.Tensor = result.state
        out = torch.empty_like(expert_output)  # [A, hidden]
        out[order] = expert_output  # row order[i] of the assignment order is row i of the sorted order
        return out


# ---------------------------------------------------------------------------------------------------
# aux-loss injection
# ---------------------------------------------------------------------------------------------------
class AttachAuxLoss(torch.autograd.Function):
    """``AttachAuxLoss.apply(h, aux, scale)`` returns ``h`` unchanged; backward also sends ``scale`` as the
    gradient of the scalar ``aux``, i.e. adds ``scale * d(aux)/d(params)`` to the parameter gradients of
    whatever backward flows through ``h``. The output is a fresh alias of ``h``'s storage, not a view."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, aux: torch.Tensor,  # type: ignore[override]
                scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return hidden.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def _inside_backward() -> bool:
    """True while autograd runs a backward pass on this thread: a forward then is an activation-checkpoint
    recompute (or a double-backward), which must not record its statistics a second time."""
    return torch._C._current_graph_task_id() != -1


# ---------------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------------
class MoELayer(nn.Module):
    """Router + E routed SwiGLU experts (+ an optional shared expert): ``[b, s, dim] -> [b, s, dim]``.

    Public, per instance: ``stats_reducer`` (see :class:`AllReduceStatsReducer`), ``dispatcher``,
    ``aux_grad_scale`` (set by the training loop), and after each forward ``last_stats``,
    ``last_aux_loss`` and ``last_z_loss`` (detached).
    """

    def __init__(self, cfg: MoEConfig, layer_idx: int = 0, log: RoutingLog | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.renormalize = cfg.renormalize
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_weight = cfg.aux_loss_weight
        self.z_loss_weight = cfg.z_loss_weight
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        # Experts carry no dropout of their own: their rows are permuted tokens, not batch rows. The block
        # applies the residual dropout to the combined [b, s, dim] output, at true global coordinates.
        self.expert_dims = (cfg.dim, cfg.expert_width)
        self.experts = nn.ModuleList(SwiGLU(*self.expert_dims) for _ in range(cfg.num_experts))
        self.shared_expert = SwiGLU(cfg.dim, cfg.shared_expert_hidden) if cfg.shared_expert_hidden else None
        self.shared_gate = (nn.Linear(cfg.dim, 1, bias=False)
                            if cfg.shared_expert_hidden and cfg.shared_expert_gate else None)
        self.init_runtime_state(log)

    def init_runtime_state(self, log: RoutingLog | None = None) -> None:
        """The state the runtime and the callbacks read and set on any MoE layer (the layer's weights aside):
        one place, so a subclass that builds its weights its own way (``models/hf_moe.py``) cannot miss one."""
        self.dispatcher: TokenDispatcher = LocalDispatcher()
        self.stats_reducer: RouterStatsReducer = LocalStatsReducer()
        self.aux_grad_scale: float = 1.0
        self.routing_log = log
        self.last_stats: RoutingStats | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None
        # block-level tensors a relocating dispatcher moves with the samples (set by MoEBlock per forward)
        self.carry_in: list[torch.Tensor] | None = None
        self.carry_out: list[torch.Tensor] | None = None
        # sample placement: the block's residual and the norm it puts before this layer, so the residual can
        # ride inside the all-to-alls instead of as extra rows (see MoEBlock.forward); set per forward
        self.fold_in: tuple[torch.Tensor, nn.Module] | None = None
        self.residual_folded = False

    def expert_template(self) -> nn.Module:
        """An expert of this layer's shape on the meta device (no memory; built once, outside the module tree,
        without touching torch's random state): a runtime computing an expert from parameters it holds
        elsewhere (a copy, a flat view) calls it through ``torch.func.functional_call``."""
        t = self.__dict__.get("_expert_template")
        if t is None:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                t = SwiGLU(*self.expert_dims)
            object.__setattr__(self, "_expert_template", t)  # not a submodule: no state-dict entry
        return t

    # -- routing ---------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router on ``x [T, dim]`` -> (logits ``[T, E]``, probabilities ``[T, E]``, top-k weights ``[T, k]``,
        top-k expert ids ``[T, k]``).

        Computed in at least fp32 (bf16 logits make the softmax and the z-loss coarse)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.router.weight.to(dtype))  # [T, E]
        probs = logits.softmax(dim=-1)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)  # [T, k] each
        if self.top_k > 1 and self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights, ids

    def keep_mask(self, expert_ids: torch.Tensor, tokens: int) -> tuple[torch.Tensor | None, int | None]:
        """Capacity rule on the token-major assignment list ``expert_ids [T * k]`` -> (keep ``[T * k]`` bool or
        None when dropless, capacity). An expert keeps its first ``capacity`` assignments in token order."""
        if self.capacity_factor is None:
            return None, None
        cap = capacity_for(tokens, self.top_k, self.num_experts, self.capacity_factor)
        a = expert_ids.numel()
        order = torch.argsort(expert_ids, stable=True)  # [A] grouped by expert, token order within
        counts = torch.bincount(expert_ids, minlength=self.num_experts)  # [E]
        starts = torch.cumsum(counts, 0) - counts  # [E] first sorted position of each expert
        rank_sorted = torch.arange(a, device=expert_ids.device) - starts[expert_ids[order]]  # [A]
        rank = torch.empty_like(rank_sorted)
        rank[order] = rank_sorted  # [A] position of each assignment in its expert's queue
        return rank < cap, cap

    def run_experts(self, expert_input: torch.Tensor, splits: list[int], experts: Sequence[int]) -> torch.Tensor:
        """Each local expert on its contiguous chunk (empty chunks too: every expert gets a gradient)."""
        chunks = expert_input.split(splits)  # per local expert: [n_e, dim]
        outs = [self.experts[e](chunk) for e, chunk in zip(experts, chunks)]
        return torch.cat(outs) if outs else expert_input[:0]  # [N, dim]

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(b * s, d)  # [T, dim], token order = row-major over (batch, seq)
        t, k, e = b * s, self.top_k, self.num_experts
        logits, probs, weights, ids = self.route(flat)  # [T, E], [T, E], [T, k], [T, k]
        expert_ids = ids.reshape(t * k)  # [A] token-major: token 0's k choices, then token 1's, ...
        token_ids = torch.arange(t, device=x.device).repeat_interleave(k)  # [A]
        keep, capacity = self.keep_mask(expert_ids, t)

        kept_e, kept_t = (expert_ids, token_ids) if keep is None else (expert_ids[keep], token_ids[keep])
        carry_in, self.carry_in, self.carry_out = self.carry_in, None, None
        fold_in, self.fold_in, self.residual_folded = self.fold_in, None, False
        places = getattr(self.dispatcher, "places_samples", False)
        fold = None
        if places and fold_in is not None and keep is None:
            h, norm = fold_in
            if h.shape == x.shape and not any(isinstance(p, DTensor) for p in norm.parameters()):
                fold = (h.reshape(b * s, d), norm)  # [T, dim] rows of the residual, token order as flat
        sums = RouterSums(counts=torch.bincount(expert_ids, minlength=e), prob_sum=probs.sum(0),
                          z_sum=torch.logsumexp(logits, dim=-1).pow(2).sum(),
                          tokens=torch.tensor(t, dtype=torch.int64, device=x.device))
        # a communicating reducer starts now and is waited for after the experts (RouterStatsReducer)
        reduced = self.stats_reducer.start(sums) if isinstance(self.stats_reducer, AsyncStatsReducer) else None
        # folded, the shared expert runs on the expert side, on each token's first choice (see below)
        shared = self.shared_output(flat) if fold is None else None  # [T, dim] or None
        if places:
            # NetMoE sample placement (parallel/sample_placement.py): the combine delivers each sample's
            # output to the rank that holds it next. The block's residual either rides in the dispatch rows
            # themselves (``fold``: the expert side applies the norm, runs the shared expert and adds both to
            # the token's first choice, so a sample moves at no extra bytes) or, where that cannot be done
            # exactly (capacity dropping, sequence parallelism), travels as extra rows with the shared
            # expert's output (``carry``)
            carry = list(carry_in or []) + ([shared.view(b, s, d)] if shared is not None else [])
            out, moved, result = self.dispatcher.relocate(self, flat, weights, kept_e, kept_t, (b, s), carry,
                                                          fold=fold)
            if moved is None:  # folded: ``out`` = residual + routed output of the samples this rank holds now
                self.residual_folded = True
            elif shared is not None:
                out = out + moved.pop().reshape(b * s, d)
            self.carry_out = moved
        else:
            result = self.dispatcher.dispatch(flat, kept_e, kept_t, e)
            expert_out = self.dispatcher.run_experts(self, result)
            y_kept = self.dispatcher.combine(expert_out, result)  # [A_kept, dim] in assignment order
            if keep is None:
                y = y_kept  # [A, dim]
            else:
                y = y_kept.new_zeros(t * k, d)
                y[keep] = y_kept  # dropped assignments contribute zero
            out = (y.view(t, k, d) * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)  # [T, dim]
            if shared is not None:
                out = out + shared
        out = out.view(b, s, d)

        aux, z = self.aux_losses(reduced() if reduced is not None else self.stats_reducer(sums))
        self.last_aux_loss, self.last_z_loss = aux.detach(), z.detach()
        if not _inside_backward():
            self._record(sums.counts, keep, expert_ids, result, capacity, t)
        total = self.aux_loss_weight * aux + self.z_loss_weight * z
        if total.requires_grad and (self.aux_loss_weight or self.z_loss_weight):
            out = AttachAuxLoss.apply(out, total, self.aux_grad_scale)
        return out

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The always-on shared expert on normalized rows ``x [N, dim]`` (gated if configured), or None."""
        if self.shared_expert is None:
            return None
        out = self.shared_expert(x)  # [N, dim]
        if self.shared_gate is not None:
            out = torch.sigmoid(self.shared_gate(x)) * out  # [N, 1] * [N, dim]
        return out

    def aux_losses(self, sums: RouterSums) -> tuple[torch.Tensor, torch.Tensor]:
        """(load-balancing loss, z-loss) from (reduced) router sums; see the module docstring."""
        tokens = sums.tokens.to(sums.prob_sum.dtype)
        f = sums.counts.to(sums.prob_sum.dtype) / (tokens * self.top_k)  # [E] fraction of assignments
        p = sums.prob_sum / tokens  # [E] mean router probability
        return self.num_experts * (f * p).sum(), sums.z_sum / tokens

    def _record(self, routed: torch.Tensor, keep: torch.Tensor | None, expert_ids: torch.Tensor,
                result: DispatchResult, capacity: int | None, tokens: int) -> None:
        routed_l = tuple(routed.tolist())
        if keep is None:
            kept_l = routed_l
        else:
            kept_l = tuple(torch.bincount(expert_ids[keep], minlength=self.num_experts).tolist())
        self.last_stats = RoutingStats(
            layer=self.layer_idx, tokens=tokens, top_k=self.top_k, routed_per_expert=routed_l,
            tokens_per_expert=kept_l, dropped_per_expert=tuple(r - c for r, c in zip(routed_l, kept_l)),
            source_expert_counts=result.source_expert_counts, expert_splits=tuple(result.splits),
            send_splits=result.send_splits, recv_splits=result.recv_splits, capacity=capacity,
            training=self.training)
        if self.routing_log is not None:
            self.routing_log.record(self.last_stats)


class MoEBlock(nn.Module):
    """Pre-norm decoder block: LLaMA attention, then the MoE feed-forward.

    Tensor parallelism splits the attention projections exactly as in :class:`~.llama.LlamaBlock`. The MoE
    layer is ``"replicated"``: router and experts stay whole on every tp rank and see the full, identical
    tokens (under Megatron-SP the runtime all-gathers its input chunk and slices its output back), so its
    gradients are full on every rank. Its own scaling axis is expert parallelism, not tp.
    """

    galv_tp_plan = {
        "attention_norm": "norm", "attention.wq": "colwise", "attention.wk": "colwise",
        "attention.wv": "colwise", "attention.wo": "rowwise", "ffn_norm": "norm", "moe": "replicated",
    }
    galv_attention = "attention.core"

    def __init__(self, cfg: MoEConfig, rope: Rotary, layer_idx: int = 0, log: RoutingLog | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = LlamaAttention(cfg.llama_config(), rope)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoELayer(cfg, layer_idx, log)
        self.moe_drop = KeyedDropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        self.moe.carry_in = [h]  # moved along if the MoE layer relocates samples (NetMoE); else unused
        # with no dropout on the MoE output, h + y can be summed on the expert side (see MoELayer.forward)
        self.moe.fold_in = (h, self.ffn_norm) if (not self.training or self.moe_drop.p == 0.0) else None
        y = self.moe(self.ffn_norm(h))
        moved, self.moe.carry_out = self.moe.carry_out, None
        if self.moe.residual_folded:
            return y  # already h + y of the samples this rank now holds
        if moved:
            h = moved[0]  # the residual of the samples this rank now holds
        return h + self.moe_drop(y)


class MoEDecoder(DecoderLayout):
    """LLaMA-style decoder whose blocks ``cfg.moe_layer_ids()`` are :class:`MoEBlock` (the rest
    :class:`~.llama.LlamaBlock`). Implements the block protocol (:mod:`.protocol`)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.routing_log = RoutingLog()
        dense = cfg.llama_config()
        rope = Rotary(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        moe_ids = set(cfg.moe_layer_ids())
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(
            MoEBlock(cfg, rope, i, self.routing_log) if i in moe_ids else LlamaBlock(dense, rope)
            for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        init_weights(self)
        assign_sites(self)

    # -- MoE API ---------------------------------------------------------------------------------
    @property
    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers present in this process (pipeline placeholders skipped), in block order."""
        return [b.moe for b in self.layers if isinstance(b, MoEBlock)]

    def set_aux_grad_scale(self, scale: float) -> None:
        """Scale of the injected aux-loss gradient; must match the factor applied to the LM loss before its
        backward (``1 / accumulate_grad_batches`` under Lightning)."""
        for layer in self.moe_layers:
            layer.aux_grad_scale = float(scale)

    def set_stats_reducer(self, reducer: RouterStatsReducer) -> None:
        for layer in self.moe_layers:
            layer.stats_reducer = reducer

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """Unweighted load-balancing and z-losses of the last forward, summed over this process's MoE layers
        (detached, for logging)."""
        layers = [m for m in self.moe_layers if m.last_aux_loss is not None]
        if not layers:
            return {}
        return {"aux_loss": torch.stack([m.last_aux_loss for m in layers]).sum(),  # type: ignore[misc]
                "z_loss": torch.stack([m.last_z_loss for m in layers]).sum()}  # type: ignore[misc]

    def galv_moe_shape(self) -> MoEShape:
        c = self.cfg
        return MoEShape(c.moe_layer_ids(), c.num_experts, c.top_k, c.expert_width, c.shared_expert_hidden,
                        c.capacity_factor)
