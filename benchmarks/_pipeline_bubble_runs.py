"""Rank-side code of ``benchmarks/pipeline_bubble.py``: time and count one pipeline step per configuration.

Every configuration (schedule, pp, dp per stage, micro-batches m) builds a fresh LLaMA, applies the plan with
``parallelize()`` and runs ``runtime.pipeline.run(x, y, loss, train=True)`` (forward + backward of the schedule
only: no gradient sync, no optimizer step - those are outside the pipeline bubble).

Instrumentation, all in this process and without touching the library:

* **busy time**: ``PipelineStage.forward_one_chunk`` / ``backward_one_chunk`` and the loss function are wrapped
  with ``perf_counter`` (wall) and ``thread_time`` (CPU of the calling thread, which runs the compute: 1
  intra-op thread, CPU autograd runs in the caller). Sends / receives / waits of the schedule are outside
  the wrapped calls, so ``busy`` is pure per-micro-batch compute.
* **step wall**: all ranks leave a barrier, then time ``pipeline.run`` (which ends with the loss broadcast from
  the last stage, so every rank ends together); the step's wall time is the max over ranks.
* **activation memory**: ``torch.autograd.graph.saved_tensors_hooks`` around the step count the bytes of
  distinct storages saved for backward that are still alive (parameters and buffers excluded); the peak over
  the step is compared with one micro-batch's saved bytes (total distinct saved bytes of the step / m).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import stage as _stage_mod

from lightning_galv.layout import MeshFactory, RankLayout
from lightning_galv.models import Llama, LlamaConfig
from lightning_galv.parallel.parallelize import parallelize
from lightning_galv.plan import LayerStrategy, ParallelPlan


class Clock:
    """Per-step accumulators of compute time (wall and thread CPU)."""

    def __init__(self) -> None:
        self.on = False
        self.reset()

    def reset(self) -> None:
        self.wall = self.cpu = 0.0
        self.calls = 0
        self.ops: list[tuple[str, int, float]] = []  # (kind F/B/L, micro-batch, thread CPU s) in call order

    def timed(self, fn: Any, kind: str) -> Any:
        clock = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not clock.on:
                return fn(*args, **kwargs)
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dc = time.thread_time() - c
                clock.wall += time.perf_counter() - w
                clock.cpu += dc
                clock.calls += 1
                mb = args[1] if kind in "FB" else -1
                clock.ops.append((kind, mb, dc))

        return wrapper


CLOCK = Clock()
_base = _stage_mod._PipelineStageBase
if not getattr(_base, "_bubble_bench_patched", False):  # patch the class once per process
    _base.forward_one_chunk = CLOCK.timed(_base.forward_one_chunk, "F")
    _base.backward_one_chunk = CLOCK.timed(_base.backward_one_chunk, "B")
    _base._bubble_bench_patched = True


class _Saved:
    __slots__ = ("counter", "ptr", "t")

    def __init__(self, counter: "SavedCounter", ptr: int, t: torch.Tensor) -> None:
        self.counter, self.ptr, self.t = counter, ptr, t

    def __del__(self) -> None:
        self.counter.release(self.ptr)


class SavedCounter:
    """Bytes of distinct storages saved for backward and still alive; peak and total over a step."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.alive: dict[int, list[int]] = {}  # storage ptr -> [nbytes, references]
        self.cur = self.peak = self.total = 0

    def pack(self, t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if ptr in self.exclude or nbytes == 0:
            return t
        ent = self.alive.get(ptr)
        if ent is None:
            ent = self.alive[ptr] = [nbytes, 0]
            self.cur += nbytes
            self.total += nbytes
            self.peak = max(self.peak, self.cur)
        ent[1] += 1
        return _Saved(self, ptr, t)

    @staticmethod
    def unpack(obj: Any) -> torch.Tensor:
        return obj.t if isinstance(obj, _Saved) else obj

    def release(self, ptr: int) -> None:
        ent = self.alive.get(ptr)
        if ent is None:
            return
        ent[1] -= 1
        if ent[1] == 0:
            del self.alive[ptr]
            self.cur -= ent[0]


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


_timed_ce = CLOCK.timed(_ce, "L")


def run_config(cfg: dict, model_cfg: dict, mbs: int, steps: int, warmup: int) -> dict[str, Any]:
    pp, dp, m, schedule = cfg["pp"], cfg["dp"], cfg["m"], cfg["schedule"]
    world = pp * dp
    rank = dist.get_rank()
    torch.manual_seed(0)
    mc = LlamaConfig(**model_cfg)
    model = Llama(mc)
    plan = ParallelPlan.uniform(world, mc.n_layers, LayerStrategy(dp=dp), pp=pp, micro_batches=m,
                                pipeline_schedule=schedule)
    rt = parallelize(model, plan, MeshFactory(RankLayout(world, pp), "cpu", rank))
    driver = rt.pipeline
    stage = next(iter(driver.stages))
    shard, nshards = rt.data_shard
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    gen = torch.Generator().manual_seed(1)
    b = m * mbs  # per data shard; micro-batch = mbs samples on every rank
    walls, busy_w, busy_c, peaks, totals, leftovers, proc_cpu, ops = [], [], [], [], [], [], [], []
    for step in range(warmup + steps):
        data = torch.randint(0, mc.vocab_size, (b * nshards, mc.max_seq_len + 1), generator=gen)
        x, y = data[shard * b:(shard + 1) * b, :-1], data[shard * b:(shard + 1) * b, 1:]
        counter = SavedCounter(exclude)
        dist.barrier()
        CLOCK.reset()
        CLOCK.on = True
        p0 = time.process_time()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            driver.run(x, y, _timed_ce, train=True)
        t1 = time.perf_counter()
        CLOCK.on = False
        if step >= warmup:
            walls.append(t1 - t0)
            busy_w.append(CLOCK.wall)
            busy_c.append(CLOCK.cpu)
            peaks.append(counter.peak)
            totals.append(counter.total)
            leftovers.append(counter.cur)
            proc_cpu.append(time.process_time() - p0)
            ops.append(list(CLOCK.ops))
        model.zero_grad(set_to_none=True)
    # the step wall time is the slowest rank's; gather per-step walls of all ranks
    all_walls = [None] * dist.get_world_size()
    dist.all_gather_object(all_walls, walls)
    step_wall = [max(ws) for ws in zip(*all_walls)]
    bubbles = [1 - bw / w for bw, w in zip(busy_w, step_wall)]
    out = {
        "rank": rank, "stage": stage, "pp": pp, "dp": dp, "m": m, "schedule": schedule, "world": world,
        "step_wall": statistics.median(step_wall),
        "busy_wall": statistics.median(busy_w),
        "busy_cpu": statistics.median(busy_c),
        "bubble": statistics.median(bubbles),
        "stretch": statistics.median(bw / max(bc, 1e-9) for bw, bc in zip(busy_w, busy_c)),
        "proc_cpu": statistics.median(proc_cpu),
        "peak_bytes": max(peaks),
        "mb_bytes": statistics.median(totals) / m,
        "leftover_bytes": max(leftovers),
        "calls": CLOCK.calls,
        "stage_rank": rank - stage * (world // pp),
        "ops": ops,
    }
    del driver, rt, model
    return out


def run_all(configs: list[dict], model_cfg: dict, mbs: int, steps: int, warmup: int) -> dict[str, Any]:
    """All configurations in one launch (start-up dominates a launch's cost on CPU)."""
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    t = time.perf_counter()
    res = [run_config(c, model_cfg, mbs, steps, warmup) for c in configs]
    return {"results": res, "load": (load0, os.getloadavg()[0]), "elapsed": time.perf_counter() - t}
