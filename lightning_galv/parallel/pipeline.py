"""Pipeline parallelism: stages from the plan, schedules from ``torch.distributed.pipelining``.

The plan cuts the layers into ``pp * virtual_stages`` chunks (``pp_division``, possibly uneven); chunk
``c`` runs on pipeline stage ``c % pp`` (so interleaved 1F1B gives every stage ``virtual_stages``
chunks). The embedding sits in chunk 0, final norm + head in the last chunk. Each rank keeps only
the modules of its chunks: the others are replaced by empty placeholders *in place*, so the module
names - and therefore checkpoint keys - stay those of the unwrapped model.

Inside a chunk every layer keeps its own :class:`LayerStrategy` on the stage's ranks (parallelize()
applies them). Between chunks an activation travels in the data loader's batch layout: rank ``l`` of
stage ``s`` sends to rank ``l`` of stage ``s+1``, which holds the same batch shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..models.dropout import restart_calls, set_coords, use_coords
from ..models.protocol import ModelParts, unwrap_model
from ..plan import ParallelPlan
from .runtime import ParallelRuntime, StepCall


class Placeholder(nn.Module):
    """Stands where a module of another pipeline stage was (no parameters, never called)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this module lives on another pipeline stage. HINT: under pp > 1 the model runs "
                           "through the pipeline schedule (the strategy's training/validation steps), not model(x).")


def owned_chunks(plan: ParallelPlan, stage: int) -> list[int]:
    return [c for c in range(plan.pp * plan.virtual_stages) if c % plan.pp == stage]


def _replace(root: nn.Module, target: nn.Module, new: nn.Module) -> None:
    for name, mod in list(root.named_modules()):
        for child_name, child in list(mod.named_children()):
            if child is target:
                setattr(mod, child_name, new)


def loose_modules(root: nn.Module, parts: ModelParts) -> list[nn.Module]:
    """Modules holding parameters outside blocks / embedding / final norm / head (e.g. GPT-2's wpe)."""
    owned = {id(p) for m in (*parts.blocks, parts.embedding, parts.final_norm, parts.head) if m is not None
             for p in m.parameters()}
    return [m for m in root.modules()
            if any(id(p) not in owned for p in m.parameters(recurse=False))]


class StageModule(nn.Module):
    """One pipeline chunk: (embedding ->) blocks (-> final norm -> head). Shares modules with the model."""

    def __init__(self, inner: nn.Module, parts: ModelParts, layers: range, first: bool, last: bool,
                 loose: list[nn.Module]) -> None:
        super().__init__()
        self._inner = [inner]  # a list, so the whole model is not registered as a child
        self.first, self.last = first, last
        self.blocks = nn.ModuleList(parts.blocks[i] for i in layers)
        if first:
            self.embedding = parts.embedding
            self.loose = nn.ModuleList(loose)
        if last:
            self.final_norm = parts.final_norm
            self.head = parts.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self._inner[0]
        if self.first:
            embed = getattr(inner, "galv_embed_forward", None)
            x = embed(x) if embed is not None else self.embedding(x)  # [b, s] -> [b, s, h]
        for block in self.blocks:
            x = block(x)
        if self.last:
            head = getattr(inner, "galv_head_forward", None)
            if head is not None:
                x = head(x)
            else:
                x = self.head(self.final_norm(x) if self.final_norm is not None else x)  # [b, s, vocab]
        return x


def split_model(model: nn.Module, parts: ModelParts, plan: ParallelPlan, stage: int) -> dict[int, StageModule]:
    """Keep this stage's chunks, replace everything else by placeholders; return chunk -> StageModule."""
    if not parts.understood or parts.embedding is None or parts.head is None:
        raise ValueError(f"pp={plan.pp}: pipeline stages need the block protocol (embedding, blocks, head). "
                         "HINT: expose galv_blocks/galv_embedding/galv_head (lightning_galv.models.protocol) "
                         "or use pp=1.")
    chunks = owned_chunks(plan, stage)
    n = plan.pp * plan.virtual_stages
    layers = {i for c in chunks for i in plan.stage_layers(c)}
    loose = loose_modules(model, parts)
    if any(m is model or m is unwrap_model(model) for m in loose):
        raise ValueError("model holds parameters directly on its root module: they cannot be assigned to a "
                         "pipeline stage. HINT: put them in a submodule (e.g. an nn.Embedding) or use pp=1.")
    stages = {c: StageModule(unwrap_model(model), parts, plan.stage_layers(c), c == 0, c == n - 1, loose)
              for c in chunks}
    for i, block in enumerate(parts.blocks):
        if i not in layers:
            parts.blocks[i] = Placeholder()
    if 0 not in chunks:
        for m in [parts.embedding, *loose]:
            _replace(model, m, Placeholder())
        parts.embedding = None
    if n - 1 not in chunks:
        for m in (parts.final_norm, parts.head):
            if m is not None:
                _replace(model, m, Placeholder())
        parts.final_norm = parts.head = None
    return stages


#: one pipeline op as the driver logs it: ("F" | "B", chunk (stage index), micro-batch, start s, end s)
PipelineOp = tuple[str, int, int, float, float]


def _instrument(stage: Any, chunk: int, driver: "PipelineDriver") -> None:
    """Wrap the stage's per-micro-batch ops.

    Keyed dropout needs the micro-batch index of every forward: the schedule passes it to
    ``forward_one_chunk`` (not to the module), so record it there. Shape inference, which also runs
    the module, does not go through this method. And while ``driver.op_log`` is a list (the online
    profiler sets one on a sampled step), each forward and backward of a micro-batch is timed into it --
    the measured pipeline timeline. Unsampled steps pay one attribute check per op."""
    def timed(kind: str, op: Callable[..., Any]) -> Callable[..., Any]:
        """``op`` (the stage's own per-micro-batch forward or backward), logged into ``driver.op_log`` if set."""
        def run(micro: int, *args: Any, **kwargs: Any) -> Any:
            log = driver.op_log
            if log is None:
                return op(micro, *args, **kwargs)
            t0 = driver.clock()
            out = op(micro, *args, **kwargs)
            log.append((kind, chunk, micro, t0, driver.clock()))
            return out
        return run

    fwd, backward_one_chunk = timed("F", stage.forward_one_chunk), timed("B", stage.backward_one_chunk)

    def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        set_coords(micro=fwd_chunk_id)  # keyed dropout: the micro-batch of every forward, logged or not
        restart_calls(fwd_chunk_id)  # ... its calls counted from 0, as one process counts the whole batch's
        return fwd(fwd_chunk_id, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk


@dataclass
class PipelineDriver:
    """Runs a training or evaluation step of the schedule over this rank's chunks."""

    plan: ParallelPlan
    stages: dict[int, StageModule]
    group: Any  # the pipeline process group (same local rank in every stage)
    group_ranks: list[int]
    device: torch.device
    _cache: dict[Any, Any] = field(default_factory=dict)
    #: while a list, every forward / backward of a micro-batch on this rank is appended to it (see _instrument)
    op_log: list[PipelineOp] | None = None

    def clock(self) -> float:
        """Wall time for the op log; on GPU after the device finished what was queued, so an op's end is
        when its kernels ended, not when they were launched."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @property
    def has_first(self) -> bool:
        return 0 in self.stages

    @property
    def has_last(self) -> bool:
        return self.plan.pp * self.plan.virtual_stages - 1 in self.stages

    def _schedule(self, key: Any, loss_fn: Callable | None) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if key in self._cache:
            sched = self._cache[key]
            sched._loss_fn = loss_fn
            return sched
        n = self.plan.pp * self.plan.virtual_stages
        stages = [PipelineStage(mod, c, n, self.device, group=self.group) for c, mod in sorted(self.stages.items())]
        for c, st in zip(sorted(self.stages), stages):
            _instrument(st, c, self)
        m = self.plan.micro_batches
        if self.plan.pipeline_schedule == "interleaved_1f1b":
            sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
        else:
            cls = ScheduleGPipe if self.plan.pipeline_schedule == "gpipe" else Schedule1F1B
            sched = cls(stages[0], m, loss_fn=loss_fn)
        self._cache[key] = sched
        return sched

    def run(self, inputs: torch.Tensor, targets: torch.Tensor | None, loss_fn: Callable | None,
            train: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One schedule step. Returns (mean micro-batch loss on every rank or None, last-stage output)."""
        m = self.plan.micro_batches
        if inputs.shape[0] % m:
            raise ValueError(f"local batch of {inputs.shape[0]} samples: cannot split into micro_batches={m}. "
                             f"HINT: make the per-shard batch size a multiple of {m}.")
        key = ("train" if train else "eval", tuple(inputs.shape), loss_fn is not None)
        sched = self._schedule(key, loss_fn)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs: dict[str, Any] = {}
        if self.has_last and loss_fn is not None:
            kwargs.update(target=targets, losses=losses)
        with use_coords(micro_batches=m, loader_shards=self.plan.data_parallel_size):
            out = sched.step(*args, **kwargs) if train else sched.eval(*args, **kwargs)
        loss = None
        if loss_fn is not None:
            # fp32 on every stage: under bf16-true precision the default dtype inside a step is bfloat16, and the
            # broadcast must meet the last stage's fp32 mean with the same number of bytes
            value = (torch.stack([l.detach().float() for l in losses]).mean() if losses
                     else torch.zeros((), dtype=torch.float32))
            loss = self.from_last(value.to(self.device))
        return loss, out if self.has_last else None

    def from_last(self, t: torch.Tensor) -> torch.Tensor:
        """The last stage's value of ``t`` on every stage."""
        t = t.contiguous()
        dist.broadcast(t, src=self.group_ranks[-1], group=self.group)
        return t

    def object_from_last(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.group_ranks[-1], group=self.group)
        return box[0]


PIPELINE_HOOKS = ("galv_pipeline_batch", "galv_pipeline_loss")


@dataclass
class PipelineRuntime(ParallelRuntime):
    """The native runtime for ``pp > 1``: a step runs the whole schedule, backward included.

    Lightning's order is step -> zero_grad -> backward -> optimizer step, but the schedule back-propagates
    inside the step. The gradients it produces are therefore held back (the parameters' ``.grad`` is
    restored to what it was before the step) and added in :meth:`backward`, where Lightning expects
    them -- so gradient accumulation, clipping and the optimizer see exactly one process's gradients.

    The module supplies two hooks: ``galv_pipeline_batch(batch) -> (inputs, targets)`` and
    ``galv_pipeline_loss(output, targets) -> loss`` (see :class:`lightning_galv.demo.module.CausalLM`).
    """

    held: list[tuple[nn.Parameter, torch.Tensor | None]] = field(default_factory=list)

    def check_loader(self, loader: object) -> None:
        """Every batch the loader yields, the partial last one too, must split into the plan's micro-batches.

        Checked when the loader is set up because the schedule would otherwise fail at the epoch's last
        step, after the rest of the epoch has been trained.
        """
        from torch.utils.data import BatchSampler, DataLoader

        if not isinstance(loader, DataLoader):
            return
        bs = loader.batch_sampler
        bs = getattr(bs, "inner", bs)  # behind the resume wrapper
        if type(bs) is not BatchSampler:
            return  # a custom batch sampler's sizes are its own business
        try:
            n = len(bs.sampler)
        except TypeError:
            return
        m = self.plan.micro_batches
        sizes = {bs.batch_size} if n >= bs.batch_size else set()
        if n % bs.batch_size and not bs.drop_last:
            sizes.add(n % bs.batch_size)
        bad = sorted(b for b in sizes if b % m)
        if bad:
            raise ValueError(f"{type(loader).__name__} over {type(loader.dataset).__name__}: {n} samples per "
                             f"data shard in batches of {bs.batch_size} give batches of {bad} samples, which cannot "
                             f"be split into the plan's micro_batches={m} (pp={self.plan.pp}). HINT: "
                             f"DataLoader(drop_last=True) drops the partial last batch; or make the samples per shard "
                             f"and the batch size multiples of {m}.")

    def _hooks(self, module: Any) -> Any:
        for name in PIPELINE_HOOKS:
            if not callable(getattr(module, name, None)):
                raise ValueError(f"{type(module).__name__}.{name}: missing, and plan pp={self.plan.pp} runs the model "
                                 "through a pipeline schedule, which needs it. HINT: implement "
                                 "galv_pipeline_batch(batch) -> (inputs, targets) and galv_pipeline_loss(output, "
                                 "targets) -> loss (see lightning_galv.demo.module.CausalLM), or use pp=1.")
        return module

    def step(self, call: StepCall) -> Any:
        module = self._hooks(call.module)
        inputs, targets = module.galv_pipeline_batch(call.batch)
        if call.kind == "predict":
            with call.context():
                _, output = self.pipeline.run(inputs, None, None, train=False)
            output = self.pipeline.object_from_last(output)  # every stage returns the predictions, in order
            post = getattr(module, "galv_pipeline_predict", None)
            return post(output) if callable(post) else output
        train = call.kind == "train"
        if train and not getattr(module, "automatic_optimization", True):
            # the schedule replaces training_step: a manual step's own backward and optimizer calls would never run
            raise ValueError(f"{type(module).__name__}.automatic_optimization: False, and plan pp={self.plan.pp} runs "
                             "training through a pipeline schedule in place of training_step, so a manual step's "
                             "manual_backward and optimizer calls would never run. HINT: use automatic optimization "
                             "(gradient accumulation: Trainer(accumulate_grad_batches=k)) or a plan with pp=1.")
        scale = call.accumulate if train else 1

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # Lightning divides the loss by the accumulation factor before its backward; the schedule runs
            # the backward itself, so the division happens here
            return module.galv_pipeline_loss(output, target) / scale

        with call.context():
            if not train:
                loss, _ = self.pipeline.run(inputs, targets, loss_fn, train=False)
            else:
                params = [p for p in self.params if p.requires_grad]
                before = [p.grad for p in params]
                for p in params:
                    p.grad = None
                loss, _ = self.pipeline.run(inputs, targets, loss_fn, train=True)
                self.held = [(p, p.grad) for p in params]
                for p, g in zip(params, before):
                    p.grad = g
        loss = loss * scale
        hook = getattr(module, "on_pipeline_loss", None)
        if callable(hook):
            hook(loss, call.kind)
        return loss

    def backward(self, loss: torch.Tensor, default: Callable[[torch.Tensor], None]) -> None:
        """The schedule already back-propagated: add the held gradients (``loss`` has no graph)."""
        for p, g in self.held:
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self.held = []
