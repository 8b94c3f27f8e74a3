"""How the runtime finds the parts of a model it parallelizes.

A model opts in by exposing five attributes (the reference models in this package do):

``galv_blocks``      an ``nn.ModuleList`` of transformer blocks; ``plan.layers[i]`` addresses block ``i``.
                     A block is called as ``block(x, *extras)`` where ``x`` is ``[batch, seq, hidden]``
                     and ``extras`` do not depend on the batch (rotary tables, ...).
``galv_embedding``   the token ``nn.Embedding`` (vocab-parallel when the embed strategy has tp > 1).
``galv_final_norm``  the norm before the head (may be ``None``); it runs under the head strategy.
``galv_head``        the output ``nn.Linear`` (vocab-parallel when the head strategy has tp > 1).
``galv_shape()``     a :class:`~lightning_galv.plan.ModelShape`.

Optional, for pipeline stages: ``galv_embed_forward(tokens)`` (what forward does before the first
block; default ``galv_embedding(tokens)``) and ``galv_head_forward(h)`` (after the last block; default
``galv_head(galv_final_norm(h))``).

Optional, for models that cannot run every strategy: ``galv_check_plan(plan)`` is called before anything
is applied and raises a ``ValueError`` (with a ``HINT:``) for a plan the model cannot take (an adapted
Hugging Face GPT-2, whose fused ``Conv1D`` projections are not split, refuses tensor parallelism so). Such a
model also exposes ``galv_sp_modes``: the sequence modes (``"none"`` = plain Megatron TP, ``"megatron"``,
``"ulysses"``) its blocks can run with tp > 1, so that automatic mode searches, and profiles, only those
(GPT-2's adapter: ``("ulysses",)``); default: all of :data:`~lightning_galv.plan.SP_MODES`.

and each block carries two attributes (on its class, or set on the instance by an adapter):

``galv_tp_plan``     ``{submodule path: "colwise" | "rowwise" | "norm" | "replicated"}``: Megatron column /
                     row splits of the projections, the norms that Megatron-SP shards on the sequence,
                     and submodules that run whole on the full sequence on every tp rank (an MoE layer,
                     see :mod:`lightning_galv.parallel.tensor`).
``galv_attention``   path of the *core attention* submodule, called ``core(q, k, v)`` with
                     ``[batch, seq, heads, head_dim]`` tensors. Attention code must infer the local
                     head count from the projection output (``view(b, s, -1, head_dim)``), so the
                     same code runs with all heads or with its tensor-parallel share.

A model without these attributes still gets DP / ZeRO / activation checkpointing: its blocks are
found as the longest ``nn.ModuleList`` of identical module types, and requesting TP or SP for it
raises a ``ValueError`` with a hint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..plan import SP_MODES, ModelShape, ParallelPlan


@dataclass
class ModelParts:
    blocks: nn.ModuleList
    embedding: nn.Embedding | None
    final_norm: nn.Module | None
    head: nn.Linear | None
    shape: ModelShape | None
    understood: bool  # True when the model implements the protocol (TP/SP allowed)
    check_plan: Callable[[ParallelPlan], None] | None = None  # the model's own galv_check_plan, if any
    sp_modes: tuple[str, ...] = SP_MODES  # what the blocks can run with tp > 1 (the model's galv_sp_modes)


def find_parts(model: nn.Module) -> ModelParts:
    """The protocol parts of ``model``, or a best-effort guess for models that do not implement it."""
    inner = unwrap_model(model)
    if hasattr(inner, "galv_blocks"):
        shape = inner.galv_shape() if hasattr(inner, "galv_shape") else None
        return ModelParts(inner.galv_blocks, getattr(inner, "galv_embedding", None),
                          getattr(inner, "galv_final_norm", None), getattr(inner, "galv_head", None),
                          shape, understood=True, check_plan=getattr(inner, "galv_check_plan", None),
                          sp_modes=tuple(getattr(inner, "galv_sp_modes", SP_MODES)))
    best: nn.ModuleList | None = None
    for mod in inner.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and len({type(m) for m in mod}) == 1:
            if best is None or len(mod) > len(best):
                best = mod
    if best is None:
        raise ValueError(f"model {type(inner).__name__}: found no list of blocks to address with a plan. "
                         "HINT: keep the transformer blocks in an nn.ModuleList, or expose `galv_blocks` "
                         "(see lightning_galv.models.protocol).")
    return ModelParts(best, None, None, None, None, understood=False)


def unwrap_model(model: nn.Module) -> nn.Module:
    """A LightningModule usually holds the network as a child; follow a single `.model`/`.net`."""
    for name in ("model", "net", "module"):
        child = getattr(model, name, None)
        if isinstance(child, nn.Module) and not hasattr(model, "galv_blocks"):
            return unwrap_model(child)
    return model
