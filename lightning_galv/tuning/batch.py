"""``largest_batch()``: the largest batch that fits a plan, found by real trials on all its ranks.

Why: Lightning's ``Tuner.scale_batch_size`` refuses distributed strategies -- it grows the batch inside the
running process, where one rank running out of memory leaves the others hanging in a collective. Here every
probe is a short ``Trainer.fit`` in new processes on all ranks (the tuner's trial path,
:func:`lightning_galv.tuning.trial.run_trial`), so a probe that runs out of memory takes nothing down.

What "fits" means: the trial's measured peak memory (the largest over its ranks: the CUDA allocator's peak,
on CPU the resident-set high-water mark, as the tuner measures it) is at most the budget. A real out-of-memory error is "does
not fit" too; a crash or a hang is an *error* (raised), never read as "does not fit", because a bug at some
batch size says nothing about memory.

How: the batch moves in steps of the plan's batch unit (``micro_batches x lcm(dp)``: every layer must split
a micro-batch evenly). The cost model's memory prediction gives the first probe (the largest batch it
predicts to fit, :func:`predicted_largest_batch`); from there the search gallops -- steps of 1, 2, 4, ...
units up while probes fit, or down while they do not -- so an accurate prediction costs two trials and an
inaccurate one a logarithmic number. Once a fitting and a non-fitting batch bracket the boundary, it is
narrowed by interpolating the measured peaks (memory grows about linearly with the batch), falling back to
halving when the interpolation keeps landing on one side. The result is measured on both sides: the batch
returned fit, the batch one unit larger did not (unless the search stopped at ``max_global_batch``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import bad_value
from ..plan import ParallelPlan


@dataclass(frozen=True)
class BatchTrial:
    """One probe: the batch tried, what it peaked at, and whether that fits the budget."""

    global_batch: int
    shard_batch: int  # samples per data shard (the DataLoader's batch_size)
    peak_bytes: float  # inf: the trial ran out of memory
    fits: bool
    wall_s: float = 0.0


@dataclass
class BatchSearch:
    """What :func:`largest_batch` found. ``plan`` carries the largest fitting global batch."""

    plan: ParallelPlan
    global_batch: int
    micro_batch: int  # samples per pipeline micro-batch (the whole stage's), global_batch / micro_batches
    shard_batch: int  # samples per data shard per step: set this as the DataLoader's batch_size
    budget: float
    predicted_global_batch: int | None  # the cost model's largest fitting batch (None: not predicted)
    capped: bool  # stopped at max_global_batch while still fitting: larger batches may fit too
    trials: list[BatchTrial] = field(default_factory=list)

    @property
    def n_trials(self) -> int:
        return len(self.trials)

    def table(self) -> str:
        rows = ["| # | global batch | shard batch | peak MiB | budget MiB | fits |", "|---|---|---|---|---|---|"]
        for i, t in enumerate(self.trials):
            peak = f"{t.peak_bytes / 2**20:.1f}" if math.isfinite(t.peak_bytes) else "OOM"
            rows.append(f"| {i} | {t.global_batch} | {t.shard_batch} | {peak} | {self.budget / 2**20:.1f} | "
                        f"{'yes' if t.fits else 'no'} |")
        return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------
# pure parts: the prediction and the search over batch units
# ---------------------------------------------------------------------------------------------------
def predicted_largest_batch(cost: Any, plan: ParallelPlan, budget: float, max_global_batch: int) -> int | None:
    """The largest global batch (a multiple of ``plan.batch_unit``, at most ``max_global_batch``) whose
    predicted peak memory under ``cost`` (a :class:`~lightning_galv.planner.cost.CostModel`) is within
    ``budget``; None when even one unit is predicted not to fit. Predicted memory grows with the batch
    (activations scale with it, model states do not), so doubling then bisecting finds the boundary."""
    unit = plan.batch_unit
    limit = max_global_batch // unit

    def fits(k: int) -> bool:
        return cost.evaluate(plan.with_(global_batch=k * unit, prediction=None)).peak_memory_bytes <= budget

    if limit < 1 or not fits(1):
        return None
    lo = 1
    while lo < limit and fits(min(2 * lo, limit)):
        lo = min(2 * lo, limit)
    if lo == limit:
        return lo * unit
    hi = min(2 * lo, limit)  # does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit


def search_units(peak_of: Callable[[int], float], budget: float, start: int, limit: int,
                 slope: float | None = None) -> tuple[int | None, bool, dict[int, float]]:
    """The largest ``k`` in ``1..limit`` with ``peak_of(k) <= budget``, probing as few ``k`` as it can.

    Returns ``(k or None when k=1 does not fit, capped, peaks probed in order)``; ``capped`` means
    ``limit`` itself fit. The first probe is ``start``. While only one side of the boundary is known, the
    next probe is extrapolated from the nearest measured peak along a slope (bytes per unit: fitted to
    the measured peaks once two exist, before that ``slope``, the cost model's) but moves at least 1, 2,
    4, ... units while the extrapolation would move less (galloping), so a wrong slope costs a
    logarithmic number of probes. Once a fitting and a non-fitting ``k`` bracket the boundary, it
    interpolates their peaks (memory grows about linearly with the batch), halving instead after two
    probes in a row land on the same side so a curved or noisy memory curve cannot stall it. The result
    is measured on both sides: ``k`` fit and ``k + 1`` (unless ``capped``) did not."""
    peaks: dict[int, float] = {}

    def fits(k: int) -> bool:
        if k not in peaks:
            peaks[k] = float(peak_of(k))
        return peaks[k] <= budget

    def fitted_slope() -> float | None:
        pts = [(k, p) for k, p in peaks.items() if math.isfinite(p)]
        if len(pts) < 2:
            return slope if slope is not None and slope > 0 else None
        mk = sum(k for k, _ in pts) / len(pts)
        mp = sum(p for _, p in pts) / len(pts)
        var = sum((k - mk) ** 2 for k, _ in pts)
        b = sum((k - mk) * (p - mp) for k, p in pts) / var
        return b if b > 0 else (slope if slope is not None and slope > 0 else None)

    k = min(max(int(start), 1), limit)
    lo, hi = (k, None) if fits(k) else (None, k)
    step = 1
    while lo is None or hi is None:  # one side known: extrapolate, galloping at least ``step`` units
        b = fitted_slope()
        if hi is None:
            assert lo is not None
            if lo == limit:
                return lo, True, peaks
            jump = int((budget - peaks[lo]) / b) if b else 0
            nxt = min(lo + max(jump, step), limit)
            lo, hi = (nxt, None) if fits(nxt) else (lo, nxt)
        else:
            if hi == 1:
                return None, False, peaks
            jump = math.ceil((peaks[hi] - budget) / b) if b and math.isfinite(peaks[hi]) else 0
            nxt = max(hi - max(jump, step), 1)
            lo, hi = (nxt, hi) if fits(nxt) else (None, nxt)
        step = 2 * step if jump < step else 1  # the floor moved it: gallop; the slope did: trust it again
    run, last = 0, None
    while hi - lo > 1:
        p_lo, p_hi = peaks[lo], peaks[hi]
        if run < 2 and math.isfinite(p_hi) and p_hi > p_lo:
            c = lo + int((budget - p_lo) / (p_hi - p_lo) * (hi - lo))  # linear memory: the last fitting k
        else:
            c = (lo + hi) // 2
        c = min(max(c, lo + 1), hi - 1)
        side = fits(c)
        run = run + 1 if side == last else 1
        last = side
        lo, hi = (c, hi) if side else (lo, c)
    return lo, False, peaks


# ---------------------------------------------------------------------------------------------------
# the measured search
# ---------------------------------------------------------------------------------------------------
def default_budget(devices: int) -> float:
    """Memory per rank when none is given: the smallest visible GPU's, or this machine's RAM / ranks."""
    import psutil
    import torch

    if torch.cuda.is_available():
        n = min(devices, torch.cuda.device_count())
        return float(min(torch.cuda.get_device_properties(i).total_memory for i in range(n)))
    return float(psutil.virtual_memory().total) / devices


def _check_int(name: str, value: Any, low: int, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: must be an int. HINT: {example}")
    if value < low:
        raise bad_value(f"{name}={value}", f"must be >= {low}", example)


def largest_batch(module_factory: str, data_factory: str, plan: ParallelPlan | str | Path, devices: int, *,
                  memory_budget: str | int | float | None = None, start: int | None = None,
                  max_global_batch: int = 65536, warmup_steps: int = 1, steps: int = 1,
                  trial_timeout: float = 600.0, verbose: bool = True) -> BatchSearch:
    """The largest global batch that fits ``plan`` on ``devices`` ranks, by real short trials.

    ``module_factory`` / ``data_factory`` are import paths (``"pkg.mod:fn"``) as for :func:`tune`; the
    data factory's batch is changed per probe (:func:`lightning_galv.tuning.trial.make_data`: a
    ``batch_size`` parameter, a plain DataLoader, or a DataModule's ``batch_size``) and must serve
    ``warmup_steps + steps`` full batches per shard. ``plan`` is a :class:`ParallelPlan` or a plan file; its
    own ``global_batch`` is ignored. ``memory_budget`` is per rank (``"6GB"``, bytes; default: the device's
    memory, on CPU RAM / devices). ``start`` (a global batch) replaces the cost model's prediction as the
    first probe -- it skips profiling, which a model without the block protocol cannot do anyway.
    Raises ``ValueError`` when not even one batch unit fits, ``RuntimeError`` / ``TimeoutError`` when a
    trial crashes or hangs (an error, not "does not fit").
    """
    from ..auto import parse_bytes
    from ..testing import run_distributed
    from .trial import load_object
    from .tuner import _say, summary

    if isinstance(plan, (str, Path)):
        plan = ParallelPlan.load(plan)
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan={type(plan).__name__}: expected a ParallelPlan or a plan file path. HINT: "
                        "largest_batch(..., plan=ParallelPlan.load('best_plan.yaml')) or the path itself.")
    _check_int("devices", devices, 1, "devices=4 (the plan's world size).")
    if devices != plan.world_size:
        raise bad_value(f"devices={devices}", f"must equal the plan's world_size={plan.world_size}",
                        f"pass devices={plan.world_size}, or a plan made for {devices} ranks.")
    unit = plan.batch_unit
    _check_int("max_global_batch", max_global_batch, unit,
               f"max_global_batch must allow one batch unit of this plan (micro_batches x lcm(dp) = {unit}).")
    _check_int("warmup_steps", warmup_steps, 0, "warmup_steps=1.")
    _check_int("steps", steps, 1, "steps=1 (the peak is reached by the second optimizer step).")
    if start is not None:
        _check_int("start", start, unit, f"start is a global batch, e.g. start={4 * unit}.")
        if start % unit:
            raise bad_value(f"start={start}", f"must be a multiple of the plan's batch unit {unit} "
                            "(micro_batches x lcm of the dp degrees)", f"e.g. start={unit * max(1, start // unit)}.")
    if isinstance(trial_timeout, bool) or not isinstance(trial_timeout, (int, float)) or not trial_timeout > 0:
        raise bad_value(f"trial_timeout={trial_timeout!r}", "must be a positive number of seconds",
                        "trial_timeout=600.")
    budget = parse_bytes(memory_budget) if memory_budget is not None else default_budget(devices)
    load_object(module_factory), load_object(data_factory)  # fail here, not in every trial
    cap = data_cap(data_factory, plan, warmup_steps + steps)
    if cap is not None and cap < max_global_batch:
        if cap < unit:
            raise bad_value(f"data_factory={data_factory!r}", f"its dataset cannot fill {warmup_steps + steps} "
                            f"batches of one batch unit ({unit} samples) on {plan.data_parallel_size} shards",
                            "give the search more samples, or fewer warmup_steps / steps.")
        _say(verbose, f"batch search: the dataset holds at most global batch {cap} for {warmup_steps + steps} "
                      "full steps; searching up to it")
        max_global_batch = cap

    predicted: int | None = None
    slope: float | None = None
    if start is None:
        predicted, slope = _predict(module_factory, data_factory, plan, devices, budget, max_global_batch,
                                    trial_timeout, run_distributed)
        start = predicted if predicted is not None else unit
        _say(verbose, f"batch search: the cost model predicts global batch {predicted} fits "
                      f"{budget / 2**20:.1f} MiB per rank ({summary(plan)})")
    trials: list[BatchTrial] = []

    def peak_of(k: int) -> float:
        gb = k * unit
        shard = gb // plan.data_parallel_size
        tail: list[str] = []
        t0 = time.monotonic()
        try:
            out = run_distributed("lightning_galv.tuning.trial:run_trial", devices,
                                  (plan.with_(global_batch=gb, prediction=None).to_dict(), module_factory,
                                   data_factory, warmup_steps, steps, None, (), shard),
                                  init_process_group=False, timeout=trial_timeout, log_tail=tail)[0]
        except (RuntimeError, TimeoutError, OSError) as exc:
            kind = "hung (timeout)" if isinstance(exc, TimeoutError) else "crashed"
            cls = RuntimeError if isinstance(exc, RuntimeError) else type(exc)  # RankCrashed -> its base
            raise cls(f"batch search: the trial at global batch {gb} ({shard} per shard) {kind}; a crash "
                            f"is an error, not 'does not fit'.\n{str(exc)[-3000:]}") from exc
        seen = int(out.get("min_shard_batch") or 0)
        if 0 < seen < shard:
            raise bad_value(f"data_factory={data_factory!r}", f"served a batch of {seen} samples per shard where "
                            f"{shard} were asked ({warmup_steps + steps} steps)", "give the data at least "
                            f"{(warmup_steps + steps) * shard} samples per shard, or lower max_global_batch.")
        peak = math.inf if out["oom"] else float(out["peak_bytes"])
        trials.append(BatchTrial(gb, shard, peak, peak <= budget, time.monotonic() - t0))
        shown = f"{peak / 2**20:.1f} MiB" if math.isfinite(peak) else "out of memory"
        _say(verbose, f"batch trial {len(trials)}: global batch {gb} ({shard} per shard): peak {shown} -> "
                      f"{'fits' if peak <= budget else 'does not fit'}")
        return peak

    k, capped, _ = search_units(peak_of, budget, start // unit, max_global_batch // unit, slope)
    if k is None:
        first = trials[-1]
        raise bad_value(f"memory_budget={budget:.0f} bytes ({budget / 2**20:.1f} MiB)",
                        f"not even the smallest batch of this plan ({unit}) fits: it peaked at "
                        f"{first.peak_bytes / 2**20:.1f} MiB after {len(trials)} trials",
                        "raise the budget, or use a plan that keeps less per rank (ZeRO-3, checkpointing, more tp/pp).")
    gb = k * unit
    _say(verbose, f"largest batch: global {gb} ({gb // plan.data_parallel_size} per shard) after {len(trials)} "
                  f"trials{' (capped at max_global_batch)' if capped else ''}; predicted {predicted}")
    return BatchSearch(plan.with_(global_batch=gb, prediction=None), gb, gb // plan.micro_batches,
                       gb // plan.data_parallel_size, budget, predicted, capped, trials)


def data_cap(data_factory: str, plan: ParallelPlan, steps: int) -> int | None:
    """The largest global batch (a multiple of the plan's batch unit) whose ``steps`` batches per data shard
    the factory's dataset can fill, or None when its length is not known (a DataModule before setup, an
    iterable dataset). Why: a short loader ends an epoch with a partial batch, and a trial on a smaller
    batch than asked would measure the wrong thing -- better to bound the search than to probe past it."""
    from .trial import make_data

    from torch.utils.data import DataLoader

    data = make_data(data_factory, None)
    try:
        n = len(data.dataset) if isinstance(data, DataLoader) else None
    except TypeError:  # an iterable dataset without a length
        n = None
    if n is None:
        return None
    per_shard = n // plan.data_parallel_size  # what the distributed sampler gives each shard (at least)
    gb = per_shard // steps * plan.data_parallel_size
    return gb - gb % plan.batch_unit


def _predict(module_factory: str, data_factory: str, plan: ParallelPlan, devices: int, budget: float,
             max_global_batch: int, timeout: float,
             run_distributed: Callable[..., Any]) -> tuple[int | None, float | None]:
    """The cost model's largest fitting batch and its predicted bytes per batch unit, from profiles
    measured the way automatic mode measures them (cached, so a second search of the same model on the
    same machine skips the measuring). The slope guides the search until measured peaks give their own:
    what the model leaves out is mostly a constant (on CPU the process' baseline), not per sample."""
    from ..planner import HardwareProfile, ModelProfile
    from .tuner import _cost

    r = run_distributed("lightning_galv.tuning.trial:profile_run", devices,
                        (module_factory, data_factory, budget), timeout=timeout)[0]
    model = ModelProfile.from_json(r["model_profile"])
    hw = HardwareProfile.from_json(r["hardware_profile"])
    plan.check_model(model.shape)
    cost = _cost(model, hw, None)
    unit = plan.batch_unit
    one, two = (cost.evaluate(plan.with_(global_batch=k * unit, prediction=None)).peak_memory_bytes for k in (1, 2))
    return predicted_largest_batch(cost, plan, budget, max_global_batch), two - one
