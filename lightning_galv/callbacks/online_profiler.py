"""``OnlineProfiler``: measure a running fit on sampled steps -- per layer, per collective, per step.

Why online: the planner's profiles are taken once, before training, on an idle machine; a real run
differs (other jobs, a slower link, sharding overheads the profile did not see). This callback measures
what the run actually does, every ``every_n_steps``-th training batch, and keeps it as structured
:class:`StepRecord` objects (and logs it through Lightning's loggers) for :class:`~.calibration.Calibration`
and the :class:`~.monitor.PlanMonitor`.

What is measured on a sampled batch, and how:

* **per layer** (every unit the plan addresses: ``embed``, ``layers.i``, ``head``): forward wall time from
  forward pre-/post-hooks; a forward that runs inside the backward (activation-checkpoint recompute) is
  counted as ``recompute``; backward wall time from tensor hooks -- it starts when the gradient of the
  layer's output arrives and ends when the gradient of its input is ready. Layer times include the layer's
  own collectives (TP, SP, Ulysses, EP all-to-all, ZeRO-3 gathers), as the cost model's layer times do.
* **collectives**: with ``collectives=True`` a ``torch.profiler`` session (CPU activity) runs for the
  sampled batch only; the backend's own events (``gloo:all_reduce``, ``nccl:all_to_all``, ...) time each
  collective from launch to completion, summed per operation.
* **step**: wall time from batch start to batch end (forward, backward, gradient sync and -- on the last
  micro-batch of an accumulation -- the optimizer step), max over ranks; samples/s and tokens/s from the
  batch's first dimension (and second, for token batches) times the data-parallel shards; MFU when
  ``flops_per_sample`` and ``peak_flops`` are given.
* **pipeline** (``pp > 1``): the start and end of every micro-batch's forward and backward on every stage of
  this rank's pipeline, from a common origin (a barrier of the pipeline group at batch start) -- the
  measured schedule, drawn by :func:`lightning_galv.plots.measured_timeline`; gaps are waits (bubble, sends).
* **memory**: peak per rank -- the CUDA allocator's peak on GPU (reset at the start of a sampled batch); on
  CPU the process's resident-set high-water mark (what the OS had to give it, ``VmHWM``), which never
  goes down.

Timing needs synchronization, and only sampled batches pay for it: on GPU the device is synchronized
around each timed region of a sampled batch; unsampled batches run untouched (no hooks fire).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn

from ..errors import bad_value


@dataclass(frozen=True)
class StepRecord:
    """What one sampled training batch measured on this rank (times in seconds, max over ranks where noted)."""

    step: int  # trainer.global_step when the batch started
    batch_idx: int
    step_time_s: float  # max over ranks
    samples: int  # global samples of the batch (loader batch x data shards)
    tokens: int | None
    layer_forward_s: dict[str, float] = field(default_factory=dict)
    layer_backward_s: dict[str, float] = field(default_factory=dict)
    layer_recompute_s: dict[str, float] = field(default_factory=dict)
    collective_s: dict[str, float] = field(default_factory=dict)  # backend op -> seconds (this rank)
    peak_memory_bytes: float = 0.0  # this rank
    mfu: float | None = None
    #: pipelined plans: every forward / backward of a micro-batch on the ranks of this rank's pipeline, as
    #: (global rank, "F" | "B", chunk, micro-batch, start s, end s), seconds from a barrier at batch start
    pipeline_ops: list[tuple[int, str, int, int, float, float]] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_time_s

    @property
    def layer_time_s(self) -> float:
        """Forward + backward + recompute of every layer on this rank."""
        return sum(self.layer_forward_s.values()) + sum(self.layer_backward_s.values()) + sum(
            self.layer_recompute_s.values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inside_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for v in x:
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


class _LayerTimer:
    """Forward/backward hooks on the plan's units, live only while a sampled batch runs."""

    def __init__(self, units: list[tuple[str, nn.Module]], device: torch.device) -> None:
        self.units, self.device = units, device
        self.fwd: dict[str, float] = {}
        self.bwd: dict[str, float] = {}
        self.rec: dict[str, float] = {}
        self._handles: list[Any] = []
        self._start: dict[str, float] = {}
        self._bwd_start: dict[str, float] = {}

    def __enter__(self) -> "_LayerTimer":
        for name, mod in self.units:
            self._handles.append(mod.register_forward_pre_hook(self._pre(name)))
            self._handles.append(mod.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            _sync(self.device)
            self._start[name] = time.perf_counter()
            x = _first_tensor(args)
            if x is not None and x.requires_grad and not _inside_backward():
                x.register_hook(self._bwd_end(name))  # input grad ready = this layer's backward done
        return hook

    def _post(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            _sync(self.device)
            dt = time.perf_counter() - self._start.pop(name, time.perf_counter())
            into = self.rec if _inside_backward() else self.fwd
            into[name] = into.get(name, 0.0) + dt
            y = _first_tensor(out)
            if y is not None and y.requires_grad and not _inside_backward():
                y.register_hook(self._bwd_begin(name))
        return hook

    def _bwd_begin(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            _sync(self.device)
            self._bwd_start[name] = time.perf_counter()
        return hook

    def _bwd_end(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            _sync(self.device)
            t0 = self._bwd_start.pop(name, None)
            if t0 is not None:
                self.bwd[name] = self.bwd.get(name, 0.0) + time.perf_counter() - t0
        return hook


_BACKENDS = ("gloo:", "nccl:", "ucc:", "mpi:")


def _backend_events(prof: Any) -> dict[str, float]:
    """Seconds per backend collective (``gloo:all_reduce`` -> ``all_reduce``) from a profiler session.

    Reads the raw Kineto events: ``prof.events()`` builds the whole FunctionEvent tree (parents, children,
    per-op aggregates), which costs about a third of a training step here for a few thousand ops -- the
    largest part of a sampled step's overhead -- while only the backend ops' durations are needed."""
    out: dict[str, float] = {}
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is not None:
        for e in raw.events():
            name = e.name()
            if name.startswith(_BACKENDS):
                op = name.split(":", 1)[1]
                out[op] = out.get(op, 0.0) + e.duration_ns() * 1e-9
        return out
    for fe in prof.events():  # profilers without Kineto results
        if fe.name.startswith(_BACKENDS):
            op = fe.name.split(":", 1)[1]
            out[op] = out.get(op, 0.0) + fe.cpu_time_total * 1e-6  # microseconds -> seconds
    return out


def _peak_memory(device: torch.device) -> float:
    from ..profiling.memory import peak_memory_bytes

    return peak_memory_bytes(device)


def units_of(pl_module: nn.Module, strategy: Any) -> list[tuple[str, nn.Module]]:
    """The modules the plan addresses (``embed``, ``layers.i``, ``head``), as the runtime holds them."""
    runtime = getattr(strategy, "runtime", None)
    units = getattr(runtime, "units", None)
    if units:
        out = []
        for u in units:
            if u.name == "embed" and u.modules:
                out.append(("embed", u.modules[0]))
            elif u.name == "head" and u.modules:
                out.append(("head", u.modules[-1]))
            elif u.modules:
                out.append((u.name, u.modules[0]))
        return out
    from ..models.protocol import find_parts

    parts = find_parts(pl_module)
    out = [(f"layers.{i}", b) for i, b in enumerate(parts.blocks)]
    if parts.embedding is not None:
        out.insert(0, ("embed", parts.embedding))
    if parts.head is not None:
        out.append(("head", parts.head))
    return out


def _pipeline_driver(strategy: Any) -> Any:
    """The strategy's pipeline driver when the plan has pp > 1 (``None`` otherwise)."""
    from ..parallel.pipeline import PipelineDriver

    driver = getattr(getattr(strategy, "runtime", None), "pipeline", None)
    return driver if isinstance(driver, PipelineDriver) else None


def _gather_ops(driver: Any, t0: float | None) -> list[tuple[int, str, int, int, float, float]]:
    """This pipeline's op logs, relative to the batch-start barrier, on every rank of the pipeline."""
    if driver is None or t0 is None:
        return []
    import torch.distributed as dist

    mine = [(dist.get_rank(), k, c, i, a - t0, b - t0) for k, c, i, a, b in (driver.op_log or [])]
    driver.op_log = None
    box: list[Any] = [None] * len(driver.group_ranks)
    dist.all_gather_object(box, mine, group=driver.group)
    return sorted((op for ops in box for op in ops), key=lambda op: (op[4], op[0]))


class OnlineProfiler(L.Callback):
    """Measure every ``every_n_steps``-th training batch (see the module docstring).

    Args:
        every_n_steps: sampling period in optimizer steps (the first micro-batch of a sampled step is
            measured). The default keeps the overhead of hooks, synchronization and the profiler session
            well under 2 % of training time (benchmarks/online_profiler_overhead.py measures it).
        warmup_steps: steps skipped at the start (allocator and caches warming up).
        collectives: time the backend's collectives with a ``torch.profiler`` session on sampled batches.
        log: send the measurements to the Trainer's loggers (``galv/step_time_s``, ``galv/layers.3/forward_s``, ...).
        flops_per_sample, peak_flops: for model FLOPs utilization (per device peak, FLOP/s); both or neither.
        timeline_png: pipelined plans: rank 0 draws each sampled step's measured schedule to this PNG
            (overwritten by the next sampled step; :func:`lightning_galv.plots.measured_timeline`, needs matplotlib).
    """

    def __init__(self, every_n_steps: int = 50, warmup_steps: int = 2, collectives: bool = True, log: bool = True,
                 flops_per_sample: float | None = None, peak_flops: float | None = None,
                 timeline_png: str | None = None) -> None:
        for name, value, low in (("every_n_steps", every_n_steps, 1), ("warmup_steps", warmup_steps, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise bad_value(f"{name}={value!r}", f"must be an int >= {low}",
                                "e.g. OnlineProfiler(every_n_steps=50, warmup_steps=2).")
        if (flops_per_sample is None) != (peak_flops is None):
            raise bad_value(f"flops_per_sample={flops_per_sample}, peak_flops={peak_flops}",
                            "MFU needs both or neither", "give the model's FLOPs per sample and the device's peak FLOP/s.")
        self.every_n_steps, self.warmup_steps = every_n_steps, warmup_steps
        self.collectives, self.log = collectives, log
        self.flops_per_sample, self.peak_flops = flops_per_sample, peak_flops
        self.timeline_png = timeline_png
        self.records: list[StepRecord] = []
        self._active: dict[str, Any] | None = None

    # -- sampling ----------------------------------------------------------------------------------
    def sampled(self, trainer: L.Trainer, batch_idx: int) -> bool:
        step = trainer.global_step
        first_micro = batch_idx % trainer.accumulate_grad_batches == 0
        return first_micro and step >= self.warmup_steps and (step - self.warmup_steps) % self.every_n_steps == 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self.sampled(trainer, batch_idx):
            return
        device = pl_module.device
        timer = _LayerTimer(units_of(pl_module, trainer.strategy), device).__enter__()
        prof = None
        if self.collectives:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU])
            prof.__enter__()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        driver = _pipeline_driver(trainer.strategy)
        t_pipe = None
        if driver is not None:
            import torch.distributed as dist

            dist.barrier(group=driver.group)  # the common origin of the stages' op times
            driver.op_log, t_pipe = [], time.perf_counter()
        _sync(device)
        self._active = {"timer": timer, "prof": prof, "t0": time.perf_counter(), "step": trainer.global_step,
                        "batch": batch, "driver": driver, "t_pipe": t_pipe}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._active is None:
            return
        act, self._active = self._active, None
        device = pl_module.device
        _sync(device)
        elapsed = time.perf_counter() - act["t0"]
        act["timer"].__exit__(None, None, None)
        comm: dict[str, float] = {}
        if act["prof"] is not None:
            act["prof"].__exit__(None, None, None)
            comm = _backend_events(act["prof"])
        step_time = float(trainer.strategy.reduce(torch.tensor(elapsed, device=device), reduce_op="max"))
        pipeline_ops = _gather_ops(act["driver"], act["t_pipe"])
        x = _first_tensor(batch)
        shards = trainer.strategy.distributed_sampler_kwargs.get("num_replicas", 1) if hasattr(
            trainer.strategy, "distributed_sampler_kwargs") else 1
        samples = int(x.shape[0]) * int(shards) if x is not None else 0
        tokens = samples * int(x.shape[1]) if x is not None and x.dim() >= 2 and not x.is_floating_point() else None
        mfu = (self.flops_per_sample * samples / step_time / (self.peak_flops * trainer.world_size)
               if self.flops_per_sample and self.peak_flops else None)
        timer = act["timer"]
        rec = StepRecord(act["step"], batch_idx, step_time, samples, tokens, dict(timer.fwd), dict(timer.bwd),
                         dict(timer.rec), comm, _peak_memory(device), mfu, pipeline_ops)
        self.records.append(rec)
        if self.timeline_png and rec.pipeline_ops and trainer.is_global_zero:
            from ..plots import _plt, measured_timeline

            fig = measured_timeline(rec, self.timeline_png, title=(
                f"measured step {rec.step}: {len({op[0] for op in rec.pipeline_ops})} stages, "
                f"{len({op[3] for op in rec.pipeline_ops})} micro-batches, step {rec.step_time_s * 1e3:.0f} ms"))
            _plt().close(fig)
        if self.log and trainer.loggers:
            metrics = {"galv/step_time_s": rec.step_time_s, "galv/samples_per_s": rec.samples_per_s,
                       "galv/peak_memory_bytes": rec.peak_memory_bytes}
            if tokens is not None:
                metrics["galv/tokens_per_s"] = tokens / step_time
            if mfu is not None:
                metrics["galv/mfu"] = mfu
            for kind, d in (("forward", rec.layer_forward_s), ("backward", rec.layer_backward_s),
                            ("recompute", rec.layer_recompute_s)):
                metrics.update({f"galv/{name}/{kind}_s": v for name, v in d.items()})
            metrics.update({f"galv/comm/{op}_s": v for op, v in comm.items()})
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
