"""Calibration: what a running fit measured, turned into corrections of the cost model's *inputs*.

Why inputs and not the model: every cost model built on the corrected profiles (the Galvatron-style one,
a future Galvatron-compatible one, the tuner's) then sees the same machine, the contract suite still
holds, and the raw profiles stay as measured -- :meth:`Calibration.apply` returns corrected copies and
never edits its arguments.

Three corrections, each fitted by least squares over observations from any number of steps and plans:

* ``compute_scale[layer type]`` multiplies that layer type's compute fits (forward, backward, recompute
  and the measured sharded fits): a busy or throttled machine, or kernels slower than in the profile;
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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import bad_value
from ..plan import ParallelPlan
from .profiles import HardwareProfile, LayerTypeProfile, LinkFit, ModelProfile, TimeFit

CALIBRATION_FILE = "calibration.json"
RIDGE = 1e-2  # weight of the pull toward 1 per factor, against relative residuals of order 0.01-0.1


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
    return TimeFit(fit.const * f, fit.per_token * f, fit.per_token_ctx * f)


@dataclass(frozen=True)
class Calibration:
    """Corrections of a model / hardware profile pair (see the module docstring)."""

    compute_scale: Mapping[str, float] = field(default_factory=dict)
    comm_scale: float = 1.0
    memory_slack_bytes: float = 0.0
    observations: int = 0

    def __post_init__(self) -> None:
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

    # -- applying ----------------------------------------------------------------------------------
    def apply(self, model: ModelProfile, hw: HardwareProfile | None) -> tuple[ModelProfile, HardwareProfile | None]:
        """Corrected copies of ``model`` and ``hw`` (the arguments are not modified)."""
        lts = []
        for lt in model.layer_types:
            f = self.compute_scale.get(lt.name, 1.0)
            lts.append(_scale_layer_type(lt, f) if f != 1.0 else lt)
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
        known = {"compute_scale", "comm_scale", "memory_slack_bytes", "observations"}
        if not isinstance(data, dict) or set(data) - known:
            raise bad_value(sorted(data) if isinstance(data, dict) else data, f"calibration keys must be {sorted(known)}",
                            "write calibrations with Calibration.save.")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(p)  # atomic: a concurrent reader never sees half a file

    @classmethod
    def load(cls, path: str | Path) -> "Calibration | None":
        p = Path(path)
        return cls.from_json(p.read_text()) if p.is_file() else None


def _scale_layer_type(lt: LayerTypeProfile, f: float) -> LayerTypeProfile:
    sharded = {k: {kind: _scaled_fit(fit, f) for kind, fit in fits.items()} for k, fits in lt.sharded.items()}
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
    the backward and by a recompute)."""
    from .cost import block_comm_time, sharded_compute

    out = []
    seq = model.seq_len
    for i, s in enumerate(plan.layers):
        measured = layer_times.get(f"layers.{i}")
        if not measured:
            continue
        lt = model.layer(i)
        b = samples / s.dp  # this rank's samples of the batch under the layer's data parallelism
        sp = s.sp if s.tp > 1 else "none"
        kinds = ("forward", "backward", "recompute") if s.checkpoint else ("forward", "backward")
        compute = 0.0
        for kind in kinds:
            fit = lt.sharded_fit("forward" if kind == "recompute" else kind, s.tp, sp)
            if fit is not None:
                compute += fit(b, seq)
            else:
                full = {"forward": lt.forward, "backward": lt.backward, "recompute": lt.recompute_fit()}[kind]
                compute += sharded_compute(full.const, full(b, seq), s.tp)
        act_bytes = b * seq * lt.hidden * model.act_dtype_bytes
        comm = block_comm_time(hw, model.shape, s, act_bytes) * (3 if s.checkpoint else 2)
        out.append(LayerObservation(lt.name, compute, comm, float(measured)))
    return out


def calibration_path(cache_dir: str | Path | None = None) -> Path:
    """Where the calibration lives: next to the profile cache (``GALV_CACHE_DIR`` or the default cache)."""
    from .profiles import cache_dir as default_cache_dir

    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / CALIBRATION_FILE
