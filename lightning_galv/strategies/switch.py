"""Switching a running fit to another plan, exactly, between two optimizer steps.

Why this shape: ``parallelize`` rewrites a model in place (DTensor parameters, FSDP2 module classes,
checkpoint wrappers, re-distribution hooks, pipeline placeholders), so a parallelized model cannot be
"un-applied". Instead the strategy keeps, from before the first ``parallelize``, a *pristine* copy of the
LightningModule's submodules whose parameters live on the meta device (no memory; buffers are real,
since non-persistent ones such as rotary tables are in no checkpoint). A switch then

1. writes the live state -- weights, optimizer states, LR schedulers -- as a sharded DCP checkpoint (the
   one format that already reshards between any two plans on load),
2. puts fresh copies of the pristine submodules back into the *same* LightningModule object (its own
   attributes, the Trainer's references and the callbacks' stay valid), materializes them and applies
   the new plan with ``parallelize``,
3. re-creates the optimizers and schedulers through ``configure_optimizers`` and loads the checkpoint into
   model and optimizers, then restores the schedulers' states,
4. tells callbacks that hold per-plan state (``on_galv_plan_switch(trainer, pl_module, old, new)``).

The data loader is left as it is, which is what makes the switch exact without touching Lightning's loop:
both plans must serve the loader the same layout (pipeline degree, data-parallel size, global batch,
micro-batches). Weights pass through the checkpoint bit for bit, so a run that switches ends where a run
on one plan ends (``tests/test_strategy.py``).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..plan import ParallelPlan, loader_layout

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl


class PristineCopy:
    """Copies of a module's direct children, taken before any parallelization, with meta-device parameters.

    One deep copy of all children together, so a parameter shared between two children (tied weights) stays
    one parameter in the copy and after :meth:`restore_into`; buffers are copied with their values.
    """

    def __init__(self, module: nn.Module) -> None:
        memo: dict[int, Any] = {id(module): module}  # a child pointing back at its parent keeps the original
        trainer = module.__dict__.get("_trainer")
        if trainer is not None:
            memo[id(trainer)] = trainer  # shared, never copied
        for p in module.parameters():
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        self.children: dict[str, nn.Module] = copy.deepcopy(dict(module.named_children()), memo)

    def restore_into(self, module: nn.Module, device: torch.device) -> None:
        """Replace ``module``'s children by new copies, parameters allocated (uninitialized) on ``device``."""
        fresh: dict[str, nn.Module] = copy.deepcopy(self.children, {id(module): module})
        made: dict[int, nn.Parameter] = {}  # one new tensor per distinct meta parameter (ties survive)
        for child in fresh.values():
            for owner in child.modules():
                for name, p in list(owner._parameters.items()):
                    if p is None:
                        continue
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                    owner._parameters[name] = made[id(p)]
            child.to(device)  # buffers (real values) follow
        for name, child in fresh.items():
            setattr(module, name, child)


def check_switch(old: ParallelPlan, new: ParallelPlan) -> None:
    """ValueError (with the differing fields and a HINT) unless ``new`` can replace ``old`` mid-fit."""
    if old.backend != "native" or new.backend != "native":
        raise ValueError(f"plan switch {old.backend} -> {new.backend}: only native plans switch mid-fit (the "
                         "DeepSpeed engine owns its model and optimizer). HINT: switch between native plans, or "
                         "stop, re-plan and resume from a checkpoint.")
    names = ("world_size", "pp", "data_parallel_size", "global_batch", "micro_batches", "layers", "backend")
    diff = [f"{n} {a} -> {b}" for n, a, b in zip(names, loader_layout(old), loader_layout(new)) if a != b]
    if diff:
        raise ValueError(f"plan switch changes {', '.join(diff)}: the running data loader serves one layout "
                         "(pipeline degree, data-parallel size, global batch, micro-batches). HINT: choose a plan "
                         "with the same values (lightning_galv.plan.loader_layout), or stop, re-plan "
                         "and resume from a checkpoint.")


def switch_plan(strategy: Any, trainer: "pl.Trainer", plan: ParallelPlan,
                directory: str | Path | None = None, keep_checkpoint: bool = False) -> Path | None:
    """Move the running fit of ``strategy`` (a GalvatronStrategy) to ``plan`` (module docstring); returns the
    checkpoint kept, if asked to."""
    from lightning.fabric.utilities.distributed import _distributed_is_initialized

    from ..parallel.parallelize import parallelize
    from .precision import clip_across_meshes

    old = strategy.plan
    assert old is not None and strategy.runtime is not None and strategy.model is not None
    if strategy.pristine is None:
        raise ValueError("switch_plan: this strategy kept no pristine copy of the model. HINT: call "
                         "strategy.keep_pristine_copy() before fit (PlanMonitor(replan=True) does it in setup).")
    if plan.vocab_parallel_loss != old.vocab_parallel_loss:  # the loss keeps what the module declared
        plan = plan.with_(vocab_parallel_loss=old.vocab_parallel_loss)
    check_switch(old, plan)
    module = strategy.lightning_module
    # 1. the live state as a sharded checkpoint (every rank writes its shards)
    # only rank 0 names a scratch folder (a folder made on every rank would be left behind on the others)
    scratch = tempfile.mkdtemp(prefix="galv_switch_") if directory is None and strategy.is_global_zero else None
    root = Path(strategy.broadcast(str(directory) if directory is not None else scratch))
    path = root / f"switch-step{trainer.global_step}"
    optimizers = [getattr(o, "_optimizer", o) for o in strategy.optimizers]
    checkpoint = {"state_dict": strategy.runtime.module_state(strategy.model, full=False),
                  "optimizer_states": [strategy.runtime.optimizer_state(strategy.model, o, full=False)
                                       for o in optimizers],
                  "lr_schedulers": [c.scheduler.state_dict() for c in strategy.lr_scheduler_configs],
                  "galv_plans": (old.to_dict(), plan.to_dict())}
    strategy.runtime.save(checkpoint, path, sharded=True, is_rank_zero=strategy.is_global_zero,
                          write_full=lambda *a: None)
    strategy.barrier()
    # 2. fresh submodules, the new plan applied (weights come from the checkpoint: no broadcast needed)
    strategy.pristine.restore_into(strategy.model, strategy.root_device)
    strategy.runtime = parallelize(strategy.model, plan, strategy.mesh_factory, sync_init=False,
                                   grad_bucket_bytes=strategy._grad_bucket_bytes,
                                   expert_sharding=strategy.expert_sharding)
    strategy.plan = plan
    strategy.precision_plugin = clip_across_meshes(strategy.precision_plugin, strategy.runtime)
    # 3. new optimizers and schedulers, then the checkpoint into model and optimizers
    strategy._reset_optimizers_and_schedulers()
    strategy.setup_optimizers(trainer)
    strategy.setup_precision_plugin()
    strategy.runtime.prepare(module, strategy.optimizers, clip_val=trainer.gradient_clip_val,
                             clip_algorithm=trainer.gradient_clip_algorithm,
                             precision=str(strategy.precision_plugin.precision))
    optimizers = [getattr(o, "_optimizer", o) for o in strategy.optimizers]
    rest = strategy.runtime.load(path, strategy.model, optimizers, strict=True, weights_only=False)
    saved = rest.get("lr_schedulers", [])
    if len(saved) != len(strategy.lr_scheduler_configs):
        raise RuntimeError(f"plan switch: configure_optimizers returned {len(strategy.lr_scheduler_configs)} "
                           f"schedulers after the switch, {len(saved)} before. HINT: configure_optimizers must "
                           "return the same optimizers and schedulers every time it is called.")
    for config, state in zip(strategy.lr_scheduler_configs, saved):
        config.scheduler.load_state_dict(state)
    strategy.barrier()
    if not keep_checkpoint and strategy.is_global_zero:
        shutil.rmtree(path, ignore_errors=True)
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
    if _distributed_is_initialized():
        strategy.barrier()
    # 4. callbacks with per-plan state
    for cb in trainer.callbacks:
        hook = getattr(cb, "on_galv_plan_switch", None)
        if callable(hook):
            hook(trainer, module, old, plan)
    return path if keep_checkpoint else None
