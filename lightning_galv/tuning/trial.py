"""One tuning trial, inside each of its ranks: a real short ``Trainer.fit`` under one plan.

The tuner launches this in new processes (``lightning_galv.testing.run_distributed``: forks of servers that have
torch and Lightning imported, made to look like fresh interpreters) so a trial that crashes, hangs or runs out of
memory takes nothing else down. It runs the same path users run (the user's
LightningModule and data from importable factories, ``GalvatronStrategy(plan=...)``), times every step
(slowest rank), appends each measured step to a report file as it happens -- the tuner reads it to let
Optuna's pruner stop hopeless plans early -- and returns the step times and the peak memory.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from typing import Any, Callable

import lightning.pytorch as L
import torch

from ..profiling.memory import peak_memory_bytes


def load_object(path: str) -> Callable[..., Any]:
    """``"package.module:name"`` -> the object (factories must be importable in a fresh process)."""
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"factory {path!r}: must be an import path 'package.module:function'. HINT: define the "
                         "factory at module level in an importable file (trials run in fresh processes).")
    module, name = path.split(":", 1)
    return getattr(importlib.import_module(module), name)


class StepClock(L.Callback):
    """Wall time of every training step (slowest rank); measured steps go to ``report_path`` as JSON lines."""

    def __init__(self, warmup: int, report_path: str | None) -> None:
        self.warmup, self.report_path = warmup, report_path
        self.times: list[float] = []
        self.samples = 0
        self.min_shard_batch = 0  # smallest batch a shard saw: the batch search refuses a loader that ran short
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._t0 = time.perf_counter()
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        n = int(x.shape[0])
        self.min_shard_batch = min(self.min_shard_batch, n) if self.min_shard_batch else n
        if not self.samples:
            shards = trainer.strategy.distributed_sampler_kwargs.get("num_replicas", 1)
            self.samples = n * int(shards)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        dt = float(trainer.strategy.reduce(torch.tensor(time.perf_counter() - self._t0), reduce_op="max"))
        if trainer.global_step <= self.warmup:
            return
        self.times.append(dt)
        if self.report_path and trainer.is_global_zero:
            with open(self.report_path, "a") as f:
                f.write(json.dumps({"step": len(self.times), "seconds": dt, "samples": self.samples}) + "\n")


def make_data(data_factory: str, batch_size: int | None = None) -> Any:
    """The training data from ``data_factory``, with ``batch_size`` samples per data shard when given.

    Why several ways: the batch-size search (:func:`lightning_galv.tuning.largest_batch`) must change the
    batch of data the user built, and only the user's code knows how. In order: a factory with a
    ``batch_size`` parameter is called with it; a plain ``DataLoader`` is rebuilt around the same dataset
    (same collate, workers, shuffling, drop_last); a ``LightningDataModule`` with a ``batch_size`` attribute
    (or hyper-parameter) gets it set -- the attribute Lightning's own batch-size finder scales.
    """
    import inspect

    from torch.utils.data import DataLoader, RandomSampler

    factory = load_object(data_factory)
    if batch_size is None:
        return factory()
    try:
        takes = "batch_size" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins / C callables without a signature
        takes = False
    if takes:
        return factory(batch_size=batch_size)
    data = factory()
    if isinstance(data, DataLoader):
        if data.batch_size is None:  # a custom batch_sampler decides the batch: we cannot resize it
            raise TypeError(f"data factory {data_factory!r}: its DataLoader uses a custom batch_sampler, so its "
                            "batch cannot be resized. HINT: give the factory a batch_size parameter.")
        return DataLoader(data.dataset, batch_size=batch_size, shuffle=isinstance(data.sampler, RandomSampler),
                          num_workers=data.num_workers, collate_fn=data.collate_fn, pin_memory=data.pin_memory,
                          drop_last=data.drop_last, worker_init_fn=data.worker_init_fn,
                          persistent_workers=data.persistent_workers if data.num_workers else False)
    if isinstance(data, L.LightningDataModule):
        if hasattr(data, "batch_size"):
            data.batch_size = batch_size
            return data
        if "batch_size" in getattr(data, "hparams", {}):
            data.hparams.batch_size = batch_size
            return data
    raise TypeError(f"data factory {data_factory!r} returned {type(data).__name__}, whose batch size cannot be set. "
                    "HINT: give the factory a batch_size parameter, return a DataLoader, or a LightningDataModule "
                    "with a batch_size attribute.")


def run_trial(plan: dict, module_factory: str, data_factory: str, warmup: int, steps: int,
              report_path: str | None = None, extra_callbacks: tuple[str, ...] = (),
              batch_size: int | None = None) -> dict[str, Any]:
    """Train ``warmup + steps`` steps under ``plan``; return step times, samples per step, peak memory.

    ``batch_size``: samples per data shard (the loader's batch), for the batch-size search; None keeps the
    data factory's own."""
    from .. import GalvatronStrategy

    module = load_object(module_factory)()
    data = make_data(data_factory, batch_size)
    clock = StepClock(warmup, report_path)
    callbacks = [clock, *(load_object(c)() for c in extra_callbacks)]
    trainer = L.Trainer(strategy=GalvatronStrategy(plan=plan), accelerator="auto",
                        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), max_steps=warmup + steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=callbacks)
    oom = False
    try:
        if isinstance(data, L.LightningDataModule):
            trainer.fit(module, datamodule=data)
        else:
            trainer.fit(module, data)
    except torch.OutOfMemoryError:  # a completed trial whose memory constraint is violated, not a crash
        oom = True
    device = trainer.strategy.root_device
    peak = torch.tensor(float("inf") if oom else peak_memory_bytes(device))
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return {"step_times": clock.times, "samples": clock.samples, "peak_bytes": float(peak), "oom": oom,
            "min_shard_batch": clock.min_shard_batch}


def profile_run(module_factory: str, data_factory: str, memory_budget: Any) -> dict[str, Any]:
    """Every rank: profile this machine and the model the way automatic mode does (cached by what was measured).

    Runs inside an initialized process group (the tuner's launcher creates it)."""
    import torch.distributed as dist

    from ..auto import device_memory, measure_profiles, parse_bytes, priced_hardware
    from ..models.protocol import find_parts

    module = load_object(module_factory)()
    data = load_object(data_factory)()
    loader = data.train_dataloader() if isinstance(data, L.LightningDataModule) else data
    parts = find_parts(module)
    if not parts.understood or parts.shape is None:
        raise ValueError(f"{type(module).__name__}: the tuner searches hybrid plans, which need the block protocol "
                         "(lightning_galv.models.protocol). HINT: implement galv_blocks / galv_shape, or use "
                         "plain data parallelism without tuning.")
    world = dist.get_world_size()
    budget = parse_bytes(memory_budget) if memory_budget is not None else device_memory(torch.device("cpu"))
    loader_batch = getattr(loader, "batch_size", None)
    # as automatic mode profiles (the same cache entries)
    model, hw = measure_profiles(module, parts, world, budget, verbose=False, loader_batch=loader_batch)
    hw = priced_hardware(model, hw, budget)
    pipeline = all(callable(getattr(module, n, None)) for n in ("galv_pipeline_batch", "galv_pipeline_loss"))
    return {"model_profile": model.to_json(), "hardware_profile": hw.to_json(), "budget": budget,
            "loader_batch": loader_batch, "pipeline": pipeline}
