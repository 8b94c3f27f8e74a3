"""``PlanMonitor``: the plan's predicted step time next to the measured one, a warning when they part, and
the calibration that would close the gap.

Why: a plan is chosen on predictions; when the run does not behave as predicted (a busy machine, a slow link,
a profile from another machine) the user should hear it with numbers, and the next automatic search should
start from the corrected inputs. The monitor reads the :class:`~.online_profiler.OnlineProfiler`'s sampled
steps, compares each with the cost model's prediction, warns once (rank 0) past ``time_threshold``, and at the
end of the fit writes the fitted :class:`~lightning_galv.planner.calibration.Calibration` next to the profile
cache, where automatic mode picks it up (``lightning_galv/auto.py``).

Memory is compared where the measurement means the same thing as the prediction: the CUDA allocator's peak.
On CPU the process's resident set also holds the Python runtime and libraries, so CPU memory is logged but
neither warned about nor fitted.

Re-planning (``replan=True``): when a sampled step misses its prediction by more than ``time_threshold``,
rank 0 fits the calibration from what was measured so far, searches again with it among the plans the
running data loader can serve (:func:`lightning_galv.auto.replan_search`), and -- if one is predicted
faster than the running plan by ``replan_margin`` under the same calibrated model -- every rank switches
to it at the step boundary (:meth:`GalvatronStrategy.switch_plan`: checkpoint, re-parallelize, reload;
exact). Both plans and the predictions that decided are logged and kept in ``switches``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..errors import bad_value
from ..planner.calibration import calibration_path
from .online_profiler import OnlineProfiler


class PlanMonitor(L.Callback):
    """Predicted vs measured for every step the ``profiler`` samples (see the module docstring).

    Args:
        profiler: the OnlineProfiler of the same Trainer (it must come before the monitor in ``callbacks``).
        time_threshold: relative step-time error above which the monitor warns (once).
        cost_model: prices the plan; default: the one automatic mode searched with.
        save_calibration: write the fitted calibration to the profile cache at the end of the fit.
        replan: re-search with the calibrated model when the threshold is passed, and switch plans mid-fit if
            the new plan is predicted ``replan_margin`` faster (see the module docstring).
        replan_margin: relative predicted gain a new plan needs (0.1: 10 % faster per step).
        max_switches: at most this many switches per fit.
        replanner: ``f(plan, calibration) -> lightning_galv.auto.Replan``; default: :func:`replan_search` over
            automatic mode's profiles and budget (a given plan needs it, or a ``cost_model`` and ``memory_budget``).
        checkpoint_dir: where a switch writes its checkpoint (default: a temporary folder; use a shared folder
            on several nodes).
    """

    def __init__(self, profiler: OnlineProfiler, time_threshold: float = 0.25, cost_model: Any = None,
                 save_calibration: bool = True, cache_dir: str | Path | None = None, *, replan: bool = False,
                 replan_margin: float = 0.1, max_switches: int = 1, replanner: Callable[..., Any] | None = None,
                 memory_budget: str | int | float | None = None, checkpoint_dir: str | Path | None = None) -> None:
        if not isinstance(profiler, OnlineProfiler):
            raise TypeError(f"profiler={type(profiler).__name__}: must be an OnlineProfiler. HINT: "
                            "prof = OnlineProfiler(); Trainer(callbacks=[prof, PlanMonitor(prof)]).")
        if not (isinstance(time_threshold, (int, float)) and time_threshold > 0):
            raise bad_value(f"time_threshold={time_threshold!r}", "must be a positive fraction", "e.g. 0.25.")
        if not isinstance(replan, bool):
            raise TypeError(f"replan={replan!r}: must be True or False. HINT: PlanMonitor(prof, replan=True).")
        if not (isinstance(replan_margin, (int, float)) and 0 <= replan_margin < 1):
            raise bad_value(f"replan_margin={replan_margin!r}", "must be a fraction in [0, 1)", "e.g. 0.1 (10 % faster).")
        if isinstance(max_switches, bool) or not isinstance(max_switches, int) or max_switches < 0:
            raise bad_value(f"max_switches={max_switches!r}", "must be an int >= 0", "e.g. max_switches=1.")
        if replanner is not None and not callable(replanner):
            raise TypeError(f"replanner={replanner!r}: must be callable (plan, calibration) -> Replan. HINT: leave it "
                            "None to search with automatic mode's profiles.")
        self.replan, self.replan_margin, self.max_switches = replan, float(replan_margin), max_switches
        self.replanner, self.memory_budget, self.checkpoint_dir = replanner, memory_budget, checkpoint_dir
        self.switches: list[dict[str, Any]] = []
        self._measured: list[tuple[Any, Any]] = []  # (OnlineProfiler record, the plan it ran under)
        self._want_replan = False
        self.profiler, self.time_threshold = profiler, float(time_threshold)
        self.cost_model, self.save_calibration, self.cache_dir = cost_model, save_calibration, cache_dir
        self.comparisons: list[dict[str, float]] = []
        self.warned = False
        self._seen = 0
        self._plan: Any = None
        self._auto: Any = None
        self._device_type = "cpu"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not hasattr(strategy, "plan"):
            raise ValueError(f"strategy {type(strategy).__name__}: PlanMonitor compares a Galvatron plan's prediction "
                             "with the run. HINT: use Trainer(strategy='galvatron' or GalvatronStrategy(...)).")
        if self.replan and self.max_switches:
            strategy.keep_pristine_copy()  # before the strategy's setup parallelizes the model

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        self._plan = strategy.plan
        self._auto = getattr(strategy, "auto", None)
        self._device_type = pl_module.device.type
        if self.cost_model is None and getattr(strategy, "auto", None) is not None and strategy.auto.model is not None:
            self.cost_model = strategy.auto.cost_model()
        if self.cost_model is None:
            raise ValueError("PlanMonitor: no cost model to predict this plan with (the plan was given, not searched). "
                             "HINT: pass PlanMonitor(profiler, cost_model=GalvatronCostModel(model_profile, "
                             "hardware_profile, runtime='native')), or use automatic mode.")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        records = self.profiler.records
        for rec in records[self._seen:]:
            plan = self._plan.with_(global_batch=rec.samples)
            predicted = self.cost_model.evaluate(plan)
            err = rec.step_time_s / predicted.step_time_s - 1.0
            row = {"step": rec.step, "predicted_s": predicted.step_time_s, "measured_s": rec.step_time_s,
                   "time_error": err, "predicted_peak_bytes": predicted.peak_memory_bytes,
                   "measured_peak_bytes": rec.peak_memory_bytes}
            self.comparisons.append(row)
            self._measured.append((rec, self._plan))
            if self.replan and abs(err) > self.time_threshold and len(self.switches) < self.max_switches:
                self._want_replan = True
            for logger in trainer.loggers:
                logger.log_metrics({"galv/predicted_step_time_s": row["predicted_s"],
                                    "galv/step_time_error": err}, step=rec.step)
            if abs(err) > self.time_threshold and not self.warned:
                self.warned = True
                rank_zero_warn(f"PlanMonitor: step {rec.step} took {rec.step_time_s * 1e3:.1f} ms, the plan was predicted "
                               f"at {predicted.step_time_s * 1e3:.1f} ms ({err:+.0%}, threshold "
                               f"{self.time_threshold:.0%}). The profiles do not describe this run; the fitted "
                               "calibration is written at the end of the fit and used by the next automatic search.")
        self._seen = len(records)
        if self._want_replan and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self._want_replan = False
            self._maybe_switch(trainer)

    def _maybe_switch(self, trainer: L.Trainer) -> None:
        """Rank 0 re-searches with the calibration so far; every rank follows its decision."""
        strategy = trainer.strategy
        decision: Any = None
        if trainer.is_global_zero:
            try:
                found = self._replanner()(self._plan, self.calibration())
                decision = ("ok", found.plan.to_dict() if found.plan is not None else None, found.describe(),
                            found.current_s, found.best_s)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below, never a hang
                decision = ("error", f"{type(exc).__name__}: {exc}")
        decision = strategy.broadcast(decision)
        if decision[0] == "error":
            raise RuntimeError(f"PlanMonitor(replan=True): re-searching on rank 0 failed: {decision[1]}")
        _, plan_d, text, current_s, best_s = decision
        step = trainer.global_step
        if plan_d is None:
            rank_zero_info(f"PlanMonitor: step {step}: no better plan for this loader ({text}); keeping the plan.")
            self.switches.append({"step": step, "switched": False, "why": text})
            return
        old = self._plan
        strategy.switch_plan(trainer, plan_d, directory=self.checkpoint_dir)
        self.switches.append({"step": step, "switched": True, "why": text, "from": old.to_dict(),
                              "to": strategy.plan.to_dict(), "predicted_from_s": current_s,
                              "predicted_to_s": best_s})
        for logger in trainer.loggers:
            logger.log_metrics({"galv/plan_switches": float(sum(s["switched"] for s in self.switches))}, step=step)

    def _replanner(self) -> Callable[..., Any]:
        if self.replanner is not None:
            return self.replanner
        from ..auto import parse_bytes, replan_search
        from ..planner.search import DEFAULT_MEMORY_MARGIN

        auto = self._auto
        model = auto.model if auto is not None else getattr(self.cost_model, "model", None)
        hw = auto.hardware if auto is not None else getattr(self.cost_model, "hw", None)
        budget = auto.budget if auto is not None else (parse_bytes(self.memory_budget) if self.memory_budget else None)
        margin = auto.memory_margin if auto is not None else DEFAULT_MEMORY_MARGIN
        if model is None or budget is None:
            raise ValueError("PlanMonitor(replan=True): no profiles or memory budget to search with (the plan was "
                             "given). HINT: use automatic mode, or pass cost_model=GalvatronCostModel(...) and "
                             "memory_budget='8GB', or a replanner.")
        return lambda plan, cal: replan_search(plan, model, hw, budget, margin, cal, min_gain=self.replan_margin)

    def on_galv_plan_switch(self, trainer: L.Trainer, pl_module: L.LightningModule, old: Any, new: Any) -> None:
        """The strategy switched plans: predict the new one from now on."""
        self._plan = new

    def calibration(self) -> Any:
        """The :class:`Calibration` fitted from every sampled step so far (None without one)."""
        from ..planner.calibration import Calibration, layer_observations

        model = getattr(self.cost_model, "model", None)
        hw = getattr(self.cost_model, "hw", None)
        if model is None or hw is None or not self._measured:
            return None
        obs = []
        for rec, plan in self._measured:
            times = {name: rec.layer_forward_s.get(name, 0.0) + rec.layer_backward_s.get(name, 0.0)
                     + rec.layer_recompute_s.get(name, 0.0) for name in rec.layer_forward_s}
            obs += layer_observations(plan, model, hw, rec.samples, times)
        cuda = self._device_type == "cuda"  # CPU resident memory is not what the cost model predicts
        memory = [(c["predicted_peak_bytes"], c["measured_peak_bytes"]) for c in self.comparisons] if cuda else []
        return Calibration.fit(obs, memory) if obs or memory else None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.save_calibration or not trainer.is_global_zero:
            return
        cal = self.calibration()
        if cal is not None:
            cal.save(calibration_path(self.cache_dir))
