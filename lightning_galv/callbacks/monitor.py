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
neither warned about nor fitted. Re-planning within a fit is not implemented.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

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
    """

    def __init__(self, profiler: OnlineProfiler, time_threshold: float = 0.25, cost_model: Any = None,
                 save_calibration: bool = True, cache_dir: str | Path | None = None) -> None:
        if not isinstance(profiler, OnlineProfiler):
            raise TypeError(f"profiler={type(profiler).__name__}: must be an OnlineProfiler. HINT: "
                            "prof = OnlineProfiler(); Trainer(callbacks=[prof, PlanMonitor(prof)]).")
        if not (isinstance(time_threshold, (int, float)) and time_threshold > 0):
            raise bad_value(f"time_threshold={time_threshold!r}", "must be a positive fraction", "e.g. 0.25.")
        self.profiler, self.time_threshold = profiler, float(time_threshold)
        self.cost_model, self.save_calibration, self.cache_dir = cost_model, save_calibration, cache_dir
        self.comparisons: list[dict[str, float]] = []
        self.warned = False
        self._seen = 0
        self._plan: Any = None
        self._device_type = "cpu"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not hasattr(strategy, "plan"):
            raise ValueError(f"strategy {type(strategy).__name__}: PlanMonitor compares a Galvatron plan's prediction "
                             "with the run. HINT: use Trainer(strategy='galvatron' or GalvatronStrategy(...)).")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        self._plan = strategy.plan
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

    def calibration(self) -> Any:
        """The :class:`Calibration` fitted from every sampled step so far (None without one)."""
        from ..planner.calibration import Calibration, layer_observations

        model = getattr(self.cost_model, "model", None)
        hw = getattr(self.cost_model, "hw", None)
        if model is None or hw is None or not self.profiler.records:
            return None
        obs = []
        for rec in self.profiler.records:
            times = {name: rec.layer_forward_s.get(name, 0.0) + rec.layer_backward_s.get(name, 0.0)
                     + rec.layer_recompute_s.get(name, 0.0) for name in rec.layer_forward_s}
            obs += layer_observations(self._plan, model, hw, rec.samples, times)
        cuda = self._device_type == "cuda"  # CPU resident memory is not what the cost model predicts
        memory = [(c["predicted_peak_bytes"], c["measured_peak_bytes"]) for c in self.comparisons] if cuda else []
        return Calibration.fit(obs, memory) if obs or memory else None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.save_calibration or not trainer.is_global_zero:
            return
        cal = self.calibration()
        if cal is not None:
            cal.save(calibration_path(self.cache_dir))
