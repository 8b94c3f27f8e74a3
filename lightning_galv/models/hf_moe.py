"""A Hugging Face sparse MoE block (Mixtral's) driven by this package's MoE runtime: dropless routing, all-to-all
expert parallelism, global router statistics -- with the model's own router and its own fused expert weights.

Why not HF's own expert parallelism: it replicates every token on every rank and all-reduces the partial
outputs (no all-to-all), so communication grows with the whole batch instead of with the routed tokens.

How, without renaming a weight. :class:`HFSparseMoE` *is* a :class:`~.moe.MoELayer` (so ``check_ep``,
``apply_ep``, :class:`~lightning_galv.parallel.expert.GlobalRouterStats`, the routing statistics and the MoE
callbacks find it as they find the reference model's layers) that takes the HF block's place in the block (same
attribute name, ``mlp``) and holds the HF block's two children under their own names:

* ``gate`` -- HF's ``MixtralTopKRouter``, *called* for routing, so the router semantics are HF's by construction
  (``softmax`` of the logits in fp32, top-k, the k kept probabilities renormalised to sum to one);
* ``experts`` -- HF's ``MixtralExperts``: ``gate_up_proj [E, 2 * I, H]`` (gate rows first, then up rows) and
  ``down_proj [E, H, I]``. Expert ``e`` computes ``down_e(act(gate_e x) * up_e x)``, as HF's loop does.

so ``state_dict`` keys stay ``...mlp.gate.weight``, ``...mlp.experts.gate_up_proj``, ``...mlp.experts.down_proj``.

Expert parallelism (:meth:`HFSparseMoE.shard_experts`): the fused tensors cannot be cut into per-expert modules
without renaming them, so instead each becomes a ``DTensor`` sharded on its expert dimension over the EP group
(``Shard(0)``: EP rank ``r`` holds rows ``[r E/k, (r+1) E/k)``, exactly the experts
:class:`~lightning_galv.parallel.expert.AllToAllDispatcher` sends it). A full checkpoint then gathers each
tensor whole under its HF key, FSDP2 (ZeRO-2/3 over an expert-data group of two or more ranks) composes with it
as with a TP shard, and the gradient norm counts the shard from its placements (so these parameters carry no extra
expert-parallel marker, ``parallel/expert.py mark_expert_params``).

The experts are computed inside a call of the ``experts`` module (its instance ``forward`` is replaced by
:func:`_run_local_experts`): FSDP2 all-gathers a module's parameters around its forward, so they must be used
inside one.

**Router load-balancing loss** (``config.output_router_logits=True``: HF then adds
``router_aux_loss_coef * aux`` to its loss). HF's ``load_balancing_loss_func`` pools every MoE layer of the
forward before forming the product: ``aux = E * sum_e (C_e / R) * (P_e / R)`` with ``C_e`` the top-k assignments
of expert e summed over layers and tokens, ``P_e`` its router probability summed likewise, and ``R`` = layers x
tokens. It is not a sum of per-layer losses, so the reference layer's per-layer :class:`~.moe.AttachAuxLoss` does
not fit. Here each layer's sums, first added over its data group (``GlobalRouterStats``: the plan-independent,
global-batch values), go into one :class:`PooledRouterAux` per forward; the gradient of ``aux`` with respect to
layer l's probability sums is ``E * C / R^2`` -- known once every layer has run, which is before any backward
-- and :class:`_AttachPooledAux` injects it into each layer's backward. Exact for plans without a pipeline
(stages run layers of one forward on different ranks at different times: ``pp > 1`` with the aux loss is
refused); activation-checkpoint recomputes do not add to the pool twice.

Not supported (refused with a ValueError, not run wrongly): ``router_jitter_noise > 0`` while training (HF
draws it from torch's global generator: different noise under every plan), NetMoE sample placement and
expert relayout (they need one module per expert).
"""

from __future__ import annotations

import types
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .moe import MoELayer, RouterSums, RoutingLog, _inside_backward

__all__ = ["HFSparseMoE", "PooledRouterAux", "is_hf_sparse_moe", "swap_hf_moe"]


class PooledRouterAux:
    """HF Mixtral's load-balancing loss of one forward, pooled over its MoE layers (module docstring).

    Holds detached sums only: the gradient is injected per layer by :class:`_AttachPooledAux`."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.counts: torch.Tensor | None = None  # [E] top-k assignments, summed over layers (global over D)
        self.probs: torch.Tensor | None = None  # [E] router probabilities, summed likewise
        self.rows = 0  # layers x tokens

    def add(self, sums: RouterSums) -> None:
        counts, probs = sums.counts.detach().to(sums.prob_sum.dtype), sums.prob_sum.detach()
        self.counts = counts if self.counts is None else self.counts + counts
        self.probs = probs if self.probs is None else self.probs + probs
        self.rows += int(sums.tokens)

    def value(self) -> torch.Tensor:
        """``E * sum_e (C_e / R) (P_e / R)`` (HF's ``load_balancing_loss_func`` without an attention mask)."""
        assert self.counts is not None and self.probs is not None, "no MoE layer has run in this forward"
        return self.num_experts * ((self.counts / self.rows) * (self.probs / self.rows)).sum()

    def grad_probs(self) -> torch.Tensor:
        """``d value / d P`` = ``E * C / R^2`` ([E]): the same for every layer's probability sums."""
        assert self.counts is not None
        return self.num_experts * self.counts / float(self.rows) ** 2


class _AttachPooledAux(torch.autograd.Function):
    """Returns ``hidden`` unchanged; backward also gives the layer's (reduced) probability sums ``probs [E]`` the
    gradient ``scale * pool.grad_probs()``, read when backward runs (after every layer of the forward has added
    to ``pool``)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, probs: torch.Tensor, pool: PooledRouterAux,  # type: ignore[override]
                scale: float) -> torch.Tensor:
        ctx.pool, ctx.scale = pool, scale
        return hidden.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:  # type: ignore[override]
        return grad, ctx.pool.grad_probs() * ctx.scale, None, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[operator]


def is_hf_sparse_moe(mod: nn.Module) -> bool:
    """A Mixtral-style sparse MoE block: a ``gate`` router with an ``[E, hidden]`` weight and fused ``experts``."""
    gate, experts = getattr(mod, "gate", None), getattr(mod, "experts", None)
    if not isinstance(gate, nn.Module) or not isinstance(experts, nn.Module):
        return False
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3
            and isinstance(getattr(gate, "weight", None), torch.Tensor))


def _run_local_experts(self: nn.Module, expert_input: torch.Tensor, splits: list[int],
                       first: int) -> torch.Tensor:
    """Instance ``forward`` of HF's fused experts module under :class:`HFSparseMoE`: the local experts (global ids
    ``first, first + 1, ...``; row ``j`` of this rank's shard is expert ``first + j``) each on its contiguous
    chunk of ``expert_input [N, hidden]`` -> ``[N, hidden]``. Every local expert runs, on an empty chunk too."""
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)  # [E_local, 2I, H], [E_local, H, I]
    if gate_up.shape[0] != len(splits):
        raise RuntimeError(f"experts {first}..{first + len(splits) - 1} dispatched to a shard of {gate_up.shape[0]} "
                           "experts. HINT: this is a bug in the expert sharding (models/hf_moe.py shard_experts).")
    outs = []
    for j, chunk in enumerate(expert_input.split(splits)):  # chunk: [n_e, hidden]
        gate, up = F.linear(chunk, gate_up[j]).chunk(2, dim=-1)  # [n_e, I] each (gate rows first)
        outs.append(F.linear(self.act_fn(gate) * up, down[j]))  # [n_e, hidden]
    return torch.cat(outs) if outs else expert_input[:0]


class HFSparseMoE(MoELayer):
    """:class:`~.moe.MoELayer` over HF's ``gate`` and fused ``experts`` (module docstring: why and how).

    Built with :func:`swap_hf_moe`. The reference layer's own aux / z-losses are off (``aux_loss_weight`` and
    ``z_loss_weight`` 0): HF's load-balancing loss is not added (``output_router_logits`` is refused)."""

    def __init__(self, block: nn.Module, layer_idx: int = 0, log: RoutingLog | None = None) -> None:
        nn.Module.__init__(self)  # not MoELayer's: it would build a router and SwiGLU experts of its own
        gate, experts = block.gate, block.experts
        self.gate = gate
        self.experts = experts
        num_experts, hidden = gate.weight.shape
        self.layer_idx = layer_idx
        self.num_experts = int(num_experts)
        self.top_k = int(gate.top_k)
        self.renormalize = True  # HF's MixtralTopKRouter divides the kept probabilities by their sum
        self.capacity_factor = None  # dropless, as HF's block
        self.aux_loss_weight = 0.0
        self.z_loss_weight = 0.0
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.hidden_dim = int(hidden)
        self.expert_dims = (int(hidden), int(experts.down_proj.shape[-1]))
        self.shared_expert = None
        self.shared_gate = None
        self.init_runtime_state(log)
        self.router_aux_coef = 0.0  # HF's router_aux_loss_coef when output_router_logits (set by the adapter)
        self.aux_pool: PooledRouterAux | None = None  # this forward's pool (set by the adapter per forward)
        self._pool_probs: torch.Tensor | None = None
        experts.forward = types.MethodType(_run_local_experts, experts)

    @property
    def router(self) -> nn.Module:
        """The router (HF's ``gate``), under the reference layer's name (the profiler counts its parameters)."""
        return self.gate

    def expert_numel(self) -> int:
        """Parameters of one expert (a row of each fused tensor), for the planner."""
        return sum(int(t[0].numel()) for t in (self.experts.gate_up_proj, self.experts.down_proj))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """HF's router on ``x [T, hidden]`` -> (logits ``[T, E]`` fp32, probabilities ``[T, E]``, renormalised
        top-k weights ``[T, k]``, top-k expert ids ``[T, k]``)."""
        logits, weights, ids = self.gate(x)  # [T, E] in x's dtype, [T, k] fp32, [T, k]
        logits = logits.float()
        return logits, logits.softmax(dim=-1), weights, ids

    def run_experts(self, expert_input: torch.Tensor, splits: list[int], experts: Sequence[int]) -> torch.Tensor:
        experts = list(experts)
        if experts and experts != list(range(experts[0], experts[0] + len(experts))):
            raise RuntimeError(f"layer {self.layer_idx}: local experts {experts} are not contiguous. HINT: this is "
                               "a bug in the dispatcher (the fused shard holds consecutive experts).")
        return self.experts(expert_input, splits, experts[0] if experts else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter_noise > 0:
            raise ValueError(f"router_jitter_noise={self.jitter_noise}: HF draws the jitter from torch's global "
                             "generator, so it differs under every plan. HINT: build the config with "
                             "router_jitter_noise=0.0.")
        out = super().forward(x)
        probs, self._pool_probs = self._pool_probs, None
        if self.aux_pool is not None and probs is not None and probs.requires_grad and self.router_aux_coef:
            out = _AttachPooledAux.apply(out, probs, self.aux_pool, self.router_aux_coef * self.aux_grad_scale)
        return out

    def aux_losses(self, sums: RouterSums) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by :meth:`MoELayer.forward` with the (reduced) router sums: they join this forward's pool (not
        again in an activation-checkpoint recompute); the per-layer values returned are for logging only (the
        layer's own aux / z weights are 0)."""
        if self.aux_pool is not None:
            if not _inside_backward():
                self.aux_pool.add(sums)
            self._pool_probs = sums.prob_sum
        return super().aux_losses(sums)

    def shard_experts(self, local: range, ep_mesh: Any) -> list[nn.Module]:
        """Keep the experts ``local`` (consecutive global ids) of this EP rank: each fused tensor becomes a DTensor
        ``Shard(0)`` over ``ep_mesh``, this rank's rows local. Returns the module holding them (for the
        runtime's expert-data parallelism)."""
        from torch.distributed.tensor import DTensor, Shard

        for name in ("gate_up_proj", "down_proj"):
            p = getattr(self.experts, name)
            rows = p.detach()[local.start:local.stop].clone()  # [E/ep, ...] this rank's experts
            d = nn.Parameter(DTensor.from_local(rows, ep_mesh, [Shard(0)], run_check=False),
                             requires_grad=p.requires_grad)
            self.experts.register_parameter(name, d)
        # the shard is in the placements (also after FSDP2 re-wraps the parameters): no extra ep marker
        self.experts._galv_ep_in_placements = True  # read by parallel/expert.py mark_expert_params
        return [self.experts]


def swap_hf_moe(block: nn.Module, layer_idx: int, log: RoutingLog | None = None) -> list[str]:
    """Replace every HF sparse MoE block inside ``block`` by an :class:`HFSparseMoE` under the same name;
    returns their block-relative paths. Idempotent (an adapted block is left as it is)."""
    found = [n for n, m in block.named_modules() if n and not isinstance(m, HFSparseMoE) and is_hf_sparse_moe(m)]
    for path in found:
        parent_path, _, name = path.rpartition(".")
        parent = block.get_submodule(parent_path) if parent_path else block
        setattr(parent, name, HFSparseMoE(getattr(parent, name), layer_idx, log))
    return found
