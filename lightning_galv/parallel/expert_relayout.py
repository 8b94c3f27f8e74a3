"""Load-adaptive expert re-layout (LAER-MoE) on top of expert parallelism: the runtime side.

Under plain EP (``parallel/expert.py``) rank ``r`` of an EP group of ``k`` computes experts
``[r*E/k, (r+1)*E/k)``, so a hot expert makes its rank the straggler of every all-to-all. LAER-MoE
(load-adaptive expert re-layout with fully sharded expert parallelism) lets a per-step planner decide
which experts each rank *materializes* -- hot experts on several ranks -- and splits a replicated
expert's tokens over its replicas. The planner is pure (``planner/relayout.py``,
:class:`~lightning_galv.planner.relayout.ExpertLayout`); this module executes a layout exactly:

* **Where parameters live: two modes** (``parallelize(expert_sharding=...)``, ``GalvatronStrategy`` /
  ``ExpertRelayout(expert_sharding=...)``).

  ``"owner"`` (default): each expert's parameters and optimizer state live whole on its *owner* (the EP
  rank that holds it under plain EP); every other rank that materializes it receives a copy of the owner's
  parameters in one uneven ``all_to_all_single`` per layer and forward, and the gradients of all copies
  flow back through the transposed exchange and add up on the owner (autograd of the exchange does this:
  a parameter row sent to two ranks receives the sum of both gradients). State-dict keys, gradient sync
  over the expert-data group, ZeRO and clipping are those of plain EP; plain EP's layout moves nothing.
  But the owner of a hot expert sends a whole copy to each replica.

  ``"full"`` -- LAER-MoE's fully sharded expert parallelism (FSEP): every expert is kept on every EP rank
  as a DTensor ``Shard(0)`` over the EP group (``parallel/moe_step.py`` :func:`apply_fsep`), so parameters, gradients and
  optimizer state still take 1/ep of the experts' bytes per rank. Each forward, every rank sends its rows
  of the experts each other rank's slots hold and assembles its own slot experts from all ranks' rows (one
  uneven all-to-all, :meth:`RelayoutDispatcher._materialize_sharded`); backward returns each copy's
  gradient rows to their shard. The bytes a layout costs are spread evenly over the group whatever the
  loads, at the price of gathering even plain EP's layout ((ep-1)/ep of every materialized expert per
  step, where ``"owner"`` moves only replicas). The callback logs both the group's bytes and the largest
  sender's. DTensor placements make the rest general: clipping counts the shards, DCP reshards
  checkpoints between the two modes and any plan, ZeRO-2/3 on experts is FSDP2 over the expert-data mesh
  dim on top of the ep shard (where that dim has two or more ranks; on one rank the experts stay plain).
* **Token split.** The (source rank x expert) count table that the dispatch all-gathers anyway (for its
  split sizes) fixes, for every expert, the global order of its assignments (source-major, token order
  inside). Replica ``j`` of expert ``e`` takes the ``j``-th contiguous run of that order, of the size
  :func:`~lightning_galv.planner.relayout.split_counts` gives. Every rank derives every split size from
  the table and the layout alone, so no extra collective is needed.
* **Exactness.** An expert is a per-token function and its gradient a sum over its tokens, so which
  replica computes which token does not change the result beyond float summation order; the layout is
  fixed for a whole optimizer step (all micro-batches, and activation-checkpoint recomputes).

Experts sharded by ZeRO-2/3 (FSDP2 over an expert-data group of two or more ranks) are read through an FSDP2
"forward method" that returns their flat parameters, and computed only from flat copies -- also on their
owners -- so FSDP2 gathers them for the copy and reduces their gradients after the whole backward (a module
``forward`` would let FSDP2 reduce when the owner's own use is done, before the copies' gradients arrive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..models.moe import DispatchResult, MoELayer, _inside_backward
from ..planner.relayout import ExpertLayout, split_counts
from .expert import AllToAllDispatcher, _AllToAll


def replica_pieces(table: np.ndarray, layout: ExpertLayout) -> np.ndarray:
    """Assignments each source sends to each rank, per expert: ``[k sources, E, k destinations]``.

    ``table[q, e]`` = assignments of source ``q`` for expert ``e``. Expert ``e``'s assignments in global
    (source-major) order are cut into contiguous runs, one per replica in ascending rank order."""
    k, num_experts = table.shape
    pieces = np.zeros((k, num_experts, k), dtype=np.int64)
    starts = np.zeros((k + 1, num_experts), dtype=np.int64)
    starts[1:] = np.cumsum(table, axis=0)  # [k + 1, E] first global position of each source's run
    for e in range(num_experts):
        sizes = split_counts(layout, e, int(starts[-1, e]))
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        for j, (r, _) in enumerate(layout.shares[e]):
            lo = np.maximum(starts[:-1, e], bounds[j])
            hi = np.minimum(starts[1:, e], bounds[j + 1])
            pieces[:, e, r] += np.maximum(hi - lo, 0)
    return pieces


@dataclass(frozen=True)
class RowPlan:
    """How one rank's routed rows travel in a dispatch: ``place`` indexes the rank's expert-sorted rows in send
    order, ``regroup`` orders the arriving (source-major) rows by the local slot expert, ``splits`` are the
    rows per slot expert ``slots``."""

    place: np.ndarray
    send: list[int]
    recv: list[int]
    regroup: np.ndarray
    splits: list[int]
    slots: list[int]


@dataclass
class _RelayoutState:
    place: torch.Tensor  # [A] position, in the sorted-by-expert rows, of each sent row (send order)
    order: torch.Tensor  # [A] assignment order sorted by expert
    send: list[int]
    recv: list[int]
    regroup: torch.Tensor  # [N] received rows (source-major) -> slot-expert-major
    copies: dict[int, torch.Tensor]  # flat parameters of the experts materialized here but owned elsewhere


class RelayoutDispatcher(AllToAllDispatcher):
    """An :class:`AllToAllDispatcher` that follows an :class:`ExpertLayout` (``None``: plain EP).

    Set ``layout`` between optimizer steps only. ``step_table`` / ``step_rank_tokens`` accumulate, over the
    forwards of the current step (recomputes excluded), the (source x expert) counts and the assignments
    each rank computed; :meth:`take_step` returns and clears them."""

    def __init__(self, group: Any, size: int, rank: int, layer: MoELayer) -> None:
        super().__init__(group, size, rank)
        self.layer = layer  # whose owned experts this dispatcher copies to other ranks
        self.fsdp_experts = False  # set by attach_relayout when the owned experts are FSDP2 modules
        self.num_experts = layer.num_experts
        # experts fully sharded over the group (shard_experts_fully): every layout, plain EP's too, is materialized
        self.sharded = False
        self._layout: ExpertLayout | None = None
        self._static: ExpertLayout | None = None  # plain EP as a layout, built once (read several times a forward)
        self._table = np.zeros((size, layer.num_experts), dtype=np.int64)
        self._rank_tokens = np.zeros(size, dtype=np.int64)
        self._moved_bytes = 0
        self._rank_bytes = np.zeros(size, dtype=np.int64)  # expert-parameter bytes each rank sent this step

    @property
    def layout(self) -> ExpertLayout | None:
        """The layout of the current step (``None``: plain EP; with fully sharded experts plain EP is the
        static layout, which is materialized like any other)."""
        if self._layout is None and self.sharded:
            if self._static is None:
                self._static = ExpertLayout.static(self.num_experts, self.size)
            return self._static
        return self._layout

    def owner(self, expert: int) -> int:
        return expert // (self.num_experts // self.size)

    def local_experts(self, num_experts: int) -> Sequence[int]:
        if self.layout is None:
            return super().local_experts(num_experts)
        return self.layout.slots[self.rank]

    def set_layout(self, layout: ExpertLayout | None) -> None:
        if layout is not None:
            if len(layout.slots) != self.size or len(layout.shares) != self.num_experts:
                raise ValueError(f"layout for {len(layout.slots)} ranks x {len(layout.shares)} experts on an EP "
                                 f"group of {self.size} ranks x {self.num_experts} experts. HINT: plan the layout "
                                 "with ranks = the layer's ep degree and the layer's own expert loads.")
            for e, reps in enumerate(layout.shares):
                for r, _ in reps:
                    if e not in layout.slots[r]:
                        raise ValueError(f"layout gives expert {e} a share on rank {r}, which does not "
                                         f"materialize it (slots {layout.slots[r]}). HINT: shares must name ranks "
                                         "whose slots hold the expert.")
        self._layout = layout

    def take_step(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(table ``[k, E]``, assignments computed per rank ``[k]``, parameter bytes this group moved) of the
        step's forwards, then reset (the bytes each rank sent: :attr:`last_rank_bytes`)."""
        out = (self._table.copy(), self._rank_tokens.copy(), self._moved_bytes)
        self.last_rank_bytes = self._rank_bytes.copy()
        self._table[:] = 0
        self._rank_tokens[:] = 0
        self._moved_bytes = 0
        self._rank_bytes[:] = 0
        return out

    # -- tokens ------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, token_ids: torch.Tensor,
                 num_experts: int) -> DispatchResult:
        if self.layout is None:
            result = super().dispatch(x, expert_ids, token_ids, num_experts)
            if not _inside_backward():
                table = np.asarray(result.source_expert_counts, dtype=np.int64)
                self._table += table
                per = num_experts // self.size
                self._rank_tokens += table.sum(0).reshape(self.size, per).sum(1)
            return result
        order = torch.argsort(expert_ids, stable=True)  # [A] grouped by expert
        counts = torch.bincount(expert_ids, minlength=num_experts)  # [E]
        gathered = [torch.empty_like(counts) for _ in range(self.size)]
        torch.distributed.all_gather(gathered, counts, group=self.group)
        table = torch.stack(gathered).cpu().numpy().astype(np.int64)  # [k sources, E]
        plan = self.plan_rows(table)
        place_t = torch.from_numpy(plan.place).to(x.device)
        rows = x.index_select(0, token_ids.index_select(0, order.index_select(0, place_t)))  # [A, hidden]
        copy_of, rows = self.materialize_before(rows)
        got = _AllToAll.apply(rows, plan.send, plan.recv, self.group)  # [N, hidden]
        regroup_t = torch.from_numpy(plan.regroup).to(x.device)
        return DispatchResult(got.index_select(0, regroup_t), plan.splits,
                              _RelayoutState(place_t, order, plan.send, plan.recv, regroup_t, copy_of),
                              tuple(tuple(int(v) for v in row) for row in table), tuple(plan.send), tuple(plan.recv))

    def plan_rows(self, table: np.ndarray) -> RowPlan:
        """Where this rank's expert-sorted rows go and how arriving rows regroup, under the current layout
        (``None``: plain EP), from the gathered ``[k sources, E]`` count table; also counts the step's load."""
        k, me, num_e = self.size, self.rank, self.num_experts
        if self.layout is None:
            per = num_e // k
            pieces = np.zeros((k, num_e, k), dtype=np.int64)
            for e in range(num_e):
                pieces[:, e, e // per] = table[:, e]
            shares: Sequence[Sequence[tuple[int, float]]] = [((e // per, 1.0),) for e in range(num_e)]
            slots = list(range(me * per, (me + 1) * per))
        else:
            pieces = replica_pieces(table, self.layout)  # [k src, E, k dst]
            shares, slots = self.layout.shares, list(self.layout.slots[me])
        mine = pieces[me]  # [E, k dst] what this rank sends
        offset = np.concatenate([[0], np.cumsum(table[me])])[:-1]  # [E] next unsent sorted row of each expert
        runs: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * (k * num_e)
        for e in range(num_e):  # replica pieces of e, in ascending rank = sorted-row order
            for r, _ in shares[e]:
                n = int(mine[e, r])
                runs[r * num_e + e] = np.arange(offset[e], offset[e] + n)
                offset[e] += n
        got_pieces = pieces[:, :, me]  # [k src, E] rows arriving, source-major then expert
        slot_of = {e: i for i, e in enumerate(slots)}
        labels = np.repeat(np.tile(np.arange(num_e), k), got_pieces.reshape(-1))  # [N] expert of each row
        regroup = np.argsort(np.array([slot_of[e] for e in labels], dtype=np.int64), kind="stable")
        if not _inside_backward():
            self._table += table
            self._rank_tokens += pieces.sum((0, 1))
        return RowPlan(np.concatenate(runs), mine.sum(0).tolist(), got_pieces.sum(1).tolist(), regroup,
                       got_pieces[:, slots].sum(0).tolist(), slots)

    def materialize_before(self, rows: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Copies of the experts materialized here (none under plain EP), and ``rows`` made to depend on them.

        The expert copies travel first, and the token exchange depends on them through an exact zero: so in
        backward every rank runs the token exchange's transpose before the copies' one (two independent
        collectives could otherwise run in a different order on different ranks and deadlock)."""
        if self.layout is None:
            return {}, rows
        copy_of, copies = self._materialize(self.layer)
        return copy_of, rows + 0.0 * copies.sum()

    def combine(self, expert_output: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        st = result.state
        if not isinstance(st, _RelayoutState):
            return super().combine(expert_output, result)
        back = torch.empty_like(expert_output)  # [N, hidden] source-major again
        back[st.regroup] = expert_output
        rows = _AllToAll.apply(back, st.recv, st.send, self.group)  # [A, hidden] in send order
        out = torch.empty_like(rows)
        out[st.order.index_select(0, st.place)] = rows  # assignment order
        return out

    # -- parameters ----------------------------------------------------------------------------------
    def _materialize(self, layer: MoELayer) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Flat parameters ``[P]`` of every expert this rank computes under the layout, by expert id, and the
        received ``[copies, P]`` tensor. Copies come from their owners in one uneven all-to-all of whole
        flattened experts. Experts sharded by FSDP2 (ZeRO-2/3) are read through their registered ``galv_flat``
        method, so FSDP2 gathers them for it and reduces their gradients once the whole backward is done (the
        copies' gradients arrive through the exchange's transpose, later than the owner's own use); their owners
        compute them from that flat copy too, never through the module's ``forward``."""
        if self.sharded:
            return self._materialize_sharded(layer)
        k, me, slots = self.size, self.rank, self.layout.slots  # type: ignore[union-attr]
        need = [[e for e in slots[r] if self.owner(e) != r] for r in range(k)]
        owned = list(AllToAllDispatcher.local_experts(self, self.num_experts))
        used = {e for r in range(k) for e in need[r] if self.owner(e) == me}
        if self.fsdp_experts:
            used |= {e for e in slots[me] if self.owner(e) == me}
        flats: dict[int, torch.Tensor] = {}
        for e in sorted(used):
            m = layer.experts[e]
            flats[e] = m.galv_flat() if self.fsdp_experts else torch.cat([p.reshape(-1) for p in m.parameters()])

        outgoing = [e for r in range(k) for e in need[r] if self.owner(e) == me]
        send = [sum(1 for e in need[r] if self.owner(e) == me) for r in range(k)]
        recv = [sum(1 for e in need[me] if self.owner(e) == q) for q in range(k)]
        if outgoing:
            buf = torch.stack([flats[e] for e in outgoing])  # [rows, P]; autograd sums repeated rows' grads
        else:  # still part of the graph, so every rank runs the exchange's backward
            anchor = flats[min(flats)] if flats else torch.cat([p.reshape(-1) for p in
                                                               layer.experts[owned[0]].parameters()])
            buf = anchor.unsqueeze(0)[:0]
        copies = _AllToAll.apply(buf, send, recv, self.group)  # [len(need[me]), P], ascending expert order
        if not _inside_backward():
            self._moved_bytes += sum(len(n) for n in need) * buf.shape[1] * buf.element_size()
            for r in range(k):
                for e in need[r]:
                    self._rank_bytes[self.owner(e)] += buf.shape[1] * buf.element_size()
        out = {e: copies[i] for i, e in enumerate(need[me])}
        if self.fsdp_experts:
            out.update({e: flats[e] for e in slots[me] if self.owner(e) == me})
        return out, copies

    def _materialize_sharded(self, layer: MoELayer) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Fully sharded experts (LAER-MoE's FSEP): rank ``q`` holds rows ``q`` (``Shard(0)``) of every parameter
        of every expert; each rank receives, in one uneven all-to-all, every other rank's rows of the experts its
        slots hold and assembles them, so every rank sends about the same bytes whatever the layout. The
        transposed exchange in backward returns each copy's gradient rows to their shard (summed over copies).
        Returns ``{expert: flat parameters [P]}`` for this rank's slots and the received ``[n]`` buffer."""
        k, me, slots = self.size, self.rank, self.layout.slots  # type: ignore[union-attr]
        shapes = [p.shape for p in layer.expert_template().parameters()]
        rows = [shard_rows(s[0], k) for s in shapes]  # [param][rank] rows of dim 0 each rank holds
        inner = [int(np.prod(s[1:])) for s in shapes]
        piece = [sum(r[q] * n for r, n in zip(rows, inner)) for q in range(k)]  # one expert's elements on rank q
        if self.fsdp_experts:  # every expert in the same order on every rank: FSDP2 gathers over the edp group
            wanted: Sequence[int] = range(self.num_experts)
        else:
            wanted = sorted({e for s in slots for e in s})
        local = {e: _local_flat(layer.experts[e]) for e in wanted}  # [piece[me]] this rank's rows of expert e
        buf = torch.cat([local[e] for r in range(k) for e in slots[r]])  # [sum(send)] destination-major
        send = [piece[me] * len(slots[r]) for r in range(k)]
        recv = [piece[q] * len(slots[me]) for q in range(k)]
        got = _AllToAll.apply(buf, send, recv, self.group)  # [sum(recv)] source-major, then slot order
        if not _inside_backward():
            for q in range(k):
                self._rank_bytes[q] += piece[q] * sum(len(slots[r]) for r in range(k) if r != q) * buf.element_size()
            self._moved_bytes += sum(piece[q] * len(slots[r]) for r in range(k) for q in range(k) if q != r) \
                * buf.element_size()
        # got: per source q, per slot expert, per parameter: rows[i][q] x inner[i] elements
        parts = [list(chunk.split([piece[q]] * len(slots[me]))) for q, chunk in enumerate(got.split(recv))]
        out: dict[int, torch.Tensor] = {}
        for j, e in enumerate(slots[me]):
            by_param = [parts[q][j].split([r[q] * n for r, n in zip(rows, inner)]) for q in range(k)]
            full = [torch.cat([by_param[q][i] for q in range(k)]) for i in range(len(shapes))]  # [rows*inner] each
            out[e] = torch.cat(full)  # [P], the parameters in template order (dim 0 concatenated = row-major)
        return out, got

    def run_experts(self, layer: MoELayer, result: DispatchResult) -> torch.Tensor:
        if not isinstance(result.state, _RelayoutState):
            return super().run_experts(layer, result)
        return self.run_slots(layer, result.expert_input, result.splits, result.state.copies)

    def run_slots(self, layer: MoELayer, expert_input: torch.Tensor, splits: list[int],
                  copies: dict[int, torch.Tensor]) -> torch.Tensor:
        """Each slot expert on its chunk: owned experts as modules (unless FSDP-sharded), everything else through
        ``functional_call`` on parameter views of its flat copy (gradients flow back to the owner)."""
        if self.layout is None:
            return layer.run_experts(expert_input, splits, self.local_experts(self.num_experts))
        me, slots = self.rank, self.layout.slots
        template = layer.expert_template()
        names = [n for n, _ in template.named_parameters()]
        shapes = [p.shape for _, p in template.named_parameters()]
        sizes = [int(np.prod(s)) for s in shapes]
        outs = []
        for e, chunk in zip(slots[me], expert_input.split(splits)):
            if self.owner(e) == me and e not in copies:
                outs.append(layer.experts[e](chunk))
                continue
            views = copies[e].split(sizes)
            params = {n: v.view(s) for n, v, s in zip(names, views, shapes)}
            outs.append(torch.func.functional_call(template, params, (chunk,)))
        return torch.cat(outs) if outs else expert_input[:0]  # [N, hidden]


def _flat_params(module: nn.Module) -> torch.Tensor:
    """All of ``module``'s parameters as one flat tensor ``[P]`` (called as an FSDP2 forward method); of a fully
    sharded expert, this rank's rows of each."""
    return _LocalFlat.apply(*module.parameters())


class _LocalFlat(torch.autograd.Function):
    """Parameters (DTensors: their rank-local rows) concatenated flat, ``[P]``; in backward each parameter's
    gradient is a view of the flat gradient, wrapped in the parameter's DTensor layout.

    Why not ``cat([p.to_local() ...])``: autograd through ``to_local`` re-wraps every gradient with
    ``from_local`` and accumulates it through DTensor's dispatcher, per parameter per micro-batch -- 44 ms vs
    5 ms per backward for 96 expert tensors on CPU (/tmp micro-benchmark), half of fully sharded experts'
    extra backward time."""

    @staticmethod
    def forward(ctx: Any, *params: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        locs = [p._local_tensor if isinstance(p, DTensor) else p for p in params]
        ctx.likes = [p if isinstance(p, DTensor) else None for p in params]
        ctx.shapes = [t.shape for t in locs]
        return torch.cat([t.reshape(-1) for t in locs])  # [P]

    @staticmethod
    @once_differentiable  # double backward through the experts' rows raises instead of dropping terms
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from .data_parallel import wrap_like

        parts = grad.contiguous().split([s.numel() for s in ctx.shapes])  # contiguous: a broadcast grad aliases
        out: list[torch.Tensor | None] = []
        for need, part, shape, like in zip(ctx.needs_input_grad, parts, ctx.shapes, ctx.likes):
            g = part.view(shape)
            out.append(None if not need else wrap_like(g, like) if like is not None else g)
        return tuple(out)


def _local_flat(module: nn.Module) -> torch.Tensor:
    """This rank's rows of every parameter of a fully sharded expert, flat (through FSDP2 if it shards them)."""
    flat = getattr(module, "galv_flat", None)
    return flat() if flat is not None else _flat_params(module)


def shard_rows(n: int, k: int) -> list[int]:
    """Rows of a dim of ``n`` that each of ``k`` ranks holds under DTensor ``Shard`` (``torch.chunk``: pieces of
    ``ceil(n/k)``, the last ones shorter or empty)."""
    c = -(-n // k)
    return [max(0, min(c, n - q * c)) for q in range(k)]



def _register_flat(module: nn.Module) -> None:
    """Give an FSDP2-sharded expert a ``galv_flat()`` that FSDP2 treats like ``forward``: parameters gathered
    before, resharded after, gradients reduced after the backward."""
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    if not hasattr(module, "galv_flat"):
        module.galv_flat = types.MethodType(_flat_params, module)  # type: ignore[attr-defined]
        register_fsdp_forward_method(module, "galv_flat")


@dataclass(frozen=True)
class RelayoutRecord:
    """One MoE layer in one optimizer step. Loads are assignments computed per rank of the EP group,
    *measured* from the step's routing: ``before`` as plain EP would have placed them, ``after`` under the
    layout the step used."""

    step: int
    layer: int
    max_mean_before: float
    max_mean_after: float
    planner_ms: float  # time to plan the layout this step used (0 for the first, static step)
    moved_bytes: int  # expert-parameter bytes the EP group sent to replicas, summed over the step's forwards
    replicas: int  # materialized experts beyond one per expert
    max_rank_bytes: int = 0  # of moved_bytes, what the rank that sent most sent (owners of hot experts; FSEP spreads it)


def _max_mean(load: np.ndarray) -> float:
    mean = float(load.mean())
    return float(load.max()) / mean if mean > 0 else 1.0


class RelayoutController:
    """Per-step driver of :class:`RelayoutDispatcher` layers, with no Lightning in it (the ``ExpertRelayout``
    callback and the parity checks both use it).

    ``before_step()`` plans each layer's layout from the *previous* step's measured expert loads (the current
    step's routing is not known before its forward; the first step runs the plain EP layout);
    ``after_step()`` measures what the step did and returns one :class:`RelayoutRecord` per layer.
    ``slots_per_rank``: experts each rank may materialize (default ``E/ep + 1``: one spare slot per rank
    for a replica of a hot expert; ``E/ep`` only moves experts, it cannot split one)."""

    def __init__(self, layers: list[tuple[MoELayer, RelayoutDispatcher]], slots_per_rank: int | None = None) -> None:
        from ..planner.relayout import plan_relayout

        self._plan = plan_relayout
        self.layers = layers
        self.slots_per_rank = slots_per_rank
        self.step = 0
        self._load: dict[int, np.ndarray] = {}
        self._planner_ms: dict[int, float] = {}

    def _slots(self, layer: MoELayer, d: RelayoutDispatcher) -> int:
        per = layer.num_experts // d.size
        slots = self.slots_per_rank if self.slots_per_rank is not None else per + 1
        if slots < per:
            raise ValueError(f"slots_per_rank={slots}: layer {layer.layer_idx} has {layer.num_experts} experts over "
                             f"ep={d.size} ranks, so each rank must materialize at least {per}. HINT: "
                             f"slots_per_rank>={per} (or None for {per + 1}).")
        return min(slots, layer.num_experts)

    def before_step(self) -> None:
        import time

        for layer, d in self.layers:
            d.take_step()  # drop what forwards outside training steps (validation) counted
            load = self._load.get(id(layer))
            if load is None or load.sum() == 0:
                d.set_layout(None)
                self._planner_ms[id(layer)] = 0.0
                continue
            t0 = time.perf_counter()
            layout = self._plan(load.tolist(), d.size, self._slots(layer, d))
            self._planner_ms[id(layer)] = (time.perf_counter() - t0) * 1e3
            d.set_layout(layout)

    def after_step(self) -> list[RelayoutRecord]:
        records = []
        for layer, d in self.layers:
            table, rank_tokens, moved = d.take_step()
            load = table.sum(0)  # [E] the EP group's assignments per expert this step
            self._load[id(layer)] = load
            per = layer.num_experts // d.size
            static = load.reshape(d.size, per).sum(1)
            replicas = 0 if d.layout is None else sum(len(s) for s in d.layout.slots) - layer.num_experts
            records.append(RelayoutRecord(self.step, layer.layer_idx, _max_mean(static), _max_mean(rank_tokens),
                                          self._planner_ms.get(id(layer), 0.0), int(moved), replicas,
                                          int(d.last_rank_bytes.max())))
        self.step += 1
        return records
