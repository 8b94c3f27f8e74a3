"""Trainer-level checks run inside gloo ranks (processes launched externally, like torchrun).

Each rank also trains the single-process reference itself with a plain torch loop on the same
samples, so every number the Trainer produces is compared with an exact single-device run.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_galv  # noqa: F401  (registers the strategy)
from lightning_galv import GalvatronStrategy, ParallelPlan
from lightning_galv.testing import count_refused, release_subgroups
from lightning_galv.layout import RankLayout
from lightning_galv.demo.module import CausalLM

SMALL = dict(vocab_size=64, dim=32, n_layers=3, n_heads=8, max_seq_len=16)


class Windows(Dataset):
    def __init__(self, n: int, seq: int = 16, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 64, (n, seq + 1), generator=g)
        self.seen: list[int] = []  # indices loaded, in order (resume tests: nothing skipped is loaded)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        self.seen.append(int(i))
        return self.data[i]


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning hands back the loss already divided by the accumulation factor
        loss = outputs["loss"].detach().clone() * trainer.accumulate_grad_batches
        dist.all_reduce(loss)
        self.losses.append(float(loss) / dist.get_world_size())


def make_module(kind: str = "llama", seed: int = 0, **extra: Any) -> CausalLM:
    if kind.startswith("hf_"):  # a Hugging Face model of that family, the two lines of the README
        from transformers import AutoModelForCausalLM

        from dist_runtime_checks import hf_config
        from lightning_galv.hf import GalvHFCausalLM

        torch.manual_seed(seed)
        config = hf_config(kind[3:], SMALL["n_layers"], extra.pop("dropout", 0.0))
        return GalvHFCausalLM(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"),
                              optimizer="sgd", lr=0.2, momentum=0.9, **extra)
    torch.manual_seed(seed)
    cfg = dict(SMALL)
    if kind == "llama":
        cfg.update(n_kv_heads=4, ffn_hidden=64)
    if kind == "moe":  # MoE blocks 0 and 2 (4 experts, top-2), block 1 dense; aux losses weighted to matter
        cfg.update(n_kv_heads=4, ffn_hidden=64, num_experts=4, top_k=2, expert_hidden=32, moe_layers=(0, 2),
                   aux_loss_weight=0.1, z_loss_weight=0.01)
    cfg.update(extra)
    return CausalLM(kind=kind, optimizer="sgd", lr=0.2, momentum=0.9, **cfg)


class ManualLM(CausalLM):
    """Manual optimization: ``accumulate`` ``manual_backward`` calls per optimizer step, each of which syncs the
    gradients (Lightning blocks no sync here), as a user accumulating by hand would write it. An MoE model's
    injected aux-loss gradient is scaled like the loss (``set_aux_grad_scale``): the user's own factor."""

    accumulate = 2

    def on_fit_start(self) -> None:
        set_scale = getattr(self.model, "set_aux_grad_scale", None)
        if callable(set_scale):
            set_scale(1.0 / self.accumulate)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        opt = self.optimizers()
        loss = self._loss(batch)
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            opt.step()
            opt.zero_grad()
        return {"loss": loss.detach()}


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for k, p in model.named_parameters()}


def weight_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Max rel_err over the parameters this rank holds; under pp the stages together must hold them all."""
    held: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(got))
    missing = set(want) - set().union(*map(set, held))
    if missing:
        raise AssertionError(f"parameters held by no rank: {sorted(missing)}")
    return max(rel_err(got[k], want[k]) for k in got)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference's scale (floored at 0.01, see dist_runtime_checks)."""
    return float((a - b).abs().max() / max(float(b.abs().max()), 0.01))


def reference(module: CausalLM, data: torch.Tensor, steps: int, global_batch: int, accumulate: int = 1,
              clip: float | None = None, clip_algorithm: str = "norm",
              shards: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process loop. Each global batch is laid out as the data shards concatenated in shard order
    (a DistributedSampler gives shard q rows q, q+shards, ... of it), with the keyed-dropout key the strategy
    uses (global_step * accumulate + micro-step), so dropout masks match too."""
    from lightning_galv.models.dropout import DropoutCoords, restore_coords

    opt = module.configure_optimizers()
    sched = None
    if isinstance(opt, dict):  # ScheduledLM: a per-step scheduler
        opt, sched = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    set_scale = getattr(module.model, "set_aux_grad_scale", None)
    if callable(set_scale):  # what CausalLM.on_train_batch_start does under the Trainer
        set_scale(1.0 / accumulate)
    losses = []
    for step in range(steps):
        total = 0.0
        for k in range(accumulate):
            i = (step * accumulate + k) * global_batch
            batch = data[i:i + global_batch]
            batch = batch.view(global_batch // shards, shards, -1).transpose(0, 1).reshape(global_batch, -1)
            with restore_coords(DropoutCoords(key=step * accumulate + k)):
                loss = module._loss(batch)
                (loss / accumulate).backward()
            total += float(loss.detach())
        if clip is not None and clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(module.parameters(), clip)
        elif clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(total / accumulate)
    return losses, {k: p.detach().clone() for k, p in module.model.named_parameters()}


class ShardedLogitsRecorder:
    """Wraps the loss CausalLM calls to record, per call, (autograd on?, were the logits vocab-sharded?)."""

    def __enter__(self) -> list[tuple[bool, bool]]:
        import lightning_galv.demo.module as mod
        from lightning_galv.loss import is_vocab_sharded

        self.seen: list[tuple[bool, bool]] = []
        self.original = original = mod.cross_entropy

        def recording(logits: torch.Tensor, targets: torch.Tensor, **kw: Any) -> torch.Tensor:
            self.seen.append((torch.is_grad_enabled(), is_vocab_sharded(logits)))
            return original(logits, targets, **kw)

        mod.cross_entropy = recording  # type: ignore[assignment]
        return self.seen

    def __exit__(self, *exc: Any) -> None:
        import lightning_galv.demo.module as mod

        mod.cross_entropy = self.original  # type: ignore[assignment]
        if exc[0] is None:  # every rank's calls (under pp only the last stage computes the loss)
            everywhere: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everywhere, list(self.seen))
            self.seen[:] = [call for calls in everywhere for call in calls]


def trainer_kwargs(**kw: Any) -> dict[str, Any]:
    base = dict(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0)
    base.update(kw)
    return base


def fit_compare(plan: dict | None, kind: str = "llama", steps: int = 10, global_batch: int = 8,
                accumulate: int = 1, clip: float | None = None, clip_algorithm: str = "norm", dropout: float = 0.0,
                strategy_kwargs: dict | None = None, moe_callbacks: bool | str = False,
                switches: tuple[tuple[int, dict], ...] = (), scheduled: bool = False,
                profile_pipeline: bool = False, manual: bool = False, precision: str = "32-true") -> dict[str, Any]:
    """Trainer.fit under ``plan`` vs the single-process loop: losses and final weights.

    ``precision``: the Trainer's; the reference stays fp32, so a bf16 run is near it rather than equal.

    ``manual``: the module optimizes manually (:class:`ManualLM`), accumulating ``accumulate`` synced backwards
    per step itself (the Trainer then accumulates nothing).
    ``moe_callbacks`` adds ExpertRelayout and SamplePlacement (2 ranks per simulated node, a seeded random
    placement policy so that samples really move) and returns what they logged; ``"fsep"``: the re-layout
    with fully sharded experts (``ExpertRelayout(expert_sharding="full")``). ``switches``: (step, plan)
    pairs -- the fit moves to ``plan`` once ``step`` optimizer steps are done (``strategy.switch_plan``).
    ``scheduled``: a module with a per-step LR schedule (the switch must carry the scheduler over).
    ``profile_pipeline``: an OnlineProfiler samples every 4th step from step 1 (training must stay exact) and the
    measured pipeline ops of each sampled step are returned."""
    if scheduled:
        module = _sched_module(0, dropout=dropout, kind=kind)
    else:
        module = make_module(kind, dropout=dropout)
    ref_module = copy.deepcopy(module)
    if manual:
        module.__class__ = ManualLM
        module.automatic_optimization = False
        module.accumulate = accumulate
    # 8 KiB gradient buckets: several per group even in these small models, so the overlapped, in-order
    # bucket launches during backward are what every parity case checks
    strategy = GalvatronStrategy(plan=plan, **{"grad_bucket_mb": 1 / 128, **(strategy_kwargs or {})})
    if switches:
        strategy.keep_pristine_copy()
    shards = ParallelPlan.from_dict(plan).data_parallel_size if plan else dist.get_world_size() if dist.is_initialized() else int(os.environ["LOCAL_WORLD_SIZE"])
    data = Windows(steps * accumulate * global_batch)
    loader = DataLoader(data, batch_size=global_batch // shards, shuffle=False)
    rec = LossRecorder()
    extra: list[Any] = []
    if moe_callbacks:
        from dist_runtime_checks import _shuffle_solver
        from lightning_galv.callbacks import ExpertRelayout, SamplePlacement

        sharding = "full" if moe_callbacks == "fsep" else None  # "fsep": the callback shards the experts (FSEP)
        extra = [ExpertRelayout(expert_sharding=sharding), SamplePlacement(gpus_per_node=2, intra_bw=100e9, inter_bw=25e9,
                                                   policy=_shuffle_solver())]
    switcher = _SwitchAt(switches) if switches else None
    if switcher is not None:
        extra.append(switcher)
    prof = None
    if profile_pipeline:
        from lightning_galv.callbacks import OnlineProfiler

        prof = OnlineProfiler(every_n_steps=4, warmup_steps=1, collectives=False, log=False)
        extra.append(prof)
    trainer = L.Trainer(strategy=strategy, max_steps=steps, callbacks=[rec, *extra],
                        accumulate_grad_batches=1 if manual else accumulate,
                        gradient_clip_val=clip, gradient_clip_algorithm=clip_algorithm, precision=precision,
                        **trainer_kwargs())
    with ShardedLogitsRecorder() as seen:
        trainer.fit(module, loader)
    got = full_state(module.model)
    dtypes = sorted({str(p.dtype) for p in got.values()})
    # Lightning's injected DistributedSampler shuffles training data with seed 0, epoch 0: at step t the
    # union of the ranks' batches is perm[t*G:(t+1)*G], which is what the reference consumes
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    ref_losses, want = reference(ref_module, data.data[perm], steps, global_batch, accumulate, clip, clip_algorithm,
                                 shards=shards)
    loss_rec = rec.losses[accumulate - 1::accumulate]  # one loss per optimizer step (mean of micro-batches differs)
    return {
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(_step_means(rec.losses, accumulate), ref_losses)),
        "weight_err": weight_err(got, want),
        "keys_equal": set(got) <= set(want), "n_losses": len(loss_rec), "dtypes": dtypes,
        "sampler": strategy.distributed_sampler_kwargs, "losses": rec.losses, "ref_losses": ref_losses,
        "vocab_parallel_loss": strategy.plan.vocab_parallel_loss, "sharded_seen": seen,
        "relayout": [r.__dict__ for r in extra[0].records] if moe_callbacks else [],
        "experts_dtensor": any(isinstance(p, DTensor) for n, p in module.named_parameters() if ".experts." in n),
        "placement": [st.__dict__ for st in extra[1].steps] if moe_callbacks else [],
        "switched": switcher.done if switcher is not None else [], "final_plan": strategy.plan.to_dict(),
        "logged": sorted(k for k in trainer.callback_metrics if "/" in k),
        "pipeline_ops": [(r.step, r.step_time_s, r.pipeline_ops) for r in prof.records] if prof is not None else None,
        **_fsdp_root_report(module, strategy),
    }


def _fsdp_root_report(module: L.LightningModule, strategy: GalvatronStrategy) -> dict[str, Any]:
    """Where the runtime put the shared FSDP2 root (its name in ``module``, None if none), whether FSDP2 made it
    the root, which other states are roots, and whether the LightningModule itself stayed a plain module."""
    from torch.distributed.fsdp import FSDPModule

    root = getattr(strategy.runtime, "fsdp_root", None)
    names = {id(m): n for n, m in module.named_modules()}
    return {"fsdp_root": names.get(id(root)) if root is not None else None,
            "fsdp_root_is_root": bool(root is not None and root._get_fsdp_state()._is_root),
            "fsdp_roots": sorted(n for n, m in module.named_modules()
                                 if isinstance(m, FSDPModule) and m._get_fsdp_state()._is_root),
            "module_is_fsdp": isinstance(module, FSDPModule)}


class _SwitchAt(L.Callback):
    """Moves the fit to another plan after given optimizer steps (on every rank, at the step boundary)."""

    def __init__(self, switches: tuple[tuple[int, dict], ...]) -> None:
        self.todo = {step: ParallelPlan.from_dict(plan) for step, plan in switches}
        self.done: list[tuple[int, str]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 and trainer.global_step in self.todo:
            plan = self.todo.pop(trainer.global_step)
            trainer.strategy.switch_plan(trainer, plan)
            self.done.append((trainer.global_step, trainer.strategy.plan.describe()))


def _step_means(losses: list[float], accumulate: int) -> list[float]:
    return [sum(losses[i:i + accumulate]) / accumulate for i in range(0, len(losses), accumulate)]


def run_many(cases: list[tuple[str, str, dict]]) -> dict[str, Any]:
    """Several Trainer checks in one launch: (name, function name, kwargs); each check's groups are released
    before the next (:func:`lightning_galv.testing.release_subgroups`)."""
    out = {}
    for name, fn, kw in cases:
        out[name] = globals()[fn](**kw)
        dist.barrier()
        release_subgroups()
    return out


def leftovers() -> dict[str, Any]:
    """What the earlier checks of this launch left alive after their release: DeviceMeshes, process groups
    besides WORLD, threads (a gloo group's transport loop polls every few ms, so leaked ones slow every later
    check). Run last in a launch of Trainer checks."""
    import gc

    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()
    return {"meshes": sum(isinstance(o, DeviceMesh) for o in gc.get_objects()),
            "groups": len(c10d._world.pg_map) - 1, "threads": len(os.listdir("/proc/self/task"))
            if os.path.isdir("/proc/self/task") else threading.active_count()}


def fit_auto(steps: int = 5, per_shard: int = 2, memory_budget: str | None = "2GB",
             below_pp1: float | None = None, monitor: bool = False, replan: bool = False) -> dict[str, Any]:
    """strategy='galvatron' with no plan: the planner picks one; it must still train exactly.

    ``below_pp1``: instead of ``memory_budget``, give the planner this fraction of the smallest budget
    with which *any* plan without a pipeline fits (found by bisection with the same profile and cost model
    as automatic mode), so the search has to use pipeline stages; the predictions come back for the test.
    """
    from lightning_galv.auto import priced_hardware
    from lightning_galv.models.protocol import find_parts
    from lightning_galv.plan import LayerStrategy
    from lightning_galv.planner import GalvatronCostModel, HardwareProfile, ProfileCache

    world = int(os.environ["LOCAL_WORLD_SIZE"])
    module = make_module("llama")
    ref_module = copy.deepcopy(module)
    n_layers = module.model.cfg.n_layers

    def plain_dp(gb: int) -> ParallelPlan:  # every layer, the embedding and the head: dp over all ranks, no ZeRO
        return ParallelPlan.uniform(world, n_layers, LayerStrategy(dp=world), global_batch=gb)

    budget: Any = memory_budget
    if below_pp1 is not None:
        # memory predictions depend on parameter counts and saved-activation bytes only (not on timings), so
        # this profile -- the one automatic mode will load from the cache -- fixes the budget on every rank
        from lightning_galv.auto import run_configs
        from lightning_galv.planner import SearchSpace, search

        from lightning_galv.auto import measure_profiles

        # the profile automatic mode will use, measured as it measures (cached for it): block profile + the
        # sharded blocks on these ranks, at the sample counts it profiles at
        prof, _ = measure_profiles(module, find_parts(module), world, 8 * 2**30, verbose=False,
                                   cache=ProfileCache(), loader_batch=per_shard)
        hw = priced_hardware(prof, HardwareProfile.uniform(1, world, 1e12), 1e12)
        # and corrected as automatic mode corrects it: the earlier cases' PlanMonitor stored a calibration in this
        # cache folder (its memory slack moves every peak; the bisection once ignored it and the budget then let
        # a pp = 1 plan fit after all, depending on what those runs measured)
        from lightning_galv.planner.calibration import Calibration, calibration_path

        calibration = Calibration.load(calibration_path(ProfileCache().directory))
        if calibration is not None:
            prof, hw = calibration.apply(prof, hw)
        cost = GalvatronCostModel(prof, hw, SearchSpace().default_embed_zero, runtime="native")
        _, gb, ms = run_configs(world, n_layers, per_shard, pipeline=True)[0]

        def pp1_fits(b: float) -> bool:
            try:
                search(prof, hw, world, b, global_batch=gb, space=SearchSpace(pp_degrees=(1,), micro_batches=ms),
                       cost_model=cost)
                return True
            except ValueError:
                return False

        lo, hi = 1.0, 1e12  # pp1_fits(lo) is False, pp1_fits(hi) is True
        while hi / lo > 1.001:
            mid = (lo * hi) ** 0.5
            lo, hi = (lo, mid) if pp1_fits(mid) else (mid, hi)
        budget = int(below_pp1 * hi)
    data = Windows(steps * per_shard * world)
    loader = DataLoader(data, batch_size=per_shard, shuffle=False)
    strategy = GalvatronStrategy(memory_budget=budget)
    rec = LossRecorder()
    callbacks: list[Any] = [rec]
    if monitor:  # issue 13: online profiling and the plan monitor ride along (and must not change training)
        from lightning_galv.callbacks import OnlineProfiler, PlanMonitor

        prof = OnlineProfiler(every_n_steps=2, warmup_steps=1, log=False)
        # any error warns: the warning path runs; with ``replan`` the miss also re-plans (to the same plan with
        # activation checkpointing flipped on every layer: a real switch of a known plan) mid-fit
        mon = PlanMonitor(prof, time_threshold=1e-6, replan=replan, replanner=_flip_checkpointing if replan else None)
        callbacks += [prof, mon]
    trainer = L.Trainer(strategy=strategy, max_steps=steps, callbacks=callbacks, **trainer_kwargs())
    trainer.fit(module, loader)
    assert strategy.plan is not None and strategy.auto is not None
    plan = strategy.plan
    g = per_shard * plan.data_parallel_size
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    ref_losses, want = reference(ref_module, data.data[perm], steps, g)
    got = full_state(module.model)
    if monitor:
        from lightning_galv.callbacks import calibration_path

        monitored = {"steps": [r.step for r in prof.records], "collectives": sorted({op for r in prof.records
                                                                                      for op in r.collective_s}),
                     # every rank's units (a pipeline plan puts the head on the last stage only)
                     "layers": sorted(_union_over_ranks(set(prof.records[0].layer_forward_s) if prof.records else set())),
                     "comparisons": mon.comparisons, "warned": mon.warned,
                     "calibration": calibration_path().read_text() if calibration_path().is_file() else None,
                     "switches": mon.switches, "calibrations_seen": list(_CALIBRATIONS_SEEN),
                     # blocks this rank (rank 0 returns the result) timed per sampled step
                     "own_blocks": len([k for k in (prof.records[0].layer_forward_s if prof.records else {})
                                        if k.startswith("layers.")])}
    else:
        monitored = None
    out = {"monitored": monitored, "plan": plan.to_dict(), "loss_err": max(abs(a - b) / abs(b) for a, b in zip(rec.losses, ref_losses)),
           "n_losses": len(rec.losses), "weight_err": weight_err(got, want), "predicted": plan.prediction is not None,
           "budget": strategy.auto.budget, "margin": strategy.auto.memory_margin, "global_batch": g,
           "loader_batch": strategy.auto.loader_batch}
    if plan.prediction is not None:
        cost = strategy.auto.cost_model()  # what the search priced plans with
        out["chosen_peak"] = max(plan.prediction.stage_memory_bytes)
        out["chosen_peak_recomputed"] = cost.evaluate(plan).peak_memory_bytes
        out["dp_peak"] = cost.evaluate(plain_dp(per_shard * world)).peak_memory_bytes
        # the leanest all-dp variant the search could emit: ZeRO-2 embedding/head as the search assigns them
        lean = plain_dp(per_shard * world).with_(embed=LayerStrategy(dp=world, zero=2), head=LayerStrategy(dp=world, zero=2))
        out["dp_lean_peak"] = cost.evaluate(lean).peak_memory_bytes
        # would anything without a pipeline have fitted? (same search, restricted to pp = 1)
        from lightning_galv.auto import run_configs
        from lightning_galv.planner import SearchSpace, search

        _, gb, ms = run_configs(world, n_layers, per_shard, pipeline=True)[0]
        try:
            search(strategy.auto.model, strategy.auto.hardware, world, strategy.auto.budget, global_batch=gb,
                   space=SearchSpace(pp_degrees=(1,), micro_batches=ms), cost_model=cost,
                   memory_margin=strategy.auto.memory_margin)
            out["pp1_fits"] = True
        except ValueError:
            out["pp1_fits"] = False
    return out


def _union_over_ranks(items: set) -> set:
    everywhere: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, items)
    return set().union(*everywhere)


_CALIBRATIONS_SEEN: list[int] = []


def _flip_checkpointing(plan: ParallelPlan, calibration: Any) -> Any:
    """A replanner for the monitor test: the running plan with checkpointing flipped on every layer."""
    from lightning_galv.auto import Replan

    _CALIBRATIONS_SEEN.append(calibration.observations if calibration is not None else 0)
    from dataclasses import replace

    flipped = plan.with_(layers=tuple(replace(s, checkpoint=not s.checkpoint) for s in plan.layers), prediction=None)
    return Replan(flipped, current_s=1.0, best_s=0.5, candidates=1)


class ScheduledLM(CausalLM):
    """CausalLM with a step LR schedule, so resume must restore the scheduler too."""

    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5),
                                                   "interval": "step"}}


class ManualScheduledLM(ScheduledLM):
    """Manual optimization over ScheduledLM: two synced ``manual_backward`` per optimizer step, the scheduler
    stepped by hand after each optimizer step (what Lightning does for an automatic "step" interval)."""

    accumulate = 2

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        opt, sched = self.optimizers(), self.lr_schedulers()
        loss = self._loss(batch)
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            opt.step()
            opt.zero_grad()
            sched.step()
        return {"loss": loss.detach()}


def _sched_module(seed: int, dropout: float = 0.0, kind: str = "llama") -> ScheduledLM:
    torch.manual_seed(seed)
    moe = dict(num_experts=4, top_k=2, expert_hidden=32, moe_layers=(0, 2)) if kind == "moe" else {}
    return ScheduledLM(kind=kind, optimizer="sgd", lr=0.2, momentum=0.9, n_kv_heads=4, ffn_hidden=64,
                       dropout=dropout, **SMALL, **moe)


def fit_resume(plan: dict, tmpdir: str, full: bool, kill: int = 2, steps: int = 6, global_batch: int = 8,
               samples: int = 28, accumulate: int = 1, sampler: str = "lightning",
               dropout: float = 0.0, manual: bool = False) -> dict[str, Any]:
    """Train `steps` straight vs `kill` steps + resume from ckpt_path='last' to `steps`: same weights and losses.

    ``samples=28`` gives every shard layout used here 4 batches per epoch with a partial last batch, so the
    default kill at step 2 is mid-epoch and the resumed run crosses the epoch boundary (new shuffle order).
    ``sampler``: "lightning" (DataLoader(shuffle=True); Lightning injects a shuffling DistributedSampler over
    the plan's data shards) or "user" (the user's own DistributedSampler without shuffling). With ``dropout``
    the keyed masks follow global_step, which the checkpoint restores, so the resume stays exact.
    ``manual``: :class:`ManualScheduledLM`, ``accumulate`` batches per optimizer step by hand (keyed dropout then
    follows the batches completed, which the checkpoint restores too).
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    p = ParallelPlan.from_dict(plan)
    shards = p.data_parallel_size
    data = Windows(samples)

    def loader() -> DataLoader:
        if sampler == "lightning":
            return DataLoader(data, batch_size=global_batch // shards, shuffle=True)
        lay = RankLayout(p.world_size, p.pp)
        shard, _ = lay.batch_shard(lay.data_strategy(p), dist.get_rank() if dist.is_initialized()
                                   else int(os.environ["RANK"]))
        user = DistributedSampler(data, num_replicas=shards, rank=shard, shuffle=False)
        return DataLoader(data, batch_size=global_batch // shards, sampler=user)

    def run(module: CausalLM, max_steps: int, ckpt_dir: str | None,
            ckpt_path: str | None) -> tuple[list[float], list[int], Any]:
        rec = LossRecorder()
        cbs: list[Any] = [rec]
        if ckpt_dir:
            cbs.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=kill, save_top_k=0))
        if manual:
            module.__class__ = ManualScheduledLM
            module.automatic_optimization = False
            module.accumulate = accumulate
        trainer = L.Trainer(strategy=GalvatronStrategy(plan=plan, save_distributed_checkpoint=not full),
                            max_steps=max_steps, callbacks=cbs, accumulate_grad_batches=1 if manual else accumulate,
                            **trainer_kwargs(enable_checkpointing=bool(ckpt_dir)))
        data.seen = []
        trainer.fit(module, loader(), ckpt_path=ckpt_path)
        return rec.losses, data.seen, trainer

    straight = _sched_module(0, dropout)
    losses_a, seen_a, trainer_a = run(straight, steps, None, None)
    ckdir = os.path.join(tmpdir, "full" if full else "sharded")
    first = _sched_module(0, dropout)
    _, seen_first, _ = run(first, kill, ckdir, None)  # the "killed" run: stops after the checkpoint at step `kill`
    resumed = _sched_module(1, dropout)  # different init: everything must come from the checkpoint
    losses_b, seen_b, trainer_b = run(resumed, steps, ckdir, "last")
    got, want = full_state(resumed.model), full_state(straight.model)
    last = os.path.join(ckdir, "last.ckpt")
    if full:
        keys = set(torch.load(last, weights_only=False, map_location="cpu")["state_dict"])
    else:
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(last).read_metadata()
        keys = {k[len("state_dict."):] for k in meta.state_dict_metadata if k.startswith("state_dict.")}
    tail = losses_a[kill * accumulate:]
    return {
        "weight_err": weight_err(got, want),
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses_b, tail)) if losses_b else float("inf"),
        "n_resumed_losses": len(losses_b), "n_tail": len(tail), "losses_b": losses_b, "losses_a": losses_a,
        # the resumed run loads exactly what the straight run loaded after step `kill`: no skipped sample
        # is loaded and none is repeated (per rank, in order)
        "samples_exact": seen_first + seen_b == seen_a, "n_seen_b": len(seen_b),
        "keys_match": keys == set(_sched_module(0).state_dict()),
        "global_step": trainer_b.global_step, "batches_per_epoch": trainer_b.num_training_batches,
        "lr": trainer_b.optimizers[0].param_groups[0]["lr"],
        "lr_straight": trainer_a.optimizers[0].param_groups[0]["lr"],
    }


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset without state: its position cannot be checkpointed."""

    def __iter__(self) -> Any:
        yield from Windows(64).data


def resume_unresumable(plan: dict, tmpdir: str, kill: int = 2) -> dict[str, Any]:
    """Mid-epoch resume with a stateless IterableDataset loader: rank 0 warns once, naming the loader."""
    import warnings

    from lightning.pytorch.callbacks import ModelCheckpoint

    shards = ParallelPlan.from_dict(plan).data_parallel_size

    def run(max_steps: int, ckpt_path: str | None) -> list[str]:
        ck = ModelCheckpoint(dirpath=tmpdir, save_last=True, every_n_train_steps=kill, save_top_k=0)
        trainer = L.Trainer(strategy=GalvatronStrategy(plan=plan), max_steps=max_steps, callbacks=[ck],
                            **trainer_kwargs(enable_checkpointing=True))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(make_module("llama"), DataLoader(Stream(), batch_size=8 // shards), ckpt_path=ckpt_path)
        return [str(w.message) for w in caught if "resume is not exact" in str(w.message)]

    fresh = run(kill, None)
    return {"fresh": fresh, "resumed": run(kill + 1, "last")}


def pp_partial_batch(plan: dict, samples: int = 26, global_batch: int = 8) -> dict[str, Any]:
    """pp > 1: a partial last batch that the micro-batches cannot split fails before training; drop_last trains;
    manual optimization fails at the first training step."""
    shards = ParallelPlan.from_dict(plan).data_parallel_size
    out: dict[str, Any] = {}
    for drop_last in (False, True):
        trainer = L.Trainer(strategy=GalvatronStrategy(plan=plan), max_steps=4, **trainer_kwargs())
        loader = DataLoader(Windows(samples), batch_size=global_batch // shards, shuffle=True, drop_last=drop_last)
        try:
            trainer.fit(make_module("llama"), loader)
            out[f"drop_last={drop_last}"] = {"error": None, "steps": trainer.global_step,
                                             "batches_per_epoch": trainer.num_training_batches}
        except ValueError as e:
            out[f"drop_last={drop_last}"] = {"error": str(e), "steps": trainer.global_step}
    # manual optimization: the schedule replaces training_step, so it is refused rather than silently not stepped
    module = make_module("llama")
    module.__class__ = ManualLM
    module.automatic_optimization = False
    trainer = L.Trainer(strategy=GalvatronStrategy(plan=plan), max_steps=4, **trainer_kwargs())
    loader = DataLoader(Windows(samples), batch_size=global_batch // shards, drop_last=True)
    try:
        trainer.fit(module, loader)
        out["manual"] = {"error": None, "steps": trainer.global_step}
    except ValueError as e:
        out["manual"] = {"error": str(e), "steps": trainer.global_step}
    return out


def fit_then_eval(plan: dict, steps: int = 3, global_batch: int = 8) -> dict[str, Any]:
    """A Trainer reused for validate/test/predict after fit: same numbers as the single-process model."""
    module = make_module("llama")
    ref_module = copy.deepcopy(module)
    shards = ParallelPlan.from_dict(plan).data_parallel_size
    data = Windows(steps * global_batch)
    evald = Windows(2 * global_batch, seed=11)
    b = global_batch // shards
    trainer = L.Trainer(strategy=GalvatronStrategy(plan=plan), max_steps=steps, **trainer_kwargs())
    with ShardedLogitsRecorder() as seen:
        trainer.fit(module, DataLoader(data, batch_size=b))
        val = trainer.validate(module, DataLoader(evald, batch_size=b), verbose=False)[0]["val_loss"]
        test = trainer.test(module, DataLoader(evald, batch_size=b), verbose=False)[0]["test_loss"]
    preds = trainer.predict(module, DataLoader(evald, batch_size=b))
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    reference(ref_module, data.data[perm], steps, global_batch)
    with torch.no_grad():
        ref_val = float(ref_module._loss(evald.data))
        ref_pred = ref_module(evald.data[:, :-1]).argmax(-1)
    shard = trainer.strategy.distributed_sampler_kwargs["rank"]
    mine = ref_pred[shard::shards]  # DistributedSampler(shuffle=False) gives shard i the indices i, i+n, ...
    got_pred = torch.cat(preds)
    return {"val_err": abs(val - ref_val) / ref_val, "test_err": abs(test - ref_val) / ref_val,
            "pred_equal": bool(torch.equal(got_pred, mine)), "n_pred": len(got_pred), "sharded_seen": seen}


def fit_precision(plan: dict, precision: str, steps: int = 4, global_batch: int = 8,
                  kind: str = "llama") -> dict[str, Any]:
    """bf16 runs train and stay near the fp32 reference (bf16 has ~3 significant digits)."""
    module = make_module(kind)
    ref_module = copy.deepcopy(module)
    shards = ParallelPlan.from_dict(plan).data_parallel_size
    data = Windows(steps * global_batch)
    rec = LossRecorder()
    trainer = L.Trainer(strategy=GalvatronStrategy(plan=plan), max_steps=steps, precision=precision,
                        callbacks=[rec], **trainer_kwargs())
    with ShardedLogitsRecorder() as seen:
        trainer.fit(module, DataLoader(data, batch_size=global_batch // shards))
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    ref_losses, _ = reference(ref_module, data.data[perm], steps, global_batch)
    dtypes = sorted({str(p.dtype) for p in module.parameters()})
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(rec.losses, ref_losses)), "dtypes": dtypes,
            "sharded_seen": seen}


def unseeded_init(plan: dict) -> dict[str, Any]:
    """Ranks build the model with different seeds: after setup every replica equals rank 0's."""
    module = make_module("llama", seed=100 + dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"]))
    rank0_copy = make_module("llama", seed=100)
    trainer = L.Trainer(strategy=GalvatronStrategy(plan=plan), max_steps=0, **trainer_kwargs())
    trainer.fit(module, DataLoader(Windows(8), batch_size=2))
    got = full_state(module.model)
    want = dict(rank0_copy.model.named_parameters())
    return {"err": max(float((got[k] - want[k].detach()).abs().max()) for k in want)}


def save_under(plan: dict, tmpdir: str, full: bool, steps: int = 2, global_batch: int = 8, kind: str = "llama",
               name: str = "", expert_sharding: str = "owner") -> dict[str, Any]:
    """Train a little under plan A and save (sharded or full); return full weights + optimizer state."""
    module = _sched_module(0, kind=kind)
    shards = ParallelPlan.from_dict(plan).data_parallel_size
    trainer = L.Trainer(strategy=GalvatronStrategy(plan=plan, save_distributed_checkpoint=not full,
                                                   expert_sharding=expert_sharding), max_steps=steps,
                        **trainer_kwargs())
    trainer.fit(module, DataLoader(Windows(steps * global_batch), batch_size=global_batch // shards))
    path = os.path.join(tmpdir, f"ckpt{name}_full.ckpt" if full else f"ckpt{name}_sharded")
    trainer.save_checkpoint(path)
    return _gathered_state(trainer)


def load_under(plan: dict, tmpdir: str, full: bool, kind: str = "llama", name: str = "",
               expert_sharding: str = "owner", global_batch: int = 8) -> dict[str, Any]:
    """Load the checkpoint written under another plan (other pp/tp/dp/ZeRO/ep/world size/expert sharding)."""
    module = _sched_module(1, kind=kind)
    shards = ParallelPlan.from_dict(plan).data_parallel_size
    trainer = L.Trainer(strategy=GalvatronStrategy(plan=plan, expert_sharding=expert_sharding), max_steps=0,
                        **trainer_kwargs())
    path = os.path.join(tmpdir, f"ckpt{name}_full.ckpt" if full else f"ckpt{name}_sharded")
    # max_steps=0 restores and stops: weights and optimizer state are then those of the checkpoint
    trainer.fit(module, DataLoader(Windows(global_batch), batch_size=max(1, global_batch // shards)), ckpt_path=path)
    return _gathered_state(trainer)


def _gathered_state(trainer: L.Trainer) -> dict[str, Any]:
    """Full weights and optimizer state (FQN-keyed) assembled over every stage, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    strategy = trainer.strategy
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    strategy.runtime.zero1.consolidate(trainer.optimizers[0])
    msd = {k: v.detach().cpu().clone() for k, v in get_model_state_dict(strategy.model, options=opts).items()}
    osd = get_optimizer_state_dict(strategy.model, trainer.optimizers[0], options=opts)
    mom = {k: v["momentum_buffer"].detach().cpu().clone() for k, v in osd["state"].items() if "momentum_buffer" in v}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (msd, mom, trainer.global_step, osd["param_groups"][0]["lr"]))
    weights, moms = {}, {}
    for m, o, _, _ in parts:
        weights.update(m)
        moms.update(o)
    return {"weights": weights, "momentum": moms, "step": parts[0][2], "lr": parts[0][3]}


def fit_infeasible_budget(memory_budget: str = "1KB") -> dict[str, Any]:
    """Automatic mode with a budget no plan fits: the error each rank raises (type and text), or None.

    Before issue 9 only rank 0 raised the ValueError; the others died in the broadcast it never joined.
    """
    module = make_module("llama")
    loader = DataLoader(Windows(8 * int(os.environ["LOCAL_WORLD_SIZE"])), batch_size=2, shuffle=False)
    trainer = L.Trainer(strategy=GalvatronStrategy(memory_budget=memory_budget), max_steps=1, **trainer_kwargs())
    try:
        trainer.fit(module, loader)
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank saw
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


class _StopAt(L.Callback):
    """Freeze this rank (SIGSTOP) at the start of batch ``at``, as a hung or suspended process would."""

    def __init__(self, at: int, pid_file: str) -> None:
        self.at, self.pid_file = at, pid_file

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == self.at:
            with open(self.pid_file + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(self.pid_file + ".tmp", self.pid_file)
            os.kill(os.getpid(), signal.SIGSTOP)


def fit_stopped_rank(plan: dict, tmpdir: str, stop_rank: int, timeout_s: float, at: int = 1) -> dict[str, Any]:
    """Rank ``stop_rank`` stops mid-training; what does every other rank raise, and how soon?

    The world group comes from the launcher (3-minute timeout); the strategy's ``timeout`` must reach
    the mesh sub-groups the plan's collectives run on, or the others would wait 30 minutes (gloo's default).
    """
    import time

    rank = dist.get_rank()
    pid_file = os.path.join(tmpdir, f"pid{stop_rank}")
    module = make_module("llama")
    loader = DataLoader(Windows(64), batch_size=2, shuffle=False)
    callbacks = [_StopAt(at, pid_file)] if rank == stop_rank else []
    trainer = L.Trainer(strategy=GalvatronStrategy(plan=plan, timeout=timeout_s), max_steps=4, callbacks=callbacks,
                        **trainer_kwargs())
    start = time.monotonic()
    try:
        trainer.fit(module, loader)
        out: dict[str, Any] = {"type": None}
    except Exception as exc:  # noqa: BLE001 - the test inspects what every surviving rank raised
        out = {"type": type(exc).__name__, "message": str(exc), "cause": repr(exc.__cause__),
               "silent": getattr(exc, "silent_ranks", None), "group_ranks": getattr(exc, "group_ranks", None),
               "group": getattr(exc, "group", None), "elapsed": time.monotonic() - start}
    if rank == 0:  # the stopped rank never exits on its own
        with open(pid_file) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    dist.destroy_process_group()  # no closing barrier: a member of the world is gone
    return out


def fit_auto_hf(kind: str, steps: int = 3, per_shard: int = 2) -> dict[str, Any]:
    """strategy='galvatron' (automatic mode) on a GalvHFCausalLM: it must pick a plan the adapter accepts and train
    it exactly. Then, on rank 0 with the profiles automatic mode used: the wider search (top 50 per configuration)
    under the model's limits (``galv_sp_modes`` / ``galv_check_plan``) and how many of its plans the model refuses;
    and the layer strategies the search space offers with and without ``galv_sp_modes`` (each as a uniform plan):
    how many the model refuses, and how many split blocks by Ulysses."""
    from lightning_galv.auto import search_run_plans
    from lightning_galv.models.protocol import find_parts
    from lightning_galv.plan import LayerStrategy
    from lightning_galv.planner import SearchSpace
    from lightning_galv.planner.space import candidate_strategies

    world = int(os.environ["LOCAL_WORLD_SIZE"])
    module = make_module(kind)
    ref_module = copy.deepcopy(module)
    data = Windows(steps * per_shard * world)
    loader = DataLoader(data, batch_size=per_shard, shuffle=False)
    strategy = GalvatronStrategy(memory_budget="2GB")
    rec = LossRecorder()
    trainer = L.Trainer(strategy=strategy, max_steps=steps, callbacks=[rec], **trainer_kwargs())
    trainer.fit(module, loader)
    plan = strategy.plan
    assert plan is not None and strategy.auto is not None
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    ref_losses, want = reference(ref_module, data.data[perm], steps, per_shard * plan.data_parallel_size)
    got = full_state(module.model)
    out: dict[str, Any] = {"plan": plan.to_dict(), "n_losses": len(rec.losses), "weight_err": weight_err(got, want),
                           "loss_err": max(abs(a - b) / abs(b) for a, b in zip(rec.losses, ref_losses))}
    if dist.get_rank() == 0:
        parts = find_parts(module)
        auto = strategy.auto

        def refused(plans: list[ParallelPlan]) -> int:
            return count_refused(parts, plans)

        args = (auto.model, auto.hardware, world, len(parts.blocks), auto.budget, auto.memory_margin,
                auto.loader_batch, True, False)
        limited = search_run_plans(*args, top_k=50, sp_modes=parts.sp_modes, check_plan=parts.check_plan).plans

        def offered(space: SearchSpace) -> list[ParallelPlan]:
            strategies = candidate_strategies(parts.shape, world, world, space)
            return [ParallelPlan.uniform(world, len(parts.blocks), s, embed=LayerStrategy(dp=world),
                                         head=LayerStrategy(dp=world)) for s in strategies]

        free_space, limited_space = offered(SearchSpace()), offered(SearchSpace(sp_modes=parts.sp_modes))
        out.update(sp_modes=parts.sp_modes, refused_limited=refused(limited), n_limited=len(limited),
                   refused_space_free=refused(free_space), refused_space_limited=refused(limited_space),
                   ulysses_space=sum(p.layers[0].tp > 1 and p.layers[0].ulysses for p in limited_space))
    return out
