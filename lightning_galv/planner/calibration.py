"""Calibration: what a running fit measured, turned into corrections of the cost model's *inputs*.

Why inputs and not the model: every cost model built on the corrected profiles (the Galvatron-style one,
a future Galvatron-compatible one, the tuner's) then sees the same machine, the contract suite still
holds, and the raw profiles stay as measured -- :meth:`Calibration.apply` returns corrected copies and
never edits its arguments.

Three corrections, each fitted by least squares over observations from any number of steps and plans:

* ``compute_scale[layer type]`` multiplies that layer type's compute fits (forward, backward, recompute
  and the measured sharded fits): a busy or throttled machine, or kernels slower than in the profile;
  ``compute_scale["<type>@<tp>/<sp>"]`` (e.g. ``"block@tp2/megatron"``) multiplies, on top, the measured fit of
  one way of sharding it -- sharded kernels are where profiles and runs part most (small GEMMs, dispatch);
* ``comm_scale`` multiplies the time of every collective (link bandwidth divided, latency multiplied):
  a slower network than the profiler saw, or collectives contending with other traffic;
* ``memory_slack_bytes``: per-rank bytes the run holds beyond the prediction (allocator slack, buffers
  no profile itemizes), added to the model profile's fixed ``framework_bytes``.

The time fit. A layer observation is ``measured ~= a_t * compute + b * comm`` with ``compute`` and ``comm``
the cost model's predicted compute and collective seconds of that layer under its strategy, ``a_t`` the
scale of its layer type and ``b`` the collective scale. Residuals are taken relative to the measurement
(every layer counts alike, whatever its size), and a small ridge term pulls each factor toward 1, so
observations that cannot separate compute from communication (one plan whose layers all have the same
comm share) leave the split at its prior instead of producing wild factors; observations from several
plans (the tuner's trials) separate them.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import bad_value
from ..plan import ParallelPlan
from .cost import COST_MODEL_VERSION
from .profiles import HardwareProfile, LayerTypeProfile, LinkFit, ModelProfile, TimeFit

CALIBRATION_FILE = "calibration.json"
RIDGE = 1e-2  # weight of the pull toward 1 per factor, against relative residuals of order 0.01-0.1
# weight of the pull of a per-sharding factor toward its layer type's factor (``fit_plans(variant_ridge=)``).
# Stronger than the others: a sharding that only one or two plans used gets a factor fitted to their noise
# (leave-one-out on benchmarks/costmodel_accuracy.py: a 4-rank tp2 factor fitted on one noisy plan mispredicted
# the next by +120 % at 0.01). Chosen over 0.01-3 on two earlier runs of that benchmark by the smallest
# largest leave-one-out error over both (0.36 at 1.0; 1.21 at 0.01).
VARIANT_RIDGE = 1.0


@dataclass(frozen=True)
class LayerObservation:
    """One layer of one measured step: its type, the predicted compute / collective seconds, the measurement."""

    layer_type: str
    compute_s: float
    comm_s: float
    measured_s: float

    def __post_init__(self) -> None:
        for name in ("compute_s", "comm_s", "measured_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise bad_value(f"{name}={v!r}", "must be a finite number of seconds >= 0",
                                "drop observations of layers that did not run on this rank.")
        if self.measured_s <= 0 or self.compute_s + self.comm_s <= 0:
            raise bad_value(f"measured_s={self.measured_s}, predicted={self.compute_s + self.comm_s}",
                            "a layer observation needs a positive measurement and prediction",
                            "observe layers this rank actually ran.")


def _scaled_fit(fit: TimeFit, f: float) -> TimeFit:
    return fit.times(f)


@dataclass(frozen=True)
class Calibration:
    """Corrections of a model / hardware profile pair (see the module docstring)."""

    compute_scale: Mapping[str, float] = field(default_factory=dict)
    comm_scale: float = 1.0
    memory_slack_bytes: float = 0.0
    observations: int = 0
    model_version: int = COST_MODEL_VERSION  # the cost model the factors were fitted against (see load)

    def __post_init__(self) -> None:
        if isinstance(self.model_version, bool) or not isinstance(self.model_version, int) or self.model_version < 1:
            raise bad_value(f"model_version={self.model_version!r}", "must be an integer >= 1",
                            "write calibrations with Calibration.save.")
        for name, f in (*self.compute_scale.items(), ("comm_scale", self.comm_scale)):
            if not (math.isfinite(f) and f > 0):
                raise bad_value(f"{name}={f}", "a time scale must be a positive finite factor",
                                "refit with observations whose measurements and predictions are positive.")
        object.__setattr__(self, "compute_scale", dict(self.compute_scale))

    # -- fitting -----------------------------------------------------------------------------------
    @classmethod
    def fit(cls, layers: Sequence[LayerObservation], memory: Sequence[tuple[float, float]] = (),
            ridge: float = RIDGE) -> "Calibration":
        """Least-squares factors from layer observations and ``(predicted, measured)`` peak-memory pairs."""
        if not layers and not memory:
            raise bad_value("no observations", "a calibration needs at least one measured layer or memory peak",
                            "run a few sampled steps with OnlineProfiler first.")
        types = sorted({o.layer_type for o in layers})
        n = len(types) + 1  # one compute factor per layer type, one collective factor
        rows, rhs = [], []
        for o in layers:
            row = np.zeros(n)
            row[types.index(o.layer_type)] = o.compute_s / o.measured_s
            row[-1] = o.comm_s / o.measured_s
            rows.append(row)
            rhs.append(1.0)
        for i in range(n):  # ridge toward 1 (see the module docstring)
            row = np.zeros(n)
            row[i] = math.sqrt(ridge)
            rows.append(row)
            rhs.append(math.sqrt(ridge))
        sol = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0] if layers else np.ones(n)
        sol = np.clip(sol, 1e-3, 1e3)
        slack = float(np.mean([m - p for p, m in memory])) if memory else 0.0
        return cls({t: float(sol[i]) for i, t in enumerate(types)}, float(sol[-1]), slack,
                   len(layers) + len(memory))

    @classmethod
    def fit_plans(cls, cost_model: Callable[[ModelProfile, HardwareProfile], Any], model: ModelProfile,
                  hw: HardwareProfile, measured: Sequence[tuple[ParallelPlan, float, float | None]],
                  ridge: float = RIDGE, iterations: int = 4, per_variant: bool = True,
                  variant_ridge: float = VARIANT_RIDGE) -> "Calibration":
        """Factors from whole steps: ``measured`` holds ``(plan, step seconds, peak bytes or None)`` of several
        plans (the tuner's trials, a benchmark's runs) priced by ``cost_model(model, hw)``.

        A plan's predicted step time is linear in the compute scale of each layer type and in the collective
        scale (piecewise linear where collectives overlap compute): each slope is read off by pricing the plan
        once more with that factor doubled, the factors solve the same ridge-regularized relative least squares
        as :meth:`fit`, and a few Gauss-Newton rounds re-linearize around the current factors. ``per_variant``
        adds a factor per measured sharding of each layer type, multiplying its type's factor; ``variant_ridge``
        pulls each toward 1 (i.e. toward the type's factor) -- hierarchical shrinkage: a sharding only a few
        plans used moves away from its type only as far as they agree."""
        if not measured:
            raise bad_value("no measured plans", "fit_plans needs at least one (plan, step time) pair",
                            "measure a few plans first (OnlineProfiler, the tuner's trials).")
        types = sorted({lt.name for lt in model.layer_types})
        if per_variant:  # one more factor per measured way of sharding each layer type
            types += sorted({f"{lt.name}@{k}" for lt in model.layer_types for k in lt.sharded})
        n = len(types) + 1

        def price(factors: np.ndarray, plan: ParallelPlan) -> float:
            cal = cls({t: float(f) for t, f in zip(types, factors[:-1])}, float(factors[-1]))
            m2, h2 = cal.apply(model, hw)
            return float(cost_model(m2, h2).evaluate(plan).step_time_s)

        weights = np.array([math.sqrt(variant_ridge if "@" in t else ridge) for t in types] + [math.sqrt(ridge)])

        def objective(factors: np.ndarray) -> float:  # what the fit minimizes: relative residuals + the pulls
            res = [(price(factors, plan) - seconds) / seconds for plan, seconds, _ in measured]
            return float(np.sum(np.square(res)) + np.sum(np.square(weights * (factors - 1.0))))

        sol = np.ones(n)
        best = objective(sol)
        for _ in range(iterations):  # Gauss-Newton: re-linearize around the current factors
            rows, rhs = [], []
            for plan, seconds, _ in measured:
                here = price(sol, plan)
                slopes = []
                for j in range(n):  # d(step time) / d(factor j), by doubling it
                    bumped = sol.copy()
                    bumped[j] *= 2.0
                    slopes.append((price(bumped, plan) - here) / sol[j])
                rows.append(np.array(slopes) / seconds)
                rhs.append((seconds - here + float(np.dot(slopes, sol))) / seconds)
            for i in range(n):
                row = np.zeros(n)
                row[i] = weights[i]
                rows.append(row)
                rhs.append(weights[i])
            step = np.clip(np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0], 1e-3, 1e3) - sol
            # the step time is only piecewise linear in the factors (overlap takes a max): a full step can land
            # on another piece and make the fit worse, so halve it until it does not
            for _ in range(8):
                trial = np.clip(sol + step, 1e-3, 1e3)
                value = objective(trial)
                if value <= best:
                    sol, best = trial, value
                    break
                step = step / 2.0
        pred_mem = [(float(cost_model(model, hw).evaluate(p).peak_memory_bytes), float(m))
                    for p, _, m in measured if m is not None]
        slack = float(np.mean([m - q for q, m in pred_mem])) if pred_mem else 0.0
        return cls({t: float(sol[i]) for i, t in enumerate(types)}, float(sol[-1]), slack, len(measured))

    # -- applying ----------------------------------------------------------------------------------
    def apply(self, model: ModelProfile, hw: HardwareProfile | None) -> tuple[ModelProfile, HardwareProfile | None]:
        """Corrected copies of ``model`` and ``hw`` (the arguments are not modified)."""
        lts = []
        for lt in model.layer_types:
            f = self.compute_scale.get(lt.name, 1.0)
            per_variant = {k.split("@", 1)[1]: v for k, v in self.compute_scale.items()
                           if k.startswith(lt.name + "@")}
            lts.append(_scale_layer_type(lt, f, per_variant) if f != 1.0 or per_variant else lt)
        model = replace(model, layer_types=tuple(lts),
                        framework_bytes=max(0.0, model.framework_bytes + self.memory_slack_bytes))
        if hw is not None and self.comm_scale != 1.0:
            b = self.comm_scale
            hw = replace(hw, links={k: LinkFit(v.bandwidth / b, v.latency_s * b) for k, v in hw.links.items()})
        return model, hw

    # -- persistence -------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        data = json.loads(text)
        known = {"compute_scale", "comm_scale", "memory_slack_bytes", "observations", "model_version"}
        if not isinstance(data, dict) or set(data) - known:
            raise bad_value(sorted(data) if isinstance(data, dict) else data, f"calibration keys must be {sorted(known)}",
                            "write calibrations with Calibration.save.")
        return cls(**{"model_version": 1, **data})  # files from before the field: fitted against version 1

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(p)  # atomic: a concurrent reader never sees half a file

    @classmethod
    def load(cls, path: str | Path) -> "Calibration | None":
        """The calibration saved at ``path``; None when there is none, or when it was fitted against another
        version of the cost model (it is then left on disk and a warning says so: its corrections would
        double count what the model now prices itself, and the next monitored run overwrites it)."""
        p = Path(path)
        if not p.is_file():
            return None
        try:
            cal = cls.from_json(p.read_text())
        except (ValueError, TypeError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise bad_value(str(p), f"calibration file is corrupt ({type(exc).__name__}: {exc})",
                            f"delete it (the next monitored run writes a new one); it lives in the profile cache "
                            f"folder {str(p.parent)!r} ($GALV_CACHE_DIR)") from exc
        if cal.model_version != COST_MODEL_VERSION:
            warnings.warn(f"calibration {str(p)!r}: fitted against cost model version {cal.model_version}, this is "
                          f"version {COST_MODEL_VERSION}; not applied (its corrections would count twice what the "
                          f"model now prices). HINT: a run with PlanMonitor(save_calibration=True) writes a current "
                          f"one; delete the file to silence this.", stacklevel=2)
            return None
        return cal


def _scale_layer_type(lt: LayerTypeProfile, f: float, per_variant: Mapping[str, float] | None = None) -> LayerTypeProfile:
    extra = per_variant or {}
    sharded = {k: {kind: _scaled_fit(fit, f * extra.get(k, 1.0)) for kind, fit in fits.items()}
               for k, fits in lt.sharded.items()}
    over = {k: {kind: _scaled_fit(fit, f) for kind, fit in fits.items()} for k, fits in lt.zero_overhead.items()}
    return replace(lt, forward=_scaled_fit(lt.forward, f), backward=_scaled_fit(lt.backward, f),
                   recompute=None if lt.recompute is None else _scaled_fit(lt.recompute, f), sharded=sharded,
                   zero_overhead=over)


def layer_observations(plan: ParallelPlan, model: ModelProfile, hw: HardwareProfile, samples: int,
                       layer_times: Mapping[str, float]) -> list[LayerObservation]:
    """Observations of one measured batch of ``samples`` global samples: ``layer_times`` maps ``"layers.i"`` to
    the measured forward + backward (+ recompute) seconds of block i on this rank; blocks absent from it (other
    pipeline stages) are skipped. Predictions follow the cost model's split (``cost.sharded_compute`` /
    the measured sharded fits for compute, ``cost.block_comm_time`` for the block's collectives, repeated by
    the backward and, their ``cost.recompute_comm_share``, by a recompute; an MoE block's own collectives, ``cost.moe_layer_comm``, as priced)."""
    from .cost import block_comm_time, layer_compute, moe_layer_comm, recompute_comm_share

    out = []
    seq = model.seq_len
    for i, s in enumerate(plan.layers):
        measured = layer_times.get(f"layers.{i}")
        if not measured:
            continue
        lt = model.layer(i)
        b = samples / s.dp  # this rank's samples of the batch under the layer's data parallelism
        kinds = ("forward", "backward", "recompute") if s.checkpoint else ("forward", "backward")
        compute = 0.0
        for kind in kinds:
            compute += layer_compute(lt, kind, s, b, seq)
        act_bytes = b * seq * lt.hidden * model.act_dtype_bytes
        repeated = recompute_comm_share(lt, s)
        comm = block_comm_time(hw, model.shape, s, act_bytes, lt.moe) * (2.0 + repeated)
        if lt.moe is not None:  # router statistics, and under ep the all-to-alls (their share repeated too)
            stride = 1 if (s.ulysses or s.tp == 1 or not s.tp_consecutive) else s.tp
            moe_f, moe_b = moe_layer_comm(hw, lt, s, b, seq, model.act_dtype_bytes, stride)
            comm += moe_f * (1.0 + repeated) + moe_b
        out.append(LayerObservation(lt.name, compute, comm, float(measured)))
    return out


def calibration_path(cache_dir: str | Path | None = None) -> Path:
    """Where the calibration lives: next to the profile cache (``GALV_CACHE_DIR`` or the default cache)."""
    from .profiles import cache_dir as default_cache_dir

    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / CALIBRATION_FILE
