"""DeepSpeed-Ulysses sequence parallelism for one block (Jacobs et al., 2023).

With ``strategy.sp == "ulysses"`` the layer's ``tp`` ranks (``P`` below) form a sequence-parallel
group. Weights are *not* split: every rank holds the full block, and each runs it on its ``s/P``
chunk of the sequence. Everything outside attention is position-wise, so only core attention needs
the whole sequence; around it, an all-to-all turns sequence-sharded, all-heads tensors
``[b, s/P, H, d]`` into full-sequence, head-sharded tensors ``[b, s, H/P, d]`` and back. Rotary
embedding runs inside the core module, so it sees the true positions ``0..s-1``.

Boundary contract (:mod:`.boundary`, the same as Megatron TP's): the block takes and returns a plain
full ``[b, s, hidden]`` tensor, identical on the group, and the gradient w.r.t. its input comes back
full and identical on the group. Entry slices this rank's chunk (backward: all-gather of the chunk
gradients); exit all-gathers the chunks (backward: this rank's slice of the, identical, incoming
gradient).

**Parameter gradients are partial**: each rank's gradients cover only its sequence chunk, so the
true gradient is their *sum over the Ulysses group*. That sum is deliberately left to the
data-parallel code, which reduces Ulysses layers over the flattened ``dp x tp`` group
(``LayerStrategy.data_group`` / ``MeshFactory.data_mesh``) in the same collective as the
data-parallel reduction; reducing here as well would double-count.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..models.dropout import set_coords
from ..plan import LayerStrategy
from .boundary import (check_hidden_states, check_protocol, map_hidden_states, mark_applied, tp_submesh,
                       wrap_block_forward)

__all__ = ["apply_ulysses", "seq_all_to_all", "heads_all_to_all"]


# ---------------------------------------------------------------------------------------------------
# differentiable collectives (gloo needs contiguous buffers: every tensor handed to a collective,
# forward or backward, is made contiguous first; a permuted view is silently scrambled otherwise)
# ---------------------------------------------------------------------------------------------------
def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``[b, s/P, ...]`` chunk into ``[b, s, ...]`` (rank order)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=1)  # [b, s/P, ...] x P -> [b, s, ...]


def _local_chunk(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's ``[b, s/P, ...]`` chunk of ``[b, s, ...]`` (a contiguous copy)."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(p, dim=1)[r].contiguous()


class _ScatterSeq(torch.autograd.Function):
    """Block entry: full replicated ``[b, s, h]`` -> this rank's ``[b, s/P, h]``; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _local_chunk(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_seq(grad, ctx.group), None


class _GatherSeq(torch.autograd.Function):
    """Block exit: ``[b, s/P, h]`` chunks -> full ``[b, s, h]``; backward keeps this rank's slice.

    The slice is exact because the incoming gradient is identical on every rank of the group (the
    boundary contract of whatever consumes the block output).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _local_chunk(grad, ctx.group), None


class _EqualAllToAll(torch.autograd.Function):
    """All-to-all along dim 0 in ``P`` equal splits. With equal splits the exchange is its own inverse, so
    backward sends the gradient through the same call. (torch.distributed.nn's differentiable version did
    the same but warns on every rank that it is deprecated in torch 2.13.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all along dim 0 (``P`` equal splits); its backward is the inverse exchange."""
    return _EqualAllToAll.apply(x, group)


def seq_all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sequence-sharded ``[b, s/P, H, d]`` -> head-sharded ``[b, s, H/P, d]`` (this rank's head group)."""
    p = dist.get_world_size(group)
    b, sl, h, d = x.shape
    x = x.reshape(b, sl, p, h // p, d)  # [b, s/P, P(head group), H/P, d]
    x = x.permute(2, 0, 1, 3, 4)  # [P(head group -> destination rank), b, s/P, H/P, d]
    x = _all_to_all(x, group)  # [P(source rank = sequence chunk), b, s/P, H/P, d]
    x = x.permute(1, 0, 2, 3, 4)  # [b, P(sequence chunk), s/P, H/P, d]
    return x.reshape(b, p * sl, h // p, d)  # [b, s, H/P, d]


def heads_all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Head-sharded ``[b, s, H/P, d]`` -> sequence-sharded ``[b, s/P, H, d]`` (inverse of :func:`seq_all_to_all`)."""
    p = dist.get_world_size(group)
    b, s, hl, d = x.shape
    x = x.reshape(b, p, s // p, hl, d)  # [b, P(sequence chunk), s/P, H/P, d]
    x = x.permute(1, 0, 2, 3, 4)  # [P(sequence chunk -> destination rank), b, s/P, H/P, d]
    x = _all_to_all(x, group)  # [P(source rank = head group), b, s/P, H/P, d]
    x = x.permute(1, 2, 0, 3, 4)  # [b, s/P, P(head group), H/P, d]
    return x.reshape(b, s // p, p * hl, d)  # [b, s/P, H, d]


# ---------------------------------------------------------------------------------------------------
# hooks
# ---------------------------------------------------------------------------------------------------
def _qkv_names(core: nn.Module) -> tuple[str, str, str]:
    """Names of the core's q, k, v parameters, to find them when they are passed by keyword."""
    import inspect

    params = [p for p in inspect.signature(core.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = tuple(p.name for p in params[:3])
    return names if len(names) == 3 else ("q", "k", "v")  # type: ignore[return-value]


def _core_pre_hook(group: dist.ProcessGroup, p: int, where: str, names: tuple[str, str, str]) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        slots: list[tuple[str, int | str]] = []
        for i, name in enumerate(names):
            if i < len(args):
                slots.append(("arg", i))
            elif name in kwargs:
                slots.append(("kw", name))
            else:
                raise TypeError(f"{where}: core attention called without {name!r}. HINT: the core attention "
                                "(galv_attention) must be called as core(q, k, v).")
        tensors = [args[i] if kind == "arg" else kwargs[i] for kind, i in slots]  # type: ignore[index]
        for name, t in zip(names, tensors):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{where}: core attention input {name} of shape "
                                 f"{tuple(getattr(t, 'shape', ()))}: Ulysses needs [batch, seq, heads, head_dim]. "
                                 "HINT: view q/k/v as (b, s, -1, head_dim) before calling the core module.")
            if t.shape[2] % p:
                kind = "num_heads" if name == names[0] else "num_kv_heads"
                raise ValueError(f"{where}: {kind}={t.shape[2]} ({name} of shape {tuple(t.shape)}) is not divisible "
                                 f"by the Ulysses degree {p}: heads are split across the group. HINT: choose tp "
                                 f"from the common divisors of num_heads and num_kv_heads, or sp='megatron'.")
        new = [seq_all_to_all(t, group) for t in tensors]  # each [b, s/P, H, d] -> [b, s, H/P, d]
        for (kind, i), t in zip(slots, new):
            if kind == "arg":
                args[i] = t  # type: ignore[index]
            else:
                kwargs[i] = t  # type: ignore[index]
        return tuple(args), kwargs
    return hook


def _core_post_hook(group: dist.ProcessGroup, where: str) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor) or out.dim() != 4:
            raise TypeError(f"{where}: core attention returned {type(out).__name__}; Ulysses needs a "
                            "[batch, seq, heads, head_dim] tensor. HINT: return the attention output before "
                            "merging heads.")
        return heads_all_to_all(out, group)  # [b, s, H/P, d] -> [b, s/P, H, d]
    return hook


def _enter(group: dist.ProcessGroup, p: int, where: str) -> Callable[[tuple], tuple]:
    def enter(args: tuple) -> tuple:
        x = check_hidden_states(args, p, where, "Ulysses", "lower the layer's tp")
        set_coords(seq_offset=dist.get_rank(group) * (x.shape[1] // p))  # keyed dropout sees global positions
        return (_ScatterSeq.apply(x, group), *args[1:])  # [b, s, h] -> [b, s/P, h]
    return enter


def _leave(group: dist.ProcessGroup, where: str) -> Callable[[Any], Any]:
    def gather(x: torch.Tensor) -> torch.Tensor:
        return _GatherSeq.apply(x, group)  # [b, s/P, h] -> [b, s, h]

    def leave(out: Any) -> Any:
        set_coords(seq_offset=0)
        return map_hidden_states(out, gather, where, "Ulysses")
    return leave


# ---------------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------------
def apply_ulysses(block: nn.Module, mesh: DeviceMesh, strategy: LayerStrategy) -> None:
    """Make ``block`` run Ulysses sequence parallelism over ``mesh["tp"]`` (in place, hooks only).

    Weights stay plain and replicated (the module tree and ``state_dict`` keys are unchanged). The
    block's input is sliced to this rank's sequence chunk at entry and all-gathered at exit; the core
    attention module named by the block class's ``galv_attention`` gets its ``q, k, v`` exchanged
    ``[b, s/P, H, d] -> [b, s, H/P, d]`` and its output exchanged back.

    Parameter gradients after backward are *partial* (this rank's chunk only) and must be summed over
    the dp x tp group by the data-parallel code; this function does not reduce them.

    Requires ``num_heads % P == 0``, ``num_kv_heads % P == 0`` and ``seq % P == 0`` (checked at the
    first forward, on every rank alike, before any collective that could hang).
    """
    if strategy.tp == 1:
        return
    if not strategy.ulysses:
        raise ValueError(f"strategy {strategy.short()} (sp={strategy.sp!r}) passed to apply_ulysses: it needs "
                         "sp='ulysses'. HINT: use apply_block, which picks the mode from the strategy (or "
                         "apply_tp for Megatron TP / SP).")
    name = type(block).__name__
    path: str = check_protocol(block, strategy, "galv_attention")
    try:
        core = block.get_submodule(path)
    except AttributeError as exc:
        raise ValueError(f"block {name}: galv_attention = {path!r} is not a submodule. HINT: give the dotted "
                         "path of the core attention module, e.g. 'attn.core'.") from exc
    group = tp_submesh(mesh, strategy, f"block {name}").get_group()
    mark_applied(block, strategy.short())
    p = strategy.tp
    where = f"block {name} (ulysses {p})"
    # Entry slice / exit gather run inside forward, so batch re-layout hooks always see full sequences.
    wrap_block_forward(block, _enter(group, p, where), _leave(group, where))
    core.register_forward_pre_hook(_core_pre_hook(group, p, where, _qkv_names(core)), with_kwargs=True)
    core.register_forward_hook(_core_post_hook(group, where), with_kwargs=True)
