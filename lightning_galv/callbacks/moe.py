"""Per-step MoE callbacks (issue 12): NetMoE sample placement and LAER-MoE load-adaptive expert re-layout.

Both follow the same pattern as the other callbacks: the work is done by a Lightning-free runtime object
(``parallel/sample_placement.py``, ``parallel/expert_relayout.py``), the callback only decides *when* (at
optimizer-step boundaries, so a decision holds for every micro-batch of a step) and logs what happened.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L

from ..errors import bad_value


def _plan_of(trainer: L.Trainer, who: str, resolved: bool = True) -> Any:
    """The strategy's plan (``resolved=False``: only check that the strategy has one, as in ``setup``, before
    automatic mode has searched it)."""
    strategy = trainer.strategy
    if not hasattr(strategy, "plan"):
        raise ValueError(f"strategy {type(strategy).__name__}: {who} acts on the expert-parallel MoE layers of a "
                         "Galvatron plan. HINT: Trainer(strategy='galvatron' or GalvatronStrategy(plan=...)).")
    plan = strategy.plan
    if resolved and plan is None:
        raise RuntimeError(f"{who}: the strategy has no plan at train start. HINT: this is a bug; the strategy "
                           "resolves its plan in setup.")
    return plan


class _StepHooks(L.Callback):
    """Calls ``_before()`` at the first micro-batch of every optimizer step and ``_after()`` once it ran."""

    controller: Any = None
    _planned_step = -1
    _done_step = -1

    def _before(self) -> None:
        self.controller.before_step()

    def _after(self, pl_module: L.LightningModule) -> None:
        """Measure and log the finished step (each callback its own records)."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.controller is not None and trainer.global_step != self._planned_step:
            self._planned_step = trainer.global_step
            self._before()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.controller is None or trainer.global_step in (self._planned_step, self._done_step):
            return  # still accumulating (or already measured)
        self._done_step = trainer.global_step
        self._after(pl_module)

    def on_galv_plan_switch(self, trainer: L.Trainer, pl_module: L.LightningModule, old: Any, new: Any) -> None:
        """The strategy re-parallelized the model: measure the finished step on the old layers (if this
        callback's batch-end hook has not yet), then attach to the new plan's MoE layers."""
        self.on_train_batch_end(trainer, pl_module, None, None, 0)
        self.on_train_start(trainer, pl_module)


class ExpertRelayout(_StepHooks):
    """LAER-MoE: each optimizer step, re-decide which experts each EP rank materializes (hot experts on
    several ranks, their tokens split over the replicas) from the previous step's expert loads.

    Training is exact: losses and weights equal the same run without the callback (up to float summation
    order). Off unless added: ``Trainer(callbacks=[ExpertRelayout()])``; LightningCLI:
    ``trainer.callbacks: [{class_path: lightning_galv.callbacks.ExpertRelayout}]``.

    Args:
        slots_per_rank: experts one rank may materialize per layer (default ``E/ep + 1``).
        log: log ``relayout/*`` metrics (rank 0) each step: max/mean load per rank before (plain EP) and
            after, planner milliseconds, parameter bytes moved.
        expert_sharding: ``"full"`` shards every expert over its EP group, as LAER-MoE's FSEP does (sets the
            strategy's ``expert_sharding`` before it parallelizes the model): each rank materializes its
            layout's experts from the rows all ranks hold, so the bytes a step moves are spread evenly over the
            group instead of falling on the owners of hot experts; ``"owner"``: each expert stays whole on its
            owner, which sends copies to its replicas; ``None`` (default): what the strategy says (``"owner"``
            unless set there).

    ``records`` keeps every :class:`~lightning_galv.parallel.expert_relayout.RelayoutRecord` of this rank.
    """

    def __init__(self, slots_per_rank: int | None = None, log: bool = True,
                 expert_sharding: str | None = None) -> None:
        if expert_sharding is not None:
            from ..parallel.expert import check_expert_sharding

            check_expert_sharding(expert_sharding)
        self.expert_sharding = expert_sharding
        if slots_per_rank is not None and (isinstance(slots_per_rank, bool) or not isinstance(slots_per_rank, int)
                                           or slots_per_rank < 1):
            raise bad_value(f"slots_per_rank={slots_per_rank!r}", "must be a positive int or None",
                            "None materializes E/ep + 1 experts per rank.")
        self.slots_per_rank, self.log = slots_per_rank, log
        self.records: list[Any] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        _plan_of(trainer, "ExpertRelayout", resolved=False)
        strategy = trainer.strategy
        if self.expert_sharding is None or self.expert_sharding == getattr(strategy, "expert_sharding", None):
            return
        if getattr(strategy, "runtime", None) is not None:
            raise ValueError(f"ExpertRelayout(expert_sharding={self.expert_sharding!r}): the strategy already "
                             f"parallelized the model with expert_sharding={strategy.expert_sharding!r}. HINT: set "
                             "it on the strategy instead, GalvatronStrategy(expert_sharding=...).")
        strategy.expert_sharding = self.expert_sharding  # read when the strategy parallelizes, after this hook

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from ..parallel.expert_relayout import RelayoutController
        from ..parallel.moe_step import attach_relayout

        self.controller = RelayoutController(attach_relayout(pl_module, _plan_of(trainer, "ExpertRelayout")),
                                             self.slots_per_rank)

    def _after(self, pl_module: L.LightningModule) -> None:
        recs = self.controller.after_step()
        self.records += recs
        if self.log and recs:
            n = len(recs)
            metrics = {"relayout/max_mean_before": sum(r.max_mean_before for r in recs) / n,
                       "relayout/max_mean_after": sum(r.max_mean_after for r in recs) / n,
                       "relayout/planner_ms": sum(r.planner_ms for r in recs),
                       "relayout/moved_MB": sum(r.moved_bytes for r in recs) / 2**20,
                       "relayout/max_rank_MB": sum(r.max_rank_bytes for r in recs) / 2**20}
            for k, v in metrics.items():
                pl_module.log(k, v, rank_zero_only=True, on_step=True, on_epoch=False)


class SamplePlacement(_StepHooks):
    """NetMoE: each MoE layer's combine delivers every sample to the rank of its EP group that the
    placement solver picks, so that fewer tokens cross node boundaries; the last MoE layer of each run of
    same-layout blocks sends samples home (``parallel/sample_placement.py``).

    Training is exact (losses and weights equal the same run without the callback, up to float summation
    order). Off unless added: ``Trainer(callbacks=[SamplePlacement(gpus_per_node=4)])``.

    Args:
        gpus_per_node: ranks per node (default: ``LOCAL_WORLD_SIZE`` / ``SLURM_NTASKS_PER_NODE`` from the
            cluster environment, else one node). On one machine a smaller value simulates several nodes.
        intra_bw / inter_bw: bytes/s per rank for the predicted time saved (default: none, bytes only).
        policy: a :class:`~lightning_galv.planner.placement.PlacementPolicy` (default: NetMoE's two-stage
            assignment, :class:`~lightning_galv.planner.placement.NetMoEPlacement`).
        log: log ``placement/*`` (rank 0): inter-node MB before / after, key MB, solver ms, moved samples.

    ``steps`` keeps every :class:`~lightning_galv.parallel.sample_placement.PlacementStep` of this rank.
    """

    def __init__(self, gpus_per_node: int | None = None, intra_bw: float | None = None,
                 inter_bw: float | None = None, policy: Any = None, log: bool = True) -> None:
        from ..planner.placement import PlacementPolicy

        if policy is not None and not isinstance(policy, PlacementPolicy):
            raise TypeError(f"policy={type(policy).__name__}: must be a PlacementPolicy. HINT: subclass "
                            "lightning_galv.planner.placement.PlacementPolicy, or leave None for NetMoE's solver.")
        self.policy = policy
        if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                          or gpus_per_node < 1):
            raise bad_value(f"gpus_per_node={gpus_per_node!r}", "must be a positive int or None",
                            "e.g. gpus_per_node=8, or None to read it from the cluster environment.")
        for name, v in (("intra_bw", intra_bw), ("inter_bw", inter_bw)):
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise bad_value(f"{name}={v!r}", "must be a positive number of bytes/s or None", "e.g. 25e9.")
        self.gpus_per_node, self.intra_bw, self.inter_bw, self.log = gpus_per_node, intra_bw, inter_bw, log
        self.steps: list[Any] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        _plan_of(trainer, "SamplePlacement", resolved=False)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from ..parallel.moe_step import attach_placement
        from ..parallel.sample_placement import PlacementController
        from ..planner.topology import Topology

        gpn = self.gpus_per_node
        if gpn is None:
            gpn = Topology.from_env(trainer.world_size).gpus_per_node
        self.controller = PlacementController(
            attach_placement(pl_module, _plan_of(trainer, "SamplePlacement"), gpn, self.policy),
            self.intra_bw, self.inter_bw)

    def _after(self, pl_module: L.LightningModule) -> None:
        st = self.controller.after_step()
        self.steps.append(st)
        if self.log and self.controller.dispatchers:
            metrics = {"placement/inter_MB_before": st.inter_before / 2**20,
                       "placement/inter_MB_after": st.inter_after / 2**20,
                       "placement/key_MB": st.key_bytes / 2**20, "placement/solve_ms": st.solve_ms,
                       "placement/moved_samples": float(st.moved_samples)}
            if st.time_saved_s is not None:
                metrics["placement/a2a_ms_saved"] = st.time_saved_s * 1e3
            for k, v in metrics.items():
                pl_module.log(k, v, rank_zero_only=True, on_step=True, on_epoch=False)
