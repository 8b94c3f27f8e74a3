"""The block boundary contract, and the utilities both block-parallel modes use to keep it.

Megatron TP / Megatron-SP (:mod:`.tensor`) and Ulysses (:mod:`.sequence`) are different inside a block
but identical at its edges; the code that checks and wraps those edges lives here, so neither mode's
module imports the other (:func:`.block.apply_block` is the one place that chooses between them).

Every function applying a mode works *in place* on one module and keeps the **boundary contract** the
redistribution code relies on:

    A parallelized block is called as ``block(x, *extras)`` with ``x`` a plain local tensor
    ``[local_batch, full_seq, hidden]``, identical on all ranks of the block's tp group, and returns
    a plain local tensor of the same shape, identical on all ranks of the group. The gradient w.r.t.
    ``x`` comes back full (not partial) and identical on every rank of the group. Tensors handed out at
    a unit boundary (block exit, embedding and head outputs) are not views (:func:`local_output`), so
    FSDP2's pre-backward hook on them survives a user's in-place op.

What is here, and why each mode needs it:

* :func:`tp_submesh` - the group the mode runs on, checked against the strategy (a wrong degree would
  hang a collective or split weights wrongly);
* :func:`check_protocol` - the model protocol attribute the mode needs (``galv_tp_plan`` for TP,
  ``galv_attention`` for Ulysses), with one error explaining the protocol;
* :func:`mark_applied` - a block is parallelized once, whatever the mode;
* :func:`wrap_block_forward`, :func:`check_hidden_states`, :func:`map_hidden_states` - the sequence
  slice at entry and the gather at exit that sequence-sharding modes (Megatron-SP, Ulysses) put inside
  the block's forward;
* :func:`local_output` - DTensor to plain local tensor without handing out a view.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ..plan import LayerStrategy

__all__ = ["APPLIED_ATTR", "check_hidden_states", "check_protocol", "local_output", "map_hidden_states",
           "mark_applied", "tp_submesh", "wrap_block_forward"]

APPLIED_ATTR = "_galv_parallel"  # set on a module once it is parallelized (guards double application)


def tp_submesh(mesh: DeviceMesh, strategy: LayerStrategy, what: str) -> DeviceMesh:
    """The 1-D ``"tp"`` mesh of ``mesh`` (or ``mesh`` itself if it is 1-D), checked against ``strategy.tp``.

    A mismatch means the caller built the mesh for another strategy; failing here names it instead of
    letting a collective hang or silently split weights by the wrong degree.
    """
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        sub = mesh["tp"]
    elif mesh.ndim == 1:
        sub = mesh
    else:
        raise ValueError(f"{what}: mesh with dims {names}: needs a 'tp' dimension. HINT: build it with "
                         "MeshFactory.mesh(strategy), whose dims are ('dp', 'tp').")
    if sub.size() != strategy.tp:
        raise ValueError(f"{what}: tp mesh of size {sub.size()} for strategy {strategy.short()} (tp={strategy.tp}): "
                         "the mesh's tp dimension must equal the strategy's tp degree. HINT: pass "
                         "MeshFactory.mesh(strategy) for this very strategy.")
    return sub


def check_protocol(block: nn.Module, strategy: LayerStrategy, attr: str) -> Any:
    """The block's protocol attribute ``attr``, or a ValueError explaining the protocol.

    Read from the block itself, so a class attribute (the reference models) and an instance attribute (set by
    an adapter on a class it does not own, e.g. :mod:`lightning_galv.models.hf`) both count."""
    value = getattr(block, attr, None)
    if not value:
        raise ValueError(
            f"block {type(block).__name__}: has no attribute `{attr}` (on its class, or set by an adapter), so "
            f"{strategy.short()} "
            f"(tp={strategy.tp}, sp={strategy.sp!r}) cannot be applied; tensor/sequence parallelism needs the "
            "model protocol. HINT: give the block class `galv_tp_plan = {'attn.q': 'colwise', ..., "
            "'attn.o': 'rowwise', 'norm1': 'norm'}` and `galv_attention = 'attn.core'` (see "
            "lightning_galv.models.protocol), or use a plan with tp=1 (DP/ZeRO only) for this model.")
    return value


def mark_applied(block: nn.Module, kind: str) -> None:
    """Refuse to parallelize a block twice (a second DTensor wrap would split already-split weights)."""
    prev = getattr(block, APPLIED_ATTR, None)
    if prev is not None:
        raise ValueError(f"block {type(block).__name__}: already parallelized with {prev}, now asked for {kind}. "
                         "HINT: parallelize each block once, on a fresh (unparallelized) model.")
    setattr(block, APPLIED_ATTR, kind)


def wrap_block_forward(block: nn.Module, enter: Callable[[tuple], tuple], leave: Callable[[Any], Any]) -> None:
    """Run ``enter(args)`` / ``leave(output)`` *inside* the block's forward, not as module hooks.

    Other parts of the runtime hook the block too (batch re-layout between layers with different dp,
    FSDP2's parameter all-gather). A sequence slice at entry must run *after* any batch re-layout and
    the sequence gather at exit *before* it, whatever order the hooks were registered in; placing both
    inside ``forward`` guarantees that (module pre-hooks run before ``forward``, forward hooks after).
    The wrapper is a bound method calling the class's ``forward``, so ``copy.deepcopy`` rebinds it to the
    copy. An activation-checkpoint wrapper applied later wraps this forward, so the layout changes are
    recomputed with the block (correct, at the cost of one extra gather in recompute).
    """
    prev = block.__dict__.get("forward")  # an instance-level forward installed earlier, if any

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args = enter(args)
        out = prev(*args, **kwargs) if prev is not None else type(self).forward(self, *args, **kwargs)
        return leave(out)

    block.forward = types.MethodType(forward, block)  # type: ignore[method-assign]


def check_hidden_states(args: tuple, degree: int, where: str, kind: str, alternative: str) -> torch.Tensor:
    """The block input a sequence-sharding entry needs: ``[batch, seq, hidden]``, seq divisible by ``degree``.

    Checked before any collective, so a bad shape fails identically on every rank instead of hanging.
    """
    if not args or not isinstance(args[0], torch.Tensor):
        raise TypeError(f"{where}: called without a hidden-states tensor as first argument. HINT: call "
                        "block(x, *extras) with x of shape [batch, seq, hidden].")
    x = args[0]
    if x.dim() != 3 or x.shape[1] % degree:
        raise ValueError(f"{where}: input of shape {tuple(x.shape)}: {kind} of degree {degree} needs "
                         f"[batch, seq, hidden] with seq divisible by {degree}. HINT: pad or crop the sequence "
                         f"to a multiple of {degree}, or {alternative}.")
    return x


def map_hidden_states(out: Any, fn: Callable[[torch.Tensor], torch.Tensor], where: str, kind: str) -> Any:
    """``fn`` applied to the hidden states a block returns: the tensor itself, or the first item of a tuple.

    A sequence-sharding exit must find the hidden states to gather them back to the full sequence; any
    other return type is refused with the same message whichever mode asks.
    """
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (fn(out[0]), *out[1:])
    raise TypeError(f"{where}: returned {type(out).__name__}; {kind} needs the block to return the "
                    "hidden states tensor (or a tuple starting with it). HINT: return x from forward.")


class _LocalOutput(torch.autograd.Function):
    """``DTensor -> local tensor`` like ``DTensor.to_local()``, but the result is **not a view**.

    ``to_local()`` returns ``local.view_as(local)``, so every ``use_local_output=True`` boundary hands
    out a view. When that tensor is the output of an FSDP2-wrapped unit (vocab-parallel embedding or
    head, a Megatron-SP block) FSDP2 registers its pre-backward hook on a view and warns that an
    in-place op on it (``h *= scale``) would drop the hook and skip the parameter all-gather. Here the
    result is a detached alias of the local storage (no copy, ``_base is None``) that this function
    makes differentiable, so the hook survives in-place ops and the forward costs nothing extra.
    Backward wraps the gradient with the forward's placements, as ``to_local`` does.
    """

    @staticmethod
    def forward(ctx: Any, x: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = x._spec
        return x._local_tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:  # type: ignore[override]
        spec = ctx.spec
        placements = tuple(Replicate() if pl.is_partial() else pl for pl in spec.placements)
        return DTensor.from_local(grad, spec.mesh, placements, run_check=False, shape=spec.shape,
                                  stride=spec.stride)


def local_output(x: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of ``x`` as a non-view autograd tensor (plain tensors pass through)."""
    return _LocalOutput.apply(x) if isinstance(x, DTensor) else x
