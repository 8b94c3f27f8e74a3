"""Gradient clipping that sees every mesh, grafted onto whatever precision plugin the Trainer chose.

Why: Lightning clips in the precision plugin (``clip_grad_by_norm`` / ``clip_grad_by_value``) with
``torch.nn.utils`` on the optimizer's parameters. Under a hybrid plan those are DTensors and local
shards on several meshes: the default norm counts only local shards (wrong when weights are sharded),
and the default value clipping hands torch's foreach kernels a mix of tensors and DTensors (crash).
The runtime knows the meshes, so clipping is delegated to it.

The plugin keeps its class (``Precision``, ``MixedPrecision``, ``HalfPrecision``: contexts, conversion
and optimizer stepping unchanged); :func:`clip_across_meshes` returns a copy whose class adds the two
clipping methods in front of it.
"""

from __future__ import annotations

import functools
from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from ..parallel.runtime import Runtime


class _MeshClipping:
    """Mixin: clip through the runtime (every mesh and pipeline stage, each element counted once)."""

    galv_runtime: Runtime

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.galv_runtime.clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.galv_runtime.clip_grad_value_(float(clip_val))


@functools.cache
def _with_mesh_clipping(base: type) -> type:
    return type(f"MeshClipping{base.__name__}", (_MeshClipping, base), {})


def clip_across_meshes(plugin: Precision, runtime: Runtime) -> Precision:
    """A copy of ``plugin`` (same state) whose clipping goes through ``runtime``."""
    clipped: Any = object.__new__(_with_mesh_clipping(plugin_class(plugin)))
    clipped.__dict__.update(plugin.__dict__)
    clipped.galv_runtime = runtime
    return clipped


def plugin_class(plugin: Precision) -> type:
    """The plugin's own class, behind the clipping mixin if it has one."""
    cls = type(plugin)
    if issubclass(cls, _MeshClipping):
        return next(c for c in cls.__mro__[1:] if c is not _MeshClipping)
    return cls
