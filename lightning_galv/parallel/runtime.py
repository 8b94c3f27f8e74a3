"""The runtime protocol: everything the strategy drives once a plan has been applied.

Why a protocol: the strategy must stay thin and must not branch on backends or pipelines. Three runtimes
implement the same calls, each holding what is specific to it:

* :class:`ParallelRuntime` (this module) -- native plans without a pipeline: Lightning's own step runs
  the model; gradients are reduced per unit (FSDP2 hooks, :class:`~.data.GradientSync`), clipped over
  every mesh, and ZeRO-1 wraps the optimizer.
* :class:`~.pipeline.PipelineRuntime` -- native plans with ``pp > 1``: the step itself runs the
  schedule (forward *and* backward of every micro-batch), so it holds the schedule's gradients back
  until Lightning's backward hook (Lightning zeroes gradients in between).
* :class:`~.deepspeed.DeepSpeedRuntime` -- ``backend="deepspeed"``: the engine owns the backward, the
  optimizer step, clipping and the checkpoint format.

Order of the calls in a training step (the strategy's hooks, in Lightning's order)::

    step(StepCall("train", ...))  ->  backward(loss, default)  ->  after_backward()
        -> clip_grad_norm_ / clip_grad_value_  (inside optimizer_step's closure)  ->  optimizer_step(step, opt)

with ``set_gradient_sync(False)`` around the non-final micro-steps of gradient accumulation.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from . import state_dict as ckpt
from ..layout import MeshFactory, RankLayout
from ..plan import LayerStrategy, ParallelPlan
from . import grads
from .data_parallel import GradientSync, OptimizerStateSharding
from .optim import step_on_local_shards

StepKind = Literal["train", "val", "test", "predict"]


@dataclass(frozen=True)
class StepCall:
    """One step as the strategy hands it over: what to run, and Lightning's default way of running it.

    ``default`` is Lightning's own step (forward through the model the strategy holds); runtimes that do
    not drive the model themselves just call it. ``context`` is the precision plugin's step context,
    which a runtime that bypasses ``default`` must enter itself. ``accumulate`` is the Trainer's
    gradient-accumulation factor (a runtime that runs its own backward divides the loss by it, as
    Lightning does before its backward).
    """

    kind: StepKind
    batch: Any
    module: Any  # the user's LightningModule (pipeline hooks such as galv_pipeline_batch live on it)
    default: Callable[[], Any]
    context: Callable[[], AbstractContextManager[Any]]
    accumulate: int = 1


@dataclass
class Unit:
    """A piece of the model that one strategy addresses."""

    name: str
    modules: list[nn.Module]
    strategy: LayerStrategy
    extra: list[nn.Parameter] = field(default_factory=list)  # loose parameters, always replicated
    chunk: int = 0  # pipeline chunk the unit belongs to
    experts: list[nn.Module] = field(default_factory=list)  # this rank's experts (MoE layer with ep > 1)

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        for p in self.extra:
            seen.setdefault(id(p), p)
        return list(seen.values())


@runtime_checkable
class Runtime(Protocol):
    """What the strategy drives after setup (see the module docstring for the call order)."""

    plan: ParallelPlan

    @property
    def data_shard(self) -> tuple[int, int]:
        """(index, count) of the sample shard this rank's loader serves."""
        ...

    def check_loader(self, loader: object) -> None:
        """Refuse, at setup, a training loader this runtime cannot consume (ValueError with a HINT)."""
        ...

    def prepare(self, module: nn.Module, optimizers: list[torch.optim.Optimizer], *, clip_val: float | None,
                clip_algorithm: str | None, precision: str) -> nn.Module | None:
        """Take over the optimizers for a fit; return a module that replaces the strategy's model, or None."""
        ...

    def step(self, call: StepCall) -> Any:
        """Run one train/val/test/predict step and return what Lightning expects from it."""
        ...

    def set_gradient_sync(self, enabled: bool) -> None:
        """Skip (accumulation micro-steps) or perform gradient reduction on the next backward."""
        ...

    def backward(self, loss: torch.Tensor, default: Callable[[torch.Tensor], None]) -> None:
        """Back-propagate ``loss``; ``default`` is Lightning's backward (the module's ``backward`` hook)."""
        ...

    def after_backward(self) -> None:
        """Reduce what the backward left unreduced, unless gradient sync is off."""
        ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip by the global norm over every mesh and stage."""
        ...

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clip every gradient element to ``[-clip_value, clip_value]``."""
        ...

    def optimizer_step(self, step: Callable[[Any], Any], optimizer: torch.optim.Optimizer) -> Any:
        """Run Lightning's optimizer step ``step(optimizer_like)`` (closure, hooks, clipping, update)."""
        ...

    def module_state(self, model: nn.Module, full: bool) -> dict[str, Any]:
        """The model's state dict: full tensors (``full``) or this rank's shards (for DCP)."""
        ...

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, full: bool) -> dict[str, Any]:
        """The optimizer's state dict, independent of the plan that wrote it."""
        ...

    def save(self, checkpoint: dict[str, Any], path: Path, *, sharded: bool, is_rank_zero: bool,
             write_full: Callable[[dict[str, Any], Path], None]) -> None:
        """Write ``checkpoint``: a DCP folder (``sharded``) or, through ``write_full``, one file."""
        ...

    def load(self, path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], *, strict: bool,
             weights_only: bool | None) -> dict[str, Any]:
        """Restore weights and optimizer states; return the rest of the checkpoint (Lightning's loop state)."""
        ...


@dataclass
class ParallelRuntime:
    """The native runtime (``parallelize()``, ``pp == 1``): units, their meshes, gradient and ZeRO-1 state."""

    plan: ParallelPlan
    layout: RankLayout
    factory: MeshFactory
    rank: int
    units: list[Unit]
    data_strategy: LayerStrategy
    grad_sync: GradientSync
    zero1: OptimizerStateSharding
    fsdp_units: list[nn.Module] = field(default_factory=list)  # modules with their own FSDP2 state (ZeRO-2/3)
    fsdp_root: nn.Module | None = None  # the parameter-less FSDP2 root shared by the units (pp == 1), if any
    params: list[nn.Parameter] = field(default_factory=list)  # this stage's, same order on its ranks
    pipeline: Any = None  # PipelineDriver when plan.pp > 1 (PipelineRuntime)
    sync_enabled: bool = True

    # -- data loading ------------------------------------------------------------------------------
    @property
    def data_shard(self) -> tuple[int, int]:
        return self.layout.batch_shard(self.data_strategy, self.rank)

    def check_loader(self, loader: object) -> None:
        """Any loader works: Lightning's own step consumes what it yields."""

    # -- steps -------------------------------------------------------------------------------------
    def prepare(self, module: nn.Module, optimizers: list[torch.optim.Optimizer], *, clip_val: float | None,
                clip_algorithm: str | None, precision: str) -> nn.Module | None:
        for opt in optimizers:
            self.wrap_optimizer(opt)
        return None

    def step(self, call: StepCall) -> Any:
        return call.default()

    # -- gradients ---------------------------------------------------------------------------------
    def set_gradient_sync(self, enabled: bool) -> None:
        self.sync_enabled = enabled
        self.grad_sync.enabled = enabled
        # per unit (recursing into nested expert states); the shared root has no parameter group of its own,
        # and its state context's ``is_last_backward`` stays True, so every backward still finalizes (waits
        # for its reduce-scatters and clears the prefetch order) as each unit's own root did before
        for m in self.fsdp_units:
            m.set_requires_gradient_sync(enabled)  # type: ignore[operator]

    def backward(self, loss: torch.Tensor, default: Callable[[torch.Tensor], None]) -> None:
        default(loss)

    def after_backward(self) -> None:
        if self.sync_enabled:
            self.grad_sync.sync()

    def sync_gradients(self) -> None:
        """Reduce the ZeRO-0/1 gradients now (FSDP2 units reduce in their own backward hooks)."""
        self.grad_sync.sync()

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over every mesh and stage, each element counted once."""
        return grads.grad_norm(self.params, self.layout.stage_size, norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return grads.clip_grad_norm_(self.params, self.layout.stage_size, max_norm, norm_type)

    def clip_grad_value_(self, clip_value: float) -> None:
        grads.clip_grad_value_(self.params, clip_value)

    # -- optimizers --------------------------------------------------------------------------------
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """DTensor parameters step on their local shards (elementwise optimizers), mixed DTensor/plain groups step
        apart (multi-tensor kernels refuse the mix), then ZeRO-1 ownership."""
        step_on_local_shards(optimizer)
        self.zero1.wrap(optimizer)

    def optimizer_step(self, step: Callable[[Any], Any], optimizer: torch.optim.Optimizer) -> Any:
        return step(optimizer)

    # -- checkpoints -------------------------------------------------------------------------------
    @property
    def expert_parallel(self) -> bool:
        """Whether ranks of one stage hold different experts (full checkpoints must then gather them).

        Read from the plan, not from this rank's units: the answer picks a collective, so every rank must give
        the same one -- under a pipeline, a stage without expert-parallel layers too."""
        return any(s.ep > 1 for s in self.plan.layers)

    def module_state(self, model: nn.Module, full: bool) -> dict[str, Any]:
        return ckpt.model_state(model, full=full, pipeline=self.pipeline, experts=self.expert_parallel)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, full: bool) -> dict[str, Any]:
        return ckpt.optimizer_state(model, optimizer, self.zero1, full=full, pipeline=self.pipeline,
                                    experts=self.expert_parallel)

    def save(self, checkpoint: dict[str, Any], path: Path, *, sharded: bool, is_rank_zero: bool,
             write_full: Callable[[dict[str, Any], Path], None]) -> None:
        if sharded:
            ckpt.save_sharded(checkpoint, path, is_rank_zero=is_rank_zero)
        else:
            write_full(checkpoint, path)

    def load(self, path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], *, strict: bool,
             weights_only: bool | None) -> dict[str, Any]:
        return ckpt.load(path, model, optimizers, self.zero1, strict=strict, weights_only=weights_only)
