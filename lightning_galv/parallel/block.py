"""Which block-parallel mode a :class:`LayerStrategy` means, decided in one place.

A transformer block with ``tp > 1`` runs one of three modes, chosen by ``strategy.sp``:

==============  ====================================  =====================================
``sp``          mode                                  applied by
==============  ====================================  =====================================
``"none"``      Megatron tensor parallelism           :func:`.tensor.apply_tp`
``"megatron"``  TP + Megatron sequence parallelism    :func:`.tensor.apply_tp`
``"ulysses"``   DeepSpeed-Ulysses (weights whole)     :func:`.sequence.apply_ulysses`
==============  ====================================  =====================================

and ``tp == 1`` splits nothing. All three keep the block boundary contract (:mod:`.boundary`), so the
code around a block (batch re-layout, activation checkpointing, FSDP2) does not care which one ran.

Why one place: :func:`~.parallelize.parallelize` applies plans and the sharded-layer profiler
(:mod:`lightning_galv.profiling.profilers`) times blocks under each strategy to price them for the
planner. If each chose the mode itself, a new mode (or a changed rule) could reach one and not the
other, and the planner would price code that training never runs.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..plan import LayerStrategy
from .sequence import apply_ulysses
from .tensor import apply_tp

__all__ = ["apply_block"]


def apply_block(block: nn.Module, mesh: DeviceMesh | None, strategy: LayerStrategy) -> None:
    """Parallelize one transformer ``block`` in place as ``strategy`` says (table in the module docstring).

    ``mesh`` is the ``("dp", "tp")`` mesh of ``strategy`` (``MeshFactory.mesh(strategy)``); it may be
    ``None`` only when ``strategy.tp == 1``, which leaves the block untouched, so a caller need not build
    a mesh for it. Other errors (missing model protocol, indivisible heads, a mesh of another degree, a
    block parallelized twice) are the applied mode's, raised before any collective.
    """
    if strategy.tp == 1:
        return
    if mesh is None:
        raise ValueError(f"block {type(block).__name__}: no mesh for strategy {strategy.short()} "
                         f"(tp={strategy.tp}): only tp=1 applies without one. HINT: pass "
                         "MeshFactory.mesh(strategy).")
    if strategy.ulysses:
        apply_ulysses(block, mesh, strategy)
    else:
        apply_tp(block, mesh, strategy)
