"""Expert parallelism (EP) for MoE layers, and the global router statistics every MoE layer needs.

Layout (EP is carved out of data parallelism, as in Megatron-LM and DeepSpeed-MoE). A layer's *data
group* D is the ranks that hold different tokens of it: its dp ranks with this rank's tp index (tp
ranks hold identical tokens; an MoE layer is "replicated" over them, see ``parallel/tensor.py``), or
all dp*tp ranks under Ulysses. With ``LayerStrategy(ep=k)`` D, in data-mesh order, is cut into
consecutive EP groups of k ranks; the rank at position ``r`` of its EP group holds experts
``[r*E/k, (r+1)*E/k)`` and placeholders stand where the others were, so every state-dict key keeps its
global expert id and a checkpoint written under one ep loads under any other. The ranks at the same
position of every EP group form the *expert-data group* (``|D|/k`` ranks, the same experts): expert
gradients are reduced, and ZeRO applied, over it.

Tokens travel with two ``all_to_all_single`` calls per layer and direction (:class:`AllToAllDispatcher`):
the routed (token, expert) assignments, sorted by expert and so by destination rank, go to the ranks that
hold those experts with **uneven split sizes**; the outputs come back the same way. The split sizes come
from one all-gather of the ``[E]`` per-expert counts of every rank of the EP group, which is also the
(source rank x expert) matrix the routing statistics expose -- no collective beyond what the dispatch needs.
gloo accepts uneven and empty splits in this single-tensor form (not in the list form).

Gradients match one process exactly: an expert's gradient on its owner is the sum over every token of
the EP group that chose it; adding the expert-data group's sums gives every token of D; the division by
the loader's data-parallel size is the same as for dense parameters (``parallel/data_parallel.py``).

Router statistics (:class:`GlobalRouterStats`): the load-balancing loss must not depend on which rank
holds which sample, so the per-expert sums are all-reduced over D before the loss is formed -- in every
MoE layer of a parallel plan, with or without EP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..models.moe import DispatchResult, MoELayer, RouterSums, TokenDispatcher
from ..plan import LayerStrategy
from .grads import EP_ATTR


class ExpertPlaceholder(nn.Module):
    """Stands where an expert held by another EP rank was (no parameters, never called)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("an expert held by another expert-parallel rank was called on this rank. "
                           "HINT: this is a bug in the dispatcher: it must only run local experts.")


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))  # [sum(recv), hidden]
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


@dataclass
class _A2AState:
    order: torch.Tensor  # [A] assignment order sorted by expert (= by destination rank)
    send: list[int]  # rows sent to each EP rank
    recv: list[int]  # rows received from each EP rank
    regroup: torch.Tensor  # [N] received rows (source-major) -> expert-major order


class AllToAllDispatcher(TokenDispatcher):
    """Dispatch to the EP group's experts with uneven all-to-alls; this rank computes experts ``[r*E/k, (r+1)*E/k)``."""

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def local_experts(self, num_experts: int) -> range:
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, token_ids: torch.Tensor,
                 num_experts: int) -> DispatchResult:
        k, per = self.size, num_experts // self.size
        order = torch.argsort(expert_ids, stable=True)  # [A] grouped by expert, hence by owner rank
        counts = torch.bincount(expert_ids, minlength=num_experts)  # [E] this rank's assignments per expert
        matrix = [torch.empty_like(counts) for _ in range(k)]
        dist.all_gather(matrix, counts, group=self.group)  # [k][E]: every source's counts
        table = torch.stack(matrix)  # [k sources, E]
        send = counts.view(k, per).sum(1).tolist()  # rows to each owner
        mine = table[:, self.rank * per:(self.rank + 1) * per]  # [k sources, per] what arrives, per local expert
        recv = mine.sum(1).tolist()
        rows = x.index_select(0, token_ids.index_select(0, order))  # [A, hidden] sorted by expert
        got = _AllToAll.apply(rows, send, recv, self.group)  # [N, hidden]: source-major, expert-major inside
        local_ids = torch.arange(per, device=x.device).repeat(k)  # [k * per] local expert of each (source, expert) run
        run_expert = local_ids.repeat_interleave(mine.reshape(-1))  # [N] local expert id of each received row
        regroup = torch.argsort(run_expert, stable=True)  # [N] expert-major, then source, then token order
        splits = mine.sum(0).tolist()  # [per] rows per local expert
        return DispatchResult(got.index_select(0, regroup), splits, _A2AState(order, send, recv, regroup),
                              tuple(tuple(row) for row in table.tolist()), tuple(send), tuple(recv))

    def combine(self, expert_output: torch.Tensor, result: DispatchResult) -> torch.Tensor:
        st: _A2AState = result.state
        back = torch.empty_like(expert_output)  # [N, hidden] source-major again
        back[st.regroup] = expert_output
        rows = _AllToAll.apply(back, st.recv, st.send, self.group)  # [A, hidden] sorted by expert
        out = torch.empty_like(rows)
        out[st.order] = rows  # assignment order
        return out


class GlobalRouterStats:
    """Router sums added over the layer's data group D, with the gradient scaled to the runtime's convention.

    Forward: every rank gets D's sums, so the aux losses are those of all of D's tokens at once -- the
    single-process values. Backward: each rank back-propagates the same global loss, and the runtime sums
    a dense parameter's gradients over D and divides by the loader's data-parallel size ``loader_dp``
    (``parallel/data_parallel.py``). The local sums therefore receive ``loader_dp`` times the incoming
    gradient, with no collective: summed over D and divided by ``loader_dp``, that is exactly the gradient
    of the global aux loss.

    One all-reduce carries everything (counts and token count as float64, exact below 2**53, beside the
    float sums), started by :meth:`start` right after routing and waited for after the experts ran: a
    synchronous collective there made every rank wait for the slowest at each MoE layer (on 2 CPU ranks the
    two collectives it took cost ~2-3 ms per layer forward where the collectives themselves take ~0.4).
    """

    def __init__(self, group: Any, size: int, loader_dp: int) -> None:
        self.group, self.size, self.loader_dp = group, size, loader_dp

    def __call__(self, sums: RouterSums) -> RouterSums:
        return self.start(sums)()

    def start(self, sums: RouterSums) -> Callable[[], RouterSums]:
        e = sums.counts.numel()
        local = torch.cat([sums.prob_sum, sums.z_sum.reshape(1)])  # [E + 1] float, carries the router graph
        ints = torch.cat([sums.counts, sums.tokens.reshape(1)])  # [E + 1] int64
        if self.size == 1:
            return lambda: _stats(ints, _ScaledGradient.apply(local, local.detach(), float(self.loader_dp)), e)
        buf = torch.cat([ints.to(torch.float64), local.detach().to(torch.float64)])  # [2E + 2]
        work = dist.all_reduce(buf, group=self.group, async_op=True)

        def finish() -> RouterSums:
            work.wait()
            total = buf[e + 1:].to(local.dtype)  # [E + 1] D's float sums
            return _stats(buf[:e + 1].round().to(torch.int64), _ScaledGradient.apply(local, total, float(self.loader_dp)), e)

        return finish


def _stats(ints: torch.Tensor, floats: torch.Tensor, e: int) -> RouterSums:
    """RouterSums from ``ints`` [E + 1] (counts, tokens) and ``floats`` [E + 1] (probability sums, z sum)."""
    return RouterSums(counts=ints[:e], prob_sum=floats[:e], z_sum=floats[e], tokens=ints[e])


class _ScaledGradient(torch.autograd.Function):
    """Forward: ``value`` (the group's sums, computed outside autograd). Backward: to ``local`` (this rank's
    sums, whose graph reaches the router) the incoming gradient times ``scale``."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return value.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return grad * ctx.scale, None, None


def moe_layers(block: nn.Module) -> list[MoELayer]:
    return [m for m in block.modules() if isinstance(m, MoELayer)]


def check_ep(block: nn.Module, strategy: LayerStrategy, name: str) -> list[MoELayer]:
    """The MoE layers of ``block`` that ``strategy.ep`` applies to (ValueError with a HINT if it cannot)."""
    layers = moe_layers(block)
    if strategy.ep > 1 and not layers:
        raise ValueError(f"block {name}: ep={strategy.ep} but the block has no MoE layer. HINT: set ep only on "
                         "the MoE layers of the plan (dense blocks keep ep=1).")
    for layer in layers:
        if layer.num_experts % strategy.ep:
            raise ValueError(f"block {name}: ep={strategy.ep} does not divide its {layer.num_experts} experts. "
                             f"HINT: pick ep from the divisors of {layer.num_experts}.")
    return layers


EXPERT_SHARDINGS = ("owner", "full")


def check_expert_sharding(value: object) -> str:
    if value not in EXPERT_SHARDINGS:
        raise ValueError(f"expert_sharding={value!r}: must be one of {EXPERT_SHARDINGS}. HINT: 'owner' keeps each "
                         "expert whole on one EP rank (plain EP); 'full' shards every expert over the EP group "
                         "(LAER-MoE's FSEP, for ExpertRelayout).")
    return str(value)


def apply_ep(block: nn.Module, mesh: Any, strategy: LayerStrategy, name: str) -> list[nn.Module]:
    """Keep this rank's experts of every MoE layer in ``block`` and dispatch through the EP group.

    ``mesh`` is this rank's ``("edp", "ep")`` mesh (:meth:`~lightning_galv.layout.MeshFactory.expert_mesh`).
    Returns the local expert modules (the runtime reduces their gradients over ``mesh["edp"]``). (Fully sharded
    experts instead: ``parallel/moe_step.py`` ``apply_fsep``.)
    """
    layers = check_ep(block, strategy, name)
    ep_mesh = mesh["ep"]
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    local: list[nn.Module] = []
    for layer in layers:
        dispatcher = AllToAllDispatcher(ep_mesh.get_group(), size, rank)
        shard = getattr(layer, "shard_experts", None)
        if shard is not None:  # fused expert tensors (models/hf_moe.py): sharded on their expert dim instead
            local += shard(dispatcher.local_experts(layer.num_experts), ep_mesh)
            layer.dispatcher = dispatcher
            continue
        keep = set(dispatcher.local_experts(layer.num_experts))
        for e in range(layer.num_experts):
            if e not in keep:
                layer.experts[e] = ExpertPlaceholder()
        layer.dispatcher = dispatcher
        local += [layer.experts[e] for e in sorted(keep)]
    return local


def mark_expert_params(modules: list[nn.Module], ep: int) -> None:
    """Tell the gradient-norm code that these parameters exist on 1/ep of the layer's ranks (``parallel/grads.py``).

    Call after FSDP2 has (possibly) replaced the parameters. Modules whose parameters are DTensors sharded over
    the EP group itself (``_galv_ep_in_placements``, models/hf_moe.py) are skipped: their placements count it."""
    for m in modules:
        if getattr(m, "_galv_ep_in_placements", False):
            continue
        for p in m.parameters():
            setattr(p, EP_ATTR, ep)
