"""GalvatronStrategy: a Lightning strategy that trains with a hybrid-parallel plan.

Thin by design: intent in ``__init__``; process group and rank layout in ``setup_environment``;
plan resolution and :func:`lightning_galv.parallel.parallelize` in ``setup``. Every hook after that
forwards to the plan's :class:`~lightning_galv.parallel.runtime.Runtime` (native, pipeline or
DeepSpeed), so nothing here depends on the backend or on pipelining.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from ..layout import MeshFactory, RankLayout
from ..parallel.runtime import StepKind
from ..parallel.state_dict import is_sharded
from ..parallel.timeouts import DEFAULT_TIMEOUT, check_timeout, enable_flight_recorder, naming_timeouts
from ..plan import LayerStrategy, ParallelPlan, parse_plan

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from ..auto import AutoSearch
    from ..parallel.runtime import Runtime

def _names_timeouts(method: Any) -> Any:
    """Run a strategy entry point so that a backend collective timeout comes out named (group, peers)."""

    @functools.wraps(method)
    def wrapper(self: "GalvatronStrategy", *args: Any, **kwargs: Any) -> Any:
        with naming_timeouts(self._timeout):
            return method(self, *args, **kwargs)

    return wrapper


class GalvatronStrategy(ParallelStrategy):
    """Hybrid data / ZeRO / tensor / sequence parallelism from a :class:`~lightning_galv.ParallelPlan`.

    Args:
        plan: a ``ParallelPlan``, a dict, or a path to a YAML/JSON plan file. ``None`` with no keyword
            shortcuts means *automatic*: the planner searches a plan for this model and machine.
        tp, sp, zero, checkpoint, tp_consecutive: shortcuts for a uniform plan (every layer, the
            embedding and the head use ``LayerStrategy(tp, dp=world/tp, sp, zero, checkpoint)``).
        memory_budget: device memory the automatic planner may use per rank ("20GB", bytes, or None for
            the device's capacity).
        memory_margin: fraction of ``memory_budget`` the automatic planner keeps free for temporaries the
            cost model does not itemize (None: the planner's default, 2 %).
            (How long automatic mode may spend timing each layer type is ``$GALV_PROFILE_BUDGET_S``,
            :func:`lightning_galv.auto.profile_budget_s`.)
        save_distributed_checkpoint: sharded DCP folder (True) or one full ``.ckpt`` file (False).
        start_method: ``"subprocess"`` re-runs the script per rank (like torchrun); ``"spawn"``/``"fork"``
            start ranks with multiprocessing (notebooks).
        process_group_backend: default from the accelerator (``nccl`` on CUDA, ``gloo`` on CPU).
        timeout: how long any collective -- on the world group and on every tp / dp / pp / Ulysses
            sub-group of the plan -- waits for a missing rank before it fails instead of hanging
            (``timedelta`` or seconds; default 10 minutes, Lightning's default; ``None`` leaves the
            backend defaults). A timeout raises :class:`~lightning_galv.parallel.timeouts.CollectiveTimeoutError`
            on every waiting rank, naming the collective, its group and ranks, and the ranks that never
            arrived (stopped, crashed or stuck); the backend's own error is its ``__cause__``.
        vocab_parallel_loss: whether a vocab-parallel head (``head.tp > 1``) may hand the training loss
            vocab-sharded logits (``ParallelPlan.vocab_parallel_loss``). ``None`` (default): what the
            LightningModule declares with a ``galv_vocab_parallel_loss`` attribute (``CausalLM`` does), else
            the plan's own value (False unless the plan file says otherwise). Opting in is the user's
            statement that every loss on the head's output goes through
            :func:`lightning_galv.loss.cross_entropy`; a plain ``F.cross_entropy`` needs the default
            (gathered) logits. The flag lives in the plan because the cost model prices it.
        grad_bucket_mb: bucket size of the ZeRO-0/1 gradient all-reduce, which starts bucket by bucket during
            backward (without pipeline stages), like DDP's ``bucket_cap_mb``.
        expert_sharding: how expert-parallel MoE layers hold their experts: ``"owner"`` (plain EP, each
            expert whole on one rank of its EP group) or ``"full"`` (every expert sharded over the EP group, as
            LAER-MoE's FSEP; any rank can then materialize any expert from all ranks alike, which
            :class:`~lightning_galv.callbacks.ExpertRelayout` uses). Checkpoints load across both.
        routing_skew: automatic mode, MoE models: ``{ep: factor}``, how much more routed work the busiest rank of
            an expert-parallel group gets than the mean on your data (measure it with
            :func:`lightning_galv.profiling.measure_routing_skew` on a batch or two). The profiler times the
            experts on random inputs, which route evenly; real data does not, and the busiest rank sets an EP
            group's pace. ``None``: priced as balanced.
    """

    strategy_name = "galvatron"

    def __init__(
        self,
        plan: ParallelPlan | Mapping[str, Any] | str | Path | None = None,
        *,
        tp: int | None = None,
        sp: str | None = None,
        zero: int | None = None,
        checkpoint: bool | None = None,
        tp_consecutive: bool | None = None,
        memory_budget: str | int | float | None = None,
        memory_margin: float | None = None,
        save_distributed_checkpoint: bool = True,
        start_method: Literal["subprocess", "spawn", "fork", "forkserver"] = "subprocess",
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        vocab_parallel_loss: bool | None = None,
        grad_bucket_mb: float = 25.0,
        expert_sharding: Literal["owner", "full"] = "owner",
        routing_skew: Mapping[int, float] | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        from ..known_warnings import silence_known_warnings

        silence_known_warnings()  # library noise every rank would repeat (see known_warnings.py)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        shortcuts = {k: v for k, v in dict(tp=tp, sp=sp, zero=zero, checkpoint=checkpoint,
                                            tp_consecutive=tp_consecutive).items() if v is not None}
        if plan is not None and shortcuts:
            raise ValueError(f"plan and shortcuts {sorted(shortcuts)} given together: choose one. "
                             "HINT: put the shortcut values into the plan's layer strategies instead.")
        self._plan_spec = plan if plan is None else parse_plan(plan)
        self._shortcuts = shortcuts
        if shortcuts:  # validate early: a typo must fail at construction, not after the launch
            LayerStrategy(**{**shortcuts, "tp": shortcuts.get("tp", 1)})
        self._memory_budget = memory_budget
        if self._plan_spec is None and not shortcuts:  # automatic: a bad $GALV_PROFILE_BUDGET_S fails before a launch
            from ..auto import profile_budget_s

            profile_budget_s()
        if memory_margin is not None and (isinstance(memory_margin, bool) or not isinstance(memory_margin, (int, float))
                                          or not 0 <= memory_margin < 1):
            raise ValueError(f"memory_margin={memory_margin!r}: must be a fraction in [0, 1). "
                             "HINT: e.g. memory_margin=0.02 keeps 2 % of the budget free; 0 uses all of it.")
        self._memory_margin = memory_margin
        self._save_distributed_checkpoint = save_distributed_checkpoint
        if start_method not in ("subprocess", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method={start_method!r}: must be subprocess, spawn, fork or forkserver. "
                             "HINT: 'subprocess' works everywhere a script runs.")
        self._start_method = start_method
        if vocab_parallel_loss is not None and not isinstance(vocab_parallel_loss, bool):
            raise TypeError(f"vocab_parallel_loss={vocab_parallel_loss!r}: must be True, False or None. HINT: True "
                            "only when the loss uses lightning_galv.loss.cross_entropy; None follows the module.")
        self._vocab_parallel_loss = vocab_parallel_loss
        if isinstance(grad_bucket_mb, bool) or not isinstance(grad_bucket_mb, (int, float)) or not grad_bucket_mb > 0:
            raise ValueError(f"grad_bucket_mb={grad_bucket_mb!r}: must be a positive number of MiB. HINT: 25 (DDP's "
                             "bucket_cap_mb default); smaller buckets start reducing earlier in backward.")
        self._grad_bucket_bytes = max(1, int(grad_bucket_mb * 2**20))
        from ..parallel.expert import check_expert_sharding

        self.expert_sharding = check_expert_sharding(expert_sharding)  # may be set until setup (ExpertRelayout)
        if routing_skew is not None:  # validated before the launch; priced in automatic mode only
            from ..planner.profiles import check_routing_skew

            if self._plan_spec is not None or shortcuts:
                raise ValueError(f"routing_skew={routing_skew!r} with a given plan: it only changes what automatic "
                                 "mode's search prices. HINT: drop routing_skew, or drop the plan to let the search "
                                 "weigh expert parallelism with it.")
            routing_skew = dict(check_routing_skew(routing_skew))
        self._routing_skew = routing_skew
        self._process_group_backend = process_group_backend
        self._timeout = None if timeout is None else check_timeout(timeout)
        self._num_nodes = 1
        self.plan: ParallelPlan | None = None
        self.auto: AutoSearch | None = None  # automatic mode: what was searched and predicted
        self.layout: RankLayout | None = None
        self.mesh_factory: MeshFactory | None = None
        self.runtime: Runtime | None = None
        self.pristine: Any = None  # a switch.PristineCopy, kept only when a plan switch may come (keep_pristine_copy)
        self._keep_pristine = False

    # -- Lightning plumbing ------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Samples are split over data-parallel shards only; tp/sp ranks of a shard read the same ones."""
        if self.runtime is not None:
            shard, shards = self.runtime.data_shard
        else:  # before setup (e.g. a dataloader requested early): assume plain DP
            shard, shards = self.global_rank, self.world_size
        return {"num_replicas": shards, "rank": shard}

    def process_dataloader(self, dataloader: object) -> object:
        """Make the training loader resumable mid-epoch (validation/test/predict loaders stay as given).

        Lightning checkpoints ``state_dict()`` of stateful training loaders and restores it before the
        resumed epoch's iterator is created; :func:`lightning_galv.resumable.make_resumable` gives a map-style
        ``DataLoader`` that state (epoch, batches yielded, shuffle seed) so a resumed run continues with the
        very samples the interrupted one would have drawn next.
        """
        if self.runtime is not None:
            self.runtime.check_loader(dataloader)
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        from ..resumable import make_resumable

        progress = trainer.fit_loop.epoch_progress
        return make_resumable(dataloader, lambda: progress.current.processed)

    def on_train_start(self) -> None:
        """Warn once (rank 0) when a mid-epoch resume cannot restore a training loader's position."""
        from ..resumable import is_resumable

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        loader = trainer.fit_loop._combined_loader if trainer is not None else None
        if loader is None or trainer.fit_loop.epoch_loop.batch_progress.current.ready == 0:
            return  # a fresh run, or a resume at an epoch boundary: every loader starts its pass anyway
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        unrestored = []
        for dl in loader.flattened:
            progress = getattr(dl, "__dict__", {}).get("_galv_progress")
            if not is_resumable(dl):
                unrestored.append(f"{type(dl).__name__} over {type(getattr(dl, 'dataset', dl)).__name__} (no state)")
            elif progress is not None and not progress.restored:
                unrestored.append(f"{type(dl).__name__} over {type(dl.dataset).__name__} (no loader state in the "
                                  "checkpoint)")
        if unrestored:
            rank_zero_warn(f"resuming {done} batches into an epoch, but the position of training loader(s) "
                           f"{'; '.join(unrestored)} cannot be restored: they restart the epoch from its first "
                           "sample, so resume is not exact (batches repeat, the epoch's tail is not seen). HINT: "
                           "use a map-style Dataset (GalvatronStrategy makes its DataLoader resumable), give the "
                           "loader state_dict()/load_state_dict() (e.g. torchdata's StatefulDataLoader), or resume "
                           "from an end-of-epoch checkpoint.")

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self._start_method == "subprocess":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        from ..known_warnings import silence_known_warnings

        silence_known_warnings()  # rank from the environment, before the process group starts
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        # and with the rank the strategy computed: ranks started by spawn/fork never ran __init__
        silence_known_warnings(self.global_rank)
        # everything that can be checked locally is checked before any rank waits on another
        self._check_precision()
        pp = self._plan_spec.pp if isinstance(self._plan_spec, ParallelPlan) else 1
        if isinstance(self._plan_spec, ParallelPlan) and self._plan_spec.world_size != self.world_size:
            raise ValueError(f"plan world_size={self._plan_spec.world_size}: the Trainer runs {self.world_size} "
                             f"processes (devices x num_nodes). HINT: set devices={self._plan_spec.world_size}, or "
                             f"re-plan for this world size (galv search --devices {self.world_size} --out plan.yaml), "
                             "or strategy='galvatron' to search automatically.")
        assert self.cluster_environment is not None
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {} if self._timeout is None else {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        enable_flight_recorder()  # lets a collective timeout name its group (see parallel/timeouts.py)
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        if self._plan_spec is not None or self._shortcuts:  # pp is known now; automatic mode knows it in setup
            self._build_layout(pp)

    def _build_layout(self, pp: int) -> None:
        """The rank layout and the one mesh factory of this strategy (meshes themselves are built lazily)."""
        if self.layout is None or self.layout.pp != pp:
            self.layout = RankLayout(self.world_size, pp)
            self.mesh_factory = MeshFactory(self.layout, self.root_device.type, self.global_rank, self._timeout)

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @_names_timeouts
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.runtime is None:  # a reused Trainer (fit then test) keeps the parallelized model
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            self.plan = self._resolve_plan(trainer)
            self._build_layout(self.plan.pp)
            if self._keep_pristine and self.pristine is None:
                from .switch import PristineCopy

                self.pristine = PristineCopy(self.model)
            from ..parallel.expert import check_expert_sharding
            from ..parallel.parallelize import parallelize
            from .precision import clip_across_meshes

            assert self.mesh_factory is not None
            self.runtime = parallelize(self.model, self.plan, self.mesh_factory,
                                       grad_bucket_bytes=self._grad_bucket_bytes,
                                       expert_sharding=check_expert_sharding(self.expert_sharding))
            self.precision_plugin = clip_across_meshes(self.precision_plugin, self.runtime)
            if self.auto is None:  # automatic mode printed the plan it chose, with its prediction, already
                rank_zero_info(self.plan.describe())
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()  # never keep optimizers of an earlier setup
            self.setup_optimizers(trainer)
            assert self.lightning_module is not None
            replacement = self.runtime.prepare(self.lightning_module, self.optimizers,
                                               clip_val=trainer.gradient_clip_val,
                                               clip_algorithm=trainer.gradient_clip_algorithm,
                                               precision=str(self.precision_plugin.precision))
            if replacement is not None:  # e.g. the DeepSpeed engine now holds the module
                self.model = replacement
        self.setup_precision_plugin()

    # -- switching plans mid-fit ----------------------------------------------------------------------
    def keep_pristine_copy(self) -> None:
        """Before fit: keep a meta-device copy of the model's submodules so that :meth:`switch_plan` can
        re-parallelize them (costs no parameter memory; ``PlanMonitor(replan=True)`` calls it in ``setup``)."""
        self._keep_pristine = True

    @_names_timeouts
    def switch_plan(self, trainer: "pl.Trainer", plan: ParallelPlan | Mapping[str, Any] | str | Path,
                    directory: str | Path | None = None, keep_checkpoint: bool = False) -> Path | None:
        """Continue this fit under ``plan``, exactly: call it on every rank between optimizer steps (e.g. from
        ``on_train_batch_end`` after the last micro-batch of a step). The plan must serve the data loader the
        same layout; see :mod:`lightning_galv.strategies.switch` for how and why."""
        from .switch import switch_plan

        new = parse_plan(plan)
        old = self.plan
        path = switch_plan(self, trainer, new, directory, keep_checkpoint)
        rank_zero_info(f"switched plan at step {trainer.global_step}:\n  from {old.describe() if old else None}\n"
                       f"  to   {self.plan.describe() if self.plan else None}")
        return path

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _check_precision(self) -> None:
        from .precision import plugin_class

        p = self.precision_plugin
        ok = (plugin_class(p) is Precision
              or (isinstance(p, MixedPrecision) and p.precision == "bf16-mixed")
              or (isinstance(p, HalfPrecision) and p.precision == "bf16-true"))
        if not ok:
            name = getattr(p, "precision", type(p).__name__)
            raise ValueError(f"precision={name!r}: GalvatronStrategy supports '32-true', 'bf16-mixed' and "
                             "'bf16-true'. HINT: fp16 needs loss scaling across meshes, which is not implemented; "
                             "use bf16-mixed.")

    def _vocab_parallel_loss_choice(self) -> bool | None:
        """The explicit argument, else the module's declaration, else None (keep the plan's value)."""
        if self._vocab_parallel_loss is not None:
            return self._vocab_parallel_loss
        declared = getattr(self.lightning_module, "galv_vocab_parallel_loss", None)
        if declared is not None and not isinstance(declared, bool):
            raise TypeError(f"{type(self.lightning_module).__name__}.galv_vocab_parallel_loss={declared!r}: must "
                            "be a bool. HINT: set it to True only when every loss on the model's output uses "
                            "lightning_galv.loss.cross_entropy.")
        return declared

    def _resolve_plan(self, trainer: "pl.Trainer") -> ParallelPlan:
        plan = self._resolve_plan_layers(trainer)
        choice = self._vocab_parallel_loss_choice()
        if choice is not None and choice != plan.vocab_parallel_loss:
            plan = plan.with_(vocab_parallel_loss=choice)
        return plan

    def _resolve_plan_layers(self, trainer: "pl.Trainer") -> ParallelPlan:
        from ..models.protocol import find_parts

        assert self.model is not None
        parts = find_parts(self.model)
        if isinstance(self._plan_spec, ParallelPlan):
            return self._plan_spec
        if self._shortcuts:
            tp = self._shortcuts.get("tp", 1)
            if self.world_size % tp:
                raise ValueError(f"tp={tp}: must divide the world size {self.world_size}. "
                                 f"HINT: pick tp from the divisors of {self.world_size}.")
            s = LayerStrategy(**{**self._shortcuts, "tp": tp, "dp": self.world_size // tp})
            return ParallelPlan.uniform(self.world_size, len(parts.blocks), s)
        from ..auto import auto_plan
        from ..parallel.pipeline import PIPELINE_HOOKS

        module = self.lightning_module
        pipeline = all(callable(getattr(module, n, None)) for n in PIPELINE_HOOKS)
        self.auto = auto_plan(self.model, parts, self.world_size, self.root_device, self._memory_budget,
                              loader_batch=_loader_batch_size(trainer), pipeline=pipeline,
                              memory_margin=self._memory_margin,
                              vocab_parallel_loss=bool(self._vocab_parallel_loss_choice()),
                              routing_skew=self._routing_skew)
        return self.auto.plan

    # -- gradients and steps: all forwarded to the runtime ----------------------------------------
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no reduction on the non-final micro-batches."""
        assert self.runtime is not None
        self.runtime.set_gradient_sync(False)
        try:
            yield
        finally:
            self.runtime.set_gradient_sync(True)

    def post_backward(self, closure_loss: Tensor) -> None:
        if self.runtime is not None:
            self.runtime.after_backward()

    @_names_timeouts
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward (hooks, precision) with the runtime deciding how the loss back-propagates."""
        assert self.lightning_module is not None and self.runtime is not None
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.runtime.backward(closure_loss,
                              lambda loss: self.precision_plugin.backward(loss, module, optimizer, *args, **kwargs))
        # reduce first: the precision plugin's post_backward runs the on_after_backward hooks, which then see
        # the reduced gradients, as under DDP (buckets in flight hold the gradients as views: not readable yet)
        self.post_backward(closure_loss)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        return closure_loss

    @_names_timeouts
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        assert self.runtime is not None
        model = model or self.lightning_module
        return self.runtime.optimizer_step(
            lambda opt: self.precision_plugin.optimizer_step(opt, model=model, closure=closure, **kwargs), optimizer)

    def _set_dropout_key(self, args: tuple, kwargs: dict) -> None:
        """One keyed-dropout key per training micro-step, from the loop's counters: the same masks on every
        rank and under every plan, and again after a resume (``global_step`` and the loop's batch progress
        are restored). Under manual optimization ``global_step`` counts optimizer steps, which several
        training steps may feed, so the key is the index of the training batch instead: the batches completed
        so far in the fit (a resume from a checkpoint saved inside a batch re-runs that batch, as ``completed``
        says; ``ready`` would count it twice)."""
        from ..models.dropout import set_dropout_key

        trainer = self.lightning_module.trainer
        if not self.lightning_module.automatic_optimization:
            set_dropout_key(trainer.fit_loop.epoch_loop.batch_progress.total.completed)
            return
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        accumulate = trainer.accumulate_grad_batches
        set_dropout_key(trainer.global_step * accumulate + int(batch_idx) % accumulate)

    def _step(self, kind: StepKind, args: tuple, kwargs: dict, default: Any, context: Any) -> Any:
        from ..parallel.runtime import StepCall

        assert self.runtime is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        batch = args[0] if args else kwargs.get("batch")
        call = StepCall(kind, batch, self.lightning_module, lambda: default(*args, **kwargs), context,
                        trainer.accumulate_grad_batches if kind == "train" else 1)
        return self.runtime.step(call)

    @_names_timeouts
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._set_dropout_key(args, kwargs)
        return self._step("train", args, kwargs, super().training_step, self.precision_plugin.train_step_context)

    @_names_timeouts
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("val", args, kwargs, super().validation_step, self.precision_plugin.val_step_context)

    @_names_timeouts
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test", args, kwargs, super().test_step, self.precision_plugin.test_step_context)

    @_names_timeouts
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict", args, kwargs, super().predict_step, self.precision_plugin.predict_step_context)

    # -- collectives -------------------------------------------------------------------------------
    @_names_timeouts
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @_names_timeouts
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @_names_timeouts
    def reduce(self, tensor: Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- checkpoints -------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None and self.runtime is not None
        return self.runtime.module_state(self.model, full=not self._save_distributed_checkpoint)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint (needs the parallelized model)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None and self.runtime is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return self.runtime.optimizer_state(self.model, optimizer, full=not self._save_distributed_checkpoint)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint

    @_names_timeouts
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"storage_options={storage_options!r}: not supported by GalvatronStrategy. "
                            "HINT: drop the argument; checkpoints are written with torch.distributed.checkpoint.")
        assert self.runtime is not None
        path = Path(self.broadcast(str(filepath)))
        self.runtime.save(checkpoint, path, sharded=self._save_distributed_checkpoint,
                          is_rank_zero=self.is_global_zero, write_full=self._write_full)
        self.barrier()

    def _write_full(self, checkpoint: dict[str, Any], path: Path) -> None:
        """One ``.ckpt`` file through Lightning's checkpoint IO (rank 0), replacing a sharded folder there."""
        if path.is_dir():
            if is_sharded(path):  # a DCP folder from an earlier sharded save
                if self.is_global_zero:
                    shutil.rmtree(path)
            else:
                raise IsADirectoryError(f"checkpoint path {str(path)!r} is a directory. HINT: pass a file path.")
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, path)

    @_names_timeouts
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None and self.runtime is not None and self.lightning_module is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        return self.runtime.load(path, self.model, optimizers, strict=self.lightning_module.strict_loading,
                                 weights_only=weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def teardown(self) -> None:
        from ..models.dropout import set_dropout_key

        assert self.cluster_environment is not None and self.accelerator is not None
        set_dropout_key(None)  # keyed dropout outside the fit behaves like ordinary dropout again
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _loader_batch_size(trainer: "pl.Trainer") -> int | None:
    """Per-shard batch size of the loader this run will draw from, or None when it cannot be read.

    Automatic mode needs it before Lightning requests the loader (the plan decides the sampler's
    shards). A loader given to ``fit`` is read directly; a ``*_dataloader`` hook is called once more,
    which Lightning's hooks must tolerate anyway (``reload_dataloaders_every_n_epochs`` re-calls them).
    """
    from torch.utils.data import DataLoader

    loop = {TrainerFn.FITTING: trainer.fit_loop, TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop, TrainerFn.PREDICTING: trainer.predict_loop}.get(trainer.state.fn)
    source = getattr(loop, "_data_source", None)
    if source is None or not source.is_defined():
        return None
    loader = source.dataloader()
    if not isinstance(loader, DataLoader):
        return None
    batch = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
    return batch if isinstance(batch, int) and batch > 0 else None
