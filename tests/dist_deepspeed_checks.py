"""Trainer-level checks of the DeepSpeed ZeRO backend, run inside gloo ranks (see dist_lightning_checks).

Every check compares numbers with the single-process reference loop of ``dist_lightning_checks``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from dist_lightning_checks import LossRecorder, Windows, fit_compare, make_module, trainer_kwargs
from lightning_galv import GalvatronStrategy, LayerStrategy, ParallelPlan


def ds_plan(zero: int, n_layers: int = 3) -> dict[str, Any]:
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    return ParallelPlan.uniform(world, n_layers, LayerStrategy(dp=world, zero=zero), backend="deepspeed").to_dict()


def fit_deepspeed(zero: int, **kw: Any) -> dict[str, Any]:
    """Trainer.fit with DeepSpeed ZeRO-``zero`` vs the single-process loop (``fit_compare``'s numbers)."""
    return fit_compare(ds_plan(zero), **kw)


def engine_kind(zero: int) -> dict[str, Any]:
    """The strategy really trained through a DeepSpeed engine at the requested stage (not the native path)."""
    module = make_module()
    strategy = GalvatronStrategy(plan=ds_plan(zero))
    trainer = L.Trainer(strategy=strategy, max_steps=1, **trainer_kwargs())
    trainer.fit(module, DataLoader(Windows(16), batch_size=2))
    engine = strategy.runtime.engine  # type: ignore[union-attr]
    return {"engine": type(engine).__name__, "stage": engine.zero_optimization_stage(),
            "model_is_engine": strategy.model is engine, "optimizer": type(engine.optimizer).__name__}


def resume(zero: int | None, split: int = 3, steps: int = 6, global_batch: int = 8) -> dict[str, Any]:
    """Train ``split`` steps, save, resume in a new Trainer to ``steps``; ``zero=None`` runs the native backend.

    Returns the exact round-trip differences (weights, the engine's fp32 master partition, SGD momentum)
    measured on a Trainer that loads and trains no further, and the losses after resuming, which the
    test compares with the native backend's resume (``zero=None``) from the same launch.
    """
    world = int(os.environ["WORLD_SIZE"])  # the process group may not exist yet (the Trainer creates it)
    data = Windows(split * global_batch)
    ckpt = Path(tempfile.gettempdir()) / f"galv_ds_resume_{os.environ['MASTER_PORT']}" / "mid.ckpt"

    def run(max_steps: int, ckpt_path: Path | None) -> tuple[GalvatronStrategy, LossRecorder]:
        os.environ["WORLD_SIZE"] = str(world)  # the previous Trainer's teardown removed it
        strategy = GalvatronStrategy(zero=0) if zero is None else GalvatronStrategy(plan=ds_plan(zero))
        rec = LossRecorder()
        trainer = L.Trainer(strategy=strategy, max_steps=max_steps, callbacks=[rec], **trainer_kwargs())
        trainer.fit(make_module(), DataLoader(data, batch_size=global_batch // world),
                    ckpt_path=None if ckpt_path is None else str(ckpt_path))
        if ckpt_path is None:
            trainer.save_checkpoint(ckpt)
        return strategy, rec

    def snapshot(strategy: GalvatronStrategy) -> dict[str, torch.Tensor]:
        out = {k: v.clone() for k, v in strategy.lightning_module_state_dict().items()}
        if zero is not None:
            opt = strategy.runtime.engine.optimizer.optimizer  # type: ignore[union-attr]
            for i, group in enumerate(opt.param_groups):
                for j, q in enumerate(group["params"]):
                    out[f"fp32.{i}.{j}"] = q.detach().clone()
                    out[f"momentum.{i}.{j}"] = opt.state[q]["momentum_buffer"].clone()
        return out

    saved = snapshot(run(split, None)[0])
    loaded = snapshot(run(split, ckpt)[0])  # loads, trains no further
    _, rec = run(steps, ckpt)
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(ckpt.parent, ignore_errors=True)
    return {
        "roundtrip_err": max(float((saved[k] - loaded[k]).abs().max()) for k in saved),
        "keys_equal": sorted(saved) == sorted(loaded), "n_state": len(saved),
        "has_optimizer_state": any(k.startswith("momentum.") for k in saved),
        "resumed_losses": rec.losses,
    }


def bad_inputs() -> dict[str, str]:
    """Errors raised at setup, each a ValueError with a HINT."""
    out: dict[str, str] = {}
    for name, kw in {"clip_value": dict(gradient_clip_val=1.0, gradient_clip_algorithm="value")}.items():
        try:
            L.Trainer(strategy=GalvatronStrategy(plan=ds_plan(2)), max_steps=1, **trainer_kwargs(**kw)).fit(
                make_module(), DataLoader(Windows(16), batch_size=2))
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def run_many(cases: list[tuple[str, str, dict]]) -> dict[str, Any]:
    """Several checks in one launch: (name, function name, kwargs)."""
    out = {}
    world = os.environ["WORLD_SIZE"]
    for name, fn, kw in cases:
        os.environ["WORLD_SIZE"] = world  # a Trainer's teardown removes it; the next Trainer reads it
        out[name] = globals()[fn](**kw)
        dist.barrier()
        # no testing.release_subgroups() here: DeepSpeed keeps its process groups in module globals
        # (deepspeed.utils.groups) and the next engine would reuse destroyed ones
    return out
