"""NetMoE dynamic sample placement on top of expert parallelism: the runtime side.

Which data-parallel rank processes which sample does not change the gradient sum, so an MoE layer's
combine all-to-all may deliver a sample's expert outputs to *another* rank of the EP group than the one it
came from -- the rank the placement solver (``planner/placement.py``, NetMoE, Liu et al. ICLR 2025) picks so
that fewer tokens cross node boundaries. The sample then lives there until the next MoE layer, whose
dispatch starts from the new place (tokens of one sample tend to pick the same experts, across tokens and
across layers, which is what makes this pay).

What travels, all in the all-to-alls the layer makes anyway:

* **dispatch**: the routed tokens as in plain EP, plus one column with each assignment's routing weight
  (the expert side applies it, so the receiver only sums), and an int64 all-to-all of one key per
  assignment telling the expert side where the output goes (destination rank, token slot there, k-slot);
* **combine**: expert outputs sorted by destination, and the keys again (the receiver cannot derive which
  row is which token otherwise; key bytes are logged separately, 8 bytes per row). The block's residual
  must reach the sample's new rank too. Where it can (no shared expert, no dropout on the MoE output, the
  residual and the MoE input holding the same tokens, a plain -- not DTensor -- norm), the dispatch sends the
  *residual* rows instead of their normalized copies, the expert side applies the block's norm (the same
  per-row function: the experts see the same input) and adds the residual to the token's first choice, so
  the receiver's sum is the block's output and a moving sample costs no extra bytes ("folded"). Otherwise
  the residual and the shared expert's output travel as extra "carry" rows for the samples that change rank.
  Measured end to end on the mixed-domain corpus (benchmarks/moe_callbacks_e2e.py --corpus mixed, inter-node
  bytes as sent vs plain EP): with carry rows +1 % / -3 % at 4 / 8 ranks (run at 3e1b16a), folded -5 % / -18 %.

Where the samples go back: placement is kept within a *run* -- consecutive blocks of one pipeline chunk
with the same batch layout whose MoE layers share one EP group -- and the run's last MoE layer routes its
combine back to where the data loader put each sample. So everything outside a run (layout changes,
pipeline sends, the head and the loss with the user's labels) sees samples where it expects them, and
no extra exchange is needed to restore them. Inside a run, keyed dropout follows the samples
(:class:`~lightning_galv.models.dropout.DropoutCoords` ``row_source``).

Exactness needs dropless routing (capacity dropping depends on which tokens share a rank), aux losses from
globally reduced counts (the runtime always does that) and keyed dropout (the runtime's default); the
layer's k = 1 or 2 partial outputs are summed in the receiver, where two-term float addition is
order-independent. Ulysses layers hold sequence chunks, not samples: they run plain (logged).

Where this differs from NetMoE: the paper re-places samples at every MoE layer and does not say (in what
we could read) how labels follow them; we close each run by sending samples home in the last combine, so
the user's loss and labels never move -- the price is that the last layer of a run optimizes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..models.dropout import coords, set_coords
from ..models.moe import DispatchResult, MoELayer, _inside_backward
from .expert import AllToAllDispatcher, _AllToAll
from .expert_relayout import RelayoutDispatcher


def _a2a_ints(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty(sum(recv))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


@dataclass
class PlacementRecord:
    """One placing MoE layer in one forward: bytes of its dispatch and combine all-to-alls (with the carry
    rows) as they happened and as plain EP would have sent them for the same routing, split by node."""

    layer: int
    restore: bool
    inter_before: float = 0.0
    inter_after: float = 0.0
    intra_before: float = 0.0
    intra_after: float = 0.0
    key_bytes: float = 0.0
    solve_ms: float = 0.0
    moved_samples: int = 0  # samples of the whole EP group that changed rank (the bytes are the group's too)
    folded: bool = False  # the residual rode in the all-to-alls (no carry rows)


def sample_dest_counts(cnt: np.ndarray, layout: Any, size: int) -> np.ndarray:
    """Assignments of each sample to each rank of the EP group -> ``[S, size]``.

    ``cnt[j, e]``: sample ``j``'s (group index, source-major) assignments to expert ``e``. Under plain EP an
    expert lives on its owner; under an expert layout its assignments, in global (source, sample, token)
    order, are cut into contiguous runs over its replicas (``parallel/expert_relayout.py``), so a sample's run
    may straddle two replicas."""
    n_samples, num_e = cnt.shape
    per = num_e // size
    if layout is None:
        return cnt.reshape(n_samples, size, per).sum(2)
    from ..planner.relayout import split_counts

    out = np.zeros((n_samples, size), dtype=np.int64)
    for e in range(num_e):
        cum = np.concatenate([[0], np.cumsum(cnt[:, e])])  # [S + 1] run of each sample in e's global order
        bounds = np.concatenate([[0], np.cumsum(split_counts(layout, e, int(cum[-1])))])
        for j, (r, _) in enumerate(layout.shares[e]):
            out[:, r] += np.maximum(np.minimum(cum[1:], bounds[j + 1]) - np.maximum(cum[:-1], bounds[j]), 0)
    return out


class PlacingDispatcher(RelayoutDispatcher):
    """The dispatcher of an EP MoE layer under the per-step MoE callbacks: expert re-layout (``layout``, from
    :class:`RelayoutDispatcher`) and, once :meth:`enable_placement` ran, NetMoE sample placement. One object
    per layer, whichever callback attaches first, so the two compose."""

    def __init__(self, group: Any, size: int, rank: int, layer: MoELayer) -> None:
        super().__init__(group, size, rank, layer)
        self.places_samples = False
        self.topology: Any = None
        self.first = self.restore = False
        self.policy: Any = None
        self.records: list[PlacementRecord] = []

    def enable_placement(self, topology: Any, first: bool, restore: bool, policy: Any = None) -> None:
        """``first``: the run's first MoE layer (starts from the loader's placement); ``restore``: its last (sends
        every sample home). ``policy``: a :class:`~lightning_galv.planner.placement.PlacementPolicy` (default
        NetMoE's two-stage assignment)."""
        from ..planner.placement import NetMoEPlacement

        self.places_samples, self.topology, self.first, self.restore = True, topology, first, restore
        self.policy = policy if policy is not None else NetMoEPlacement()

    def relocate(self, layer: MoELayer, flat: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                 token_ids: torch.Tensor, bs: tuple[int, int], carry: list[torch.Tensor],
                 fold: tuple[torch.Tensor, nn.Module] | None = None,
                 ) -> tuple[torch.Tensor, list[torch.Tensor] | None, DispatchResult]:
        """Route, compute and combine into the new placement -> (routed output ``[b*s, d]`` of the samples this
        rank now holds, ``carry`` tensors moved the same way, the dispatch facts for the routing stats).

        ``fold = (residual rows [b*s, d], norm)``, where the layer's input is ``norm(residual)``: the dispatch
        sends the residual rows instead, the expert side applies ``norm`` (the same per-row function, so the
        experts see the same input) and adds the residual to each token's first choice; the receiver's sum is
        then ``residual + routed output`` and nothing else has to travel with a moved sample. Returned as
        ``(residual + routed output, None, facts)`` when it took that path; an exchange in which nothing moves
        runs plain and returns ``carry`` as usual."""
        b, s = bs
        big_k, num_e, k, me = layer.top_k, layer.num_experts, self.size, self.rank
        d, dev = flat.shape[1], flat.device
        n_samples = k * b
        if fold is not None and fold[0].shape != flat.shape:
            raise ValueError(f"MoE layer {layer.layer_idx}: residual rows {tuple(fold[0].shape)} do not match its "
                             f"input rows {tuple(flat.shape)}. HINT: fold the residual only where the block's "
                             "residual and the MoE input hold the same tokens (not under sequence parallelism).")
        if not carry and fold is None:
            raise ValueError(f"MoE layer {layer.layer_idx} relocates samples but got no residual to move with "
                             "them. HINT: sample placement works on MoE layers inside an MoEBlock (the block "
                             "hands its residual to the layer).")
        # 1. per (local sample, expert) counts, one gather: the split sizes and the solver's input
        sample = token_ids // s  # [A] local sample of each assignment
        local = torch.bincount(sample * num_e + expert_ids, minlength=b * num_e)  # [b * E]
        gathered = [torch.empty_like(local) for _ in range(k)]
        dist.all_gather(gathered, local, group=self.group)
        cnt = torch.stack(gathered).cpu().numpy().astype(np.int64).reshape(n_samples, num_e)  # [S, E]
        table = cnt.reshape(k, b, num_e).sum(1)  # [k sources, E]
        tokens = sample_dest_counts(cnt, self.layout, k)  # [S, k]: sample x rank computing its tokens
        # 2. where each sample goes
        c = coords()
        here = np.arange(n_samples) // b  # current position of each sample (group index j at j // b)
        placement_in = (np.arange(n_samples) if (self.first or c.placement is None)
                        else np.asarray(c.placement, dtype=np.int64))
        carry_rows = 0 if fold is not None else sum(t.shape[1] for t in carry)  # folded: moves cost no rows
        solve_ms = 0.0
        if self.restore:
            target, tie = placement_in // b, placement_in  # home, in the loader's slot order
        else:
            t0 = time.perf_counter()
            target = np.asarray(self.policy.place(tokens, here, self.topology, np.full(n_samples, carry_rows)),
                                dtype=np.int64)
            solve_ms = (time.perf_counter() - t0) * 1e3
            tie = np.arange(n_samples)
        if (np.bincount(target, minlength=k) != b).any():
            raise RuntimeError(f"sample placement gave ranks {np.bincount(target, minlength=k).tolist()} samples, "
                               f"each must keep {b}. HINT: this is a bug in the placement solver.")
        if (target == here).all() and (placement_in == np.arange(n_samples)).all():
            # nothing moves and nothing is away from home: the plain exchange, without weight column and keys
            out, plan = self._in_place(layer, flat, weights, expert_ids, token_ids, table)
            set_coords(placement=None, row_source=None)
            if not _inside_backward():
                self._record(layer.layer_idx, tokens, placement_in, here, here, carry_rows, d, flat.element_size(),
                             0, solve_ms, 0, fold is not None)
            result = DispatchResult(flat[:0], plan.splits, None, tuple(tuple(int(v) for v in row) for row in table),
                                    tuple(plan.send), tuple(plan.recv))
            if fold is not None:  # the layer left residual and shared expert to this exchange: add them here
                sh = layer.shared_output(flat)
                return fold[0] + (out if sh is None else out + sh), None, result
            return out, list(carry), result
        order_new = np.lexsort((tie, target))  # current group index of the sample at each new group index
        new_index = np.empty(n_samples, dtype=np.int64)
        new_index[order_new] = np.arange(n_samples)
        placement_out = placement_in[order_new]
        # 3. dispatch (plain EP or the expert layout): + the routing weight column; keys say where outputs go
        order = torch.argsort(expert_ids, stable=True)  # [A] grouped by expert
        plan = self.plan_rows(table)
        idx = order.index_select(0, torch.from_numpy(plan.place).to(dev))  # [A] assignments in send order
        kslot = torch.arange(expert_ids.numel(), device=dev) % big_k  # dropless: token-major, k per token
        ni = torch.from_numpy(new_index).to(dev)[me * b + sample]  # [A] new group index of each sample
        span = b * s * big_k
        key = (ni // b) * span + ((ni % b) * s + token_ids % s) * big_k + kslot  # [A] unique per assignment
        w = weights.reshape(-1).to(flat.dtype)  # [A] token-major like expert_ids
        src = fold[0] if fold is not None else flat  # [T, d]: what the expert side receives per token
        rows = torch.cat([src.index_select(0, token_ids.index_select(0, idx)),
                          w.index_select(0, idx).unsqueeze(1)], dim=1)  # [A, d + 1]
        copies, rows = self.materialize_before(rows)
        got = _AllToAll.apply(rows, plan.send, plan.recv, self.group)  # [N, d + 1] source-major
        keys_got = _a2a_ints(key.index_select(0, idx), plan.send, plan.recv, self.group)  # [N]
        regroup = torch.from_numpy(plan.regroup).to(dev)  # slot-expert-major
        x_in = got.index_select(0, regroup)  # [N, d + 1]
        k_in = keys_got.index_select(0, regroup)
        if fold is not None:
            xn = fold[1](x_in[:, :d])  # [N, d] the block's norm, applied here: the experts' usual input
            y = self.run_slots(layer, xn, plan.splits, copies)  # [N, d]
            yw = y * x_in[:, d:]  # [N, d] weighted by the routing probability
            # each token's first choice also carries its residual and its shared-expert output
            fi = torch.nonzero(k_in % big_k == 0).squeeze(1)  # [T_here] rows of first choices
            add = x_in.index_select(0, fi)[:, :d]  # [T_here, d] residual rows
            sh = layer.shared_output(xn.index_select(0, fi))
            if sh is not None:
                add = add + sh
            yw = yw.index_add(0, fi, add)
        else:
            y = self.run_slots(layer, x_in[:, :d], plan.splits, copies)  # [N, d]
            yw = y * x_in[:, d:]  # [N, d] weighted by the routing probability
        # 4. combine to each sample's new holder (+ carry rows of the samples that leave this rank)
        srt = torch.argsort(k_in)
        out_rows, out_keys = yw.index_select(0, srt), k_in.index_select(0, srt)
        csend = torch.bincount(out_keys // span, minlength=k).tolist()
        dest_pos = new_index // b  # [S] new position of each sample (by current group index)
        crecv = tokens[dest_pos == me].sum(0).tolist()  # [k] rows arriving from each computing rank
        pack = torch.cat(carry, dim=1) if fold is None else None  # [b, carry_rows, d]
        leaving = [j for j in order_new if here[j] == me and dest_pos[j] != me]  # in new-index order
        carry_send = [sum(1 for j in leaving if dest_pos[j] == r) * carry_rows for r in range(k)]
        arriving = [j for j in order_new if dest_pos[j] == me and here[j] != me]
        carry_recv = [sum(1 for j in arriving if here[j] == q) * carry_rows for q in range(k)]
        pieces = []
        starts = np.concatenate([[0], np.cumsum(csend)])
        for r in range(k):
            pieces.append(out_rows[starts[r]:starts[r + 1]])
            if pack is not None:
                pieces += [pack[j - me * b].to(out_rows.dtype) for j in leaving if dest_pos[j] == r]
        buf = torch.cat(pieces)
        back = _AllToAll.apply(buf, [a + c_ for a, c_ in zip(csend, carry_send)],
                               [a + c_ for a, c_ in zip(crecv, carry_recv)], self.group)
        keys_back = _a2a_ints(out_keys, csend, crecv, self.group)
        parts = back.split([v for q in range(k) for v in (crecv[q], carry_recv[q])])
        expert_rows = torch.cat(parts[0::2])  # source-major, the order of keys_back
        token_new = (keys_back % span) // big_k  # [rows] token slot on this rank
        out = flat.new_zeros(b * s, d).index_add(0, token_new, expert_rows)  # sum of the k weighted outputs
        moved: list[torch.Tensor] | None = None
        came = {}
        for q in range(k if pack is not None else 0):
            chunk = parts[2 * q + 1].view(-1, carry_rows, d)  # [samples from q, carry_rows, d]
            for i, j in enumerate(j for j in arriving if here[j] == q):
                came[j] = chunk[i]
        if pack is not None:
            slots = [came[j] if here[j] != me else pack[j - me * b] for j in order_new[me * b:(me + 1) * b]]
            new_pack = torch.stack(slots).to(pack.dtype)  # [b, carry_rows, d]
            moved = list(new_pack.split([t.shape[1] for t in carry], dim=1))
        # 5. where samples are now, for the next layer and for keyed dropout
        if self.restore:
            set_coords(placement=None, row_source=None)
        else:
            first_shard = c.shard - me  # EP groups are consecutive runs of the layer's batch shards
            src = placement_out[me * b:(me + 1) * b]
            set_coords(placement=tuple(int(v) for v in placement_out),
                       row_source=tuple(int((first_shard + o // b) * b + o % b) for o in src))
        if not _inside_backward():
            self._record(layer.layer_idx, tokens, placement_in, here, dest_pos, carry_rows, d,
                         flat.element_size(), int(expert_ids.numel()) + len(keys_back), solve_ms,
                         int((dest_pos != here).sum()), fold is not None)
        result = DispatchResult(x_in[:, :d], plan.splits, None, tuple(tuple(int(v) for v in row) for row in table),
                                tuple(plan.send), tuple(plan.recv))
        return out, moved, result

    def _in_place(self, layer: MoELayer, flat: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                  token_ids: torch.Tensor, table: np.ndarray) -> tuple[torch.Tensor, Any]:
        """Dispatch, compute and combine back to the sending ranks (the plain EP path, or the expert layout's)
        -> (``[T, d]`` weighted and summed over the k choices exactly as a non-placing layer does, the row plan)."""
        t, big_k, d = flat.shape[0], layer.top_k, flat.shape[1]
        order = torch.argsort(expert_ids, stable=True)  # [A] grouped by expert
        plan = self.plan_rows(table)
        idx = order.index_select(0, torch.from_numpy(plan.place).to(flat.device))  # [A] in send order
        rows = flat.index_select(0, token_ids.index_select(0, idx))  # [A, d]
        copies, rows = self.materialize_before(rows)
        got = _AllToAll.apply(rows, plan.send, plan.recv, self.group)  # [N, d] source-major
        regroup = torch.from_numpy(plan.regroup).to(flat.device)
        y = self.run_slots(layer, got.index_select(0, regroup), plan.splits, copies)  # [N, d]
        back = torch.empty_like(y)
        back[regroup] = y  # source-major again
        rows_back = _AllToAll.apply(back, plan.recv, plan.send, self.group)  # [A, d] in send order
        y_assign = torch.empty_like(rows_back)
        y_assign[idx] = rows_back  # assignment (token-major) order
        return (y_assign.view(t, big_k, d) * weights.to(y_assign.dtype).unsqueeze(-1)).sum(dim=1), plan  # [T, d]

    def _record(self, layer: int, tokens: np.ndarray, placement_in: np.ndarray, here: np.ndarray,
                dest: np.ndarray, carry_rows: int, d: int, elsize: int, key_rows: int, solve_ms: float,
                moved: int, folded: bool = False) -> None:
        """Bytes of this layer's dispatch + combine as sent, and as plain EP would send them (every sample
        at its loader rank), for the same routing."""
        k = self.size
        home = placement_in // (len(here) // k)  # loader position of the sample now at each group index

        def traffic(src_pos: np.ndarray, dst_pos: np.ndarray, carry_from: np.ndarray | None) -> np.ndarray:
            m = np.zeros((k, k))
            for j in range(len(src_pos)):
                m[src_pos[j], :] += tokens[j] * (d + 1)  # dispatch: sample -> expert ranks
                m[:, dst_pos[j]] += tokens[j] * d  # combine: expert ranks -> holder
                if carry_from is not None and carry_from[j] != dst_pos[j]:
                    m[carry_from[j], dst_pos[j]] += carry_rows * d
            return m * elsize

        intra_b, inter_b = self.topology.split_bytes(traffic(home, home, None))
        intra_a, inter_a = self.topology.split_bytes(traffic(here, dest, here))
        self.records.append(PlacementRecord(layer, self.restore, inter_b, inter_a, intra_b, intra_a,
                                            8.0 * key_rows, solve_ms, moved, folded))


def group_topology(global_ranks: list[int], gpus_per_node: int) -> Any:
    """:class:`~lightning_galv.planner.topology.Topology` over the positions of an EP group whose members are
    ``global_ranks`` on nodes of ``gpus_per_node`` consecutive ranks."""
    from ..planner.topology import Topology

    nodes = [r // gpus_per_node for r in global_ranks]
    sizes = [nodes.count(n) for n in dict.fromkeys(nodes)]
    if nodes != sorted(nodes) or len(set(sizes)) != 1:
        raise ValueError(f"EP group on ranks {global_ranks} spreads unevenly over nodes {nodes} "
                         f"(gpus_per_node={gpus_per_node}): the two-stage placement needs the same number of its "
                         "ranks on every node. HINT: choose ep and the tp/dp order so that each EP group takes "
                         "whole nodes or equal parts of them (tp_consecutive=True keeps dp groups node-strided).")
    return Topology(ranks=len(global_ranks), gpus_per_node=sizes[0])


def _layout_key(s: Any) -> tuple:
    return (s.dp, s.tp, s.tp_consecutive, s.sp)


def placement_runs(plan: Any, moe_layers: set[int]) -> list[list[int]]:
    """The MoE blocks of every placement run (see the module docstring), in forward order; runs of one MoE
    block are left out (there is nothing to gain without a next layer)."""
    runs: list[list[int]] = []
    for chunk in range(plan.pp * plan.virtual_stages):
        cur: list[int] = []
        key: tuple | None = None
        ep: int | None = None
        for i in plan.stage_layers(chunk):
            s = plan.layers[i]
            is_moe = i in moe_layers
            eligible = is_moe and s.ep > 1 and not s.ulysses
            if _layout_key(s) != key or (is_moe and (not eligible or (ep is not None and s.ep != ep))):
                runs.append(cur)
                cur, key, ep = [], _layout_key(s), None
            if eligible:
                cur.append(i)
                ep = s.ep
        runs.append(cur)
    return [r for r in runs if len(r) >= 2]


@dataclass(frozen=True)
class PlacementStep:
    """One optimizer step of sample placement on this rank (sums over its placing layers and forwards)."""

    step: int
    inter_before: float  # bytes plain EP would have sent across nodes for the same routing
    inter_after: float
    intra_before: float
    intra_after: float
    key_bytes: float  # the int64 keys' all-to-alls
    solve_ms: float
    moved_samples: int
    time_saved_s: float | None  # predicted with the given bandwidths (None without them)
    folded_layers: int = 0  # placing layer forwards whose residual rode in the all-to-alls (no carry rows)


class PlacementController:
    """Collects the placing layers' records per optimizer step (no Lightning; the callback uses it).

    ``intra_bw`` / ``inter_bw`` (bytes/s, per rank) price the bytes saved as all-to-all time: the inter-node
    bytes a rank sends cross the slower link, so the saving is ``inter / inter_bw + intra / intra_bw`` before
    minus after, divided by the group's ranks (each rank sends its share concurrently)."""

    def __init__(self, dispatchers: list[PlacingDispatcher], intra_bw: float | None = None,
                 inter_bw: float | None = None) -> None:
        self.dispatchers = dispatchers
        self.intra_bw, self.inter_bw = intra_bw, inter_bw
        self.step = 0

    def before_step(self) -> None:
        for d in self.dispatchers:
            d.records.clear()  # forwards outside training steps (validation) are not this step's

    def after_step(self) -> PlacementStep:
        recs = [r for d in self.dispatchers for r in d.records]
        for d in self.dispatchers:
            d.records.clear()
        tot = {f: sum(getattr(r, f) for r in recs) for f in ("inter_before", "inter_after", "intra_before",
                                                               "intra_after", "key_bytes", "solve_ms")}
        saved = None
        if self.intra_bw and self.inter_bw and self.dispatchers:
            k = self.dispatchers[0].size

            def t(inter: float, intra: float) -> float:
                return (inter / self.inter_bw + intra / self.intra_bw) / k

            saved = t(tot["inter_before"], tot["intra_before"]) - t(tot["inter_after"], tot["intra_after"])
        out = PlacementStep(self.step, tot["inter_before"], tot["inter_after"], tot["intra_before"],
                            tot["intra_after"], tot["key_bytes"], tot["solve_ms"],
                            sum(r.moved_samples for r in recs), saved, sum(r.folded for r in recs))
        self.step += 1
        return out
