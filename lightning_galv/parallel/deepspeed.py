"""DeepSpeed ZeRO backend for pure data-parallel plans (``ParallelPlan(backend="deepspeed")``).

The native runtime (:func:`lightning_galv.parallel.parallelize`) implements ZeRO with FSDP2; this module
lets the same plan run through DeepSpeed's ZeRO engine instead, for users who rely on DeepSpeed's
optimizer partitioning and checkpoints. :class:`DeepSpeedRuntime` implements the
:class:`~.runtime.Runtime` protocol the strategy drives for every backend: ``prepare`` creates the
engine, ``backward`` / ``optimizer_step`` go through it, checkpoints use its format.

Design decisions, and why:

* **The process group is Lightning's.** ``deepspeed.init_distributed(dist_init_required=False)`` wraps
  the existing default group. Its C++ shared-memory all-reduce (used only for inference, compiled for
  ~60 s on first use) is switched off while DeepSpeed's communication backend is created.
* **The user's optimizer is used as is** (``zero_allow_untested_optimizer``): no DeepSpeed optimizer is
  compiled, and Lightning's LR schedulers keep stepping the same ``param_groups``.
* **Lightning owns gradient accumulation.** The engine runs with ``managed_gradient_accumulation=False``
  and ``gradient_accumulation_steps=1``: every ``engine.backward`` only accumulates (ZeRO-2/3 reduce
  into their partitions), and the single ``engine.step`` Lightning triggers at the accumulation boundary
  finalizes the reduction and updates. Lightning already divides the loss by ``accumulate_grad_batches``.
* **Clipping by global norm happens inside the engine** (``gradient_clipping`` = the Trainer's
  ``gradient_clip_val``), because under ZeRO-2/3 ``param.grad`` is not where the gradients live. Its
  formula equals ``torch.nn.utils.clip_grad_norm_``.
* **Checkpoints are DeepSpeed's folder format** (``engine.save_checkpoint``): model and partitioned
  optimizer state per rank, Lightning's loop/callback/scheduler state as DeepSpeed ``client_state``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..plan import ParallelPlan
from . import state_dict as ckpt
from .runtime import StepCall

_TAG = "checkpoint"


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plan backend='deepspeed' needs the deepspeed package. "
                          "HINT: pip install deepspeed (or use backend='native', which needs nothing extra).") from e
    return deepspeed


def init_deepspeed_comm(backend: str | None = None) -> None:
    """Let DeepSpeed use the process group Lightning already created, without compiling its shm op."""
    deepspeed = _import_deepspeed()
    import deepspeed.comm.comm as ds_comm

    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: the DeepSpeed backend reuses the strategy's "
                         "process group. HINT: run through Trainer(strategy=GalvatronStrategy(...)), which "
                         "creates it in setup_environment.")
    if ds_comm.cdb is not None and ds_comm.cdb.is_initialized():
        return
    ops = deepspeed.ops.__compatible_ops__  # probed once and cached by deepspeed: edits persist
    saved = ops.get("deepspeed_shm_comm", False)
    ops["deepspeed_shm_comm"] = False  # TorchBackend builds the shm op only if marked compatible
    try:
        deepspeed.init_distributed(dist_backend=backend or dist.get_backend(), dist_init_required=False,
                                   verbose=False)
    finally:
        ops["deepspeed_shm_comm"] = saved


def build_config(zero_stage: int, *, clip_val: float | None, clip_algorithm: str | None,
                 precision: str) -> dict[str, Any]:
    """The DeepSpeed config for one Trainer run (validated here so errors name the Trainer setting)."""
    if precision not in ("32-true", "32", "bf16-mixed"):
        raise ValueError(f"precision={precision!r} with plan backend='deepspeed': supported are '32-true' and "
                         "'bf16-mixed'. HINT: bf16-true keeps no fp32 master weights here; use bf16-mixed, or "
                         "backend='native'.")
    clip = float(clip_val or 0.0)
    if clip and clip_algorithm not in (None, "norm"):
        raise ValueError(f"gradient_clip_algorithm={clip_algorithm!r} with plan backend='deepspeed': DeepSpeed "
                         "clips by global norm only. HINT: use gradient_clip_algorithm='norm' or backend='native'.")
    if clip < 0 or math.isnan(clip):
        raise ValueError(f"gradient_clip_val={clip_val!r}: must be >= 0. HINT: use e.g. 1.0, or None for no clipping.")
    return {
        "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: Lightning's data loader decides the batch
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # Lightning decides the boundary (see module docstring)
        "gradient_clipping": clip,
        "zero_allow_untested_optimizer": True,  # the user's torch optimizer; nothing gets compiled
        "zero_optimization": {"stage": zero_stage, "overlap_comm": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedRuntime:
    """Drives one DeepSpeed engine for a pure data-parallel plan; the strategy calls it per hook."""

    def __init__(self, plan: ParallelPlan, rank: int, world_size: int) -> None:
        if plan.backend != "deepspeed":
            raise ValueError(f"plan backend={plan.backend!r}: DeepSpeedRuntime runs backend='deepspeed' plans. "
                             "HINT: use lightning_galv.parallel.parallelize for native plans.")
        _import_deepspeed()  # fail at setup, with the install hint, not at the first step
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.zero_stage = plan.layers[0].zero
        self.engine: Any = None
        self.clip_val = 0.0

    # -- the Runtime protocol ----------------------------------------------------------------------
    @property
    def data_shard(self) -> tuple[int, int]:
        """Pure data parallelism: every rank reads its own shard."""
        return self.rank, self.world_size

    def check_loader(self, loader: object) -> None:
        """Any loader works: Lightning's own step consumes what it yields."""

    def prepare(self, module: nn.Module, optimizers: list[torch.optim.Optimizer], *, clip_val: float | None,
                clip_algorithm: str | None, precision: str) -> nn.Module:
        """Create the engine around ``module`` (the LightningModule) with the user's optimizer."""
        if len(optimizers) != 1:
            raise ValueError(f"{len(optimizers)} optimizers with plan backend='deepspeed': a DeepSpeed engine "
                             "drives exactly one. HINT: return one optimizer from configure_optimizers, or use "
                             "backend='native'.")
        deepspeed = _import_deepspeed()
        if self.engine is not None:
            raise ValueError("plan backend='deepspeed': the model already belongs to a DeepSpeed engine from an "
                             "earlier fit. HINT: create a new LightningModule (and Trainer) for each fit; "
                             "validate/test/predict on the same Trainer work.")
        config = build_config(self.zero_stage, clip_val=clip_val, clip_algorithm=clip_algorithm,
                              precision=precision)
        self.clip_val = float(config["gradient_clipping"])
        init_deepspeed_comm()
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizers[0], config=config,
                                               dist_init_required=False)
        self.engine = engine
        return engine

    def step(self, call: StepCall) -> Any:
        return call.default()  # the strategy's model is the engine: Lightning's step runs through it

    def set_gradient_sync(self, enabled: bool) -> None:
        """Nothing to do: with unmanaged accumulation the engine reduces at ``step()`` only."""

    def backward(self, loss: torch.Tensor, default: Callable[[torch.Tensor], None]) -> None:
        """``engine.backward`` instead of ``loss.backward``: it runs ZeRO's pre/post-backward bookkeeping."""
        self.engine.backward(loss)

    def after_backward(self) -> None:
        """Nothing to do: the engine reduces gradients in its backward / step."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> None:
        """Lightning's clip hook: the engine already clips at ``step()`` with the configured value."""
        if float(norm_type) != 2.0 or float(max_norm) != self.clip_val:
            raise ValueError(f"clip_gradients(max_norm={max_norm}, norm_type={norm_type}) with plan "
                             f"backend='deepspeed': the engine clips by the 2-norm to the Trainer's "
                             f"gradient_clip_val={self.clip_val}, fixed when it was created. "
                             "HINT: set Trainer(gradient_clip_val=...) instead of clipping by hand.")

    def clip_grad_value_(self, clip_value: float) -> None:
        """Refused (Trainer settings are refused earlier, in :func:`build_config`): ZeRO owns the gradients."""
        raise ValueError(f"clip_grad_value_({clip_value}) with plan backend='deepspeed': the engine clips by "
                         "global norm only. HINT: use gradient_clip_algorithm='norm' or backend='native'.")

    def optimizer_step(self, step: Callable[[Any], Any], optimizer: torch.optim.Optimizer) -> Any:
        """Lightning's step (closure, hooks, clipping) with the engine's ``step()`` as the update."""
        return step(_EngineOptimizer(self.engine, optimizer))

    # -- checkpoints -------------------------------------------------------------------------------
    def module_state(self, model: nn.Module, full: bool) -> dict[str, Any]:
        """Full (unsharded) weights on every rank, keys as the unwrapped model's (any ``full``)."""
        if self.engine is None:  # no fit yet: the model is a plain replicated module
            return ckpt.model_state(model, full=full)
        module = self.engine.module
        if self.zero_stage == 3:
            deepspeed = _import_deepspeed()
            params = list(module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, full: bool) -> dict[str, Any]:
        return {}  # partitioned inside the engine; save() writes it in DeepSpeed's format

    def save(self, checkpoint: dict[str, Any], path: Path, *, sharded: bool, is_rank_zero: bool,
             write_full: Callable[[dict[str, Any], Path], None]) -> None:
        """Engine state (weights + partitioned optimizer) plus Lightning's loop state as client state."""
        if self.engine is None:
            raise ValueError(f"checkpoint {str(path)!r} with plan backend='deepspeed' before any fit: the engine "
                             "that owns the weights and optimizer does not exist yet. HINT: save during or after "
                             "Trainer.fit.")
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(str(path), client_state=client_state, tag=_TAG)

    def load(self, path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], *, strict: bool,
             weights_only: bool | None) -> dict[str, Any]:
        """Restore weights and optimizer state into the engine; return Lightning's part of the checkpoint."""
        if self.engine is None:
            raise ValueError(f"checkpoint {str(path)!r} with plan backend='deepspeed' outside Trainer.fit: only "
                             "the engine reads DeepSpeed's checkpoint folder. HINT: resume with "
                             "Trainer.fit(ckpt_path=...), or evaluate a native checkpoint with backend='native'.")
        if not (path / _TAG).is_dir():
            raise ValueError(f"checkpoint {str(path)!r}: not a DeepSpeed checkpoint folder (no {_TAG!r} tag inside). "
                             "HINT: plans with backend='deepspeed' resume only from checkpoints they wrote; load "
                             "native checkpoints with backend='native'.")
        load_path, client_state = self.engine.load_checkpoint(str(path), tag=_TAG, load_module_strict=strict,
                                                              load_optimizer_states=True,
                                                              load_lr_scheduler_states=False)
        if load_path is None:
            raise ValueError(f"checkpoint {str(path)!r}: DeepSpeed could not load it. HINT: check that it was "
                             "written by the same world size and ZeRO stage.")
        return dict(client_state or {})


class _EngineOptimizer:
    """What Lightning's precision plugin steps: runs its closure, then the engine's ``step()``.

    Lightning's ``Precision.optimizer_step`` calls ``optimizer.step(closure=...)``, where the closure
    runs forward, backward, ``on_before_optimizer_step`` and clipping; the update itself must be the
    engine's (ZeRO partitions, gradient clipping, zeroing). Other attributes (``param_groups`` for LR
    schedulers and hooks) are the user's optimizer's.
    """

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer) -> None:
        self._engine = engine
        self._optimizer = optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        result = closure() if closure is not None else None
        self._engine.step()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)
