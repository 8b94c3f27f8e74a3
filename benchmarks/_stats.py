"""Confidence intervals for benchmark tables (a few repeats on a noisy machine: Student's t, not a normal)."""

from __future__ import annotations

import math
import statistics

# two-sided 95 % quantiles of Student's t with n-1 degrees of freedom, keyed by n (scipy's, rounded)
T95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26, 11: 2.23, 12: 2.20,
       13: 2.18, 14: 2.16, 15: 2.14, 16: 2.13, 17: 2.12, 18: 2.11, 19: 2.10, 20: 2.09, 25: 2.06, 30: 2.05}


def t95(n: int) -> float:
    """The two-sided 95 % t quantile for a mean of ``n`` values (conservative between table entries)."""
    if n in T95:
        return T95[n]
    try:
        from scipy.stats import t

        return float(t.ppf(0.975, n - 1))
    except ImportError:  # the next smaller tabulated n is wider, hence conservative
        return T95[max(k for k in T95 if k <= n)] if n > 2 else T95[2]


def interval(xs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % t-interval of the mean of ``xs``."""
    n = len(xs)
    mean = statistics.fmean(xs)
    half = t95(n) * statistics.stdev(xs) / math.sqrt(n) if n > 1 else float("nan")
    return mean, mean - half, mean + half


def bootstrap_launches(errors: list[list[float]], stat, draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(value, low, high): ``stat`` of the plans' errors and its 95 % percentile-bootstrap interval over launches.

    ``errors[p][l]`` is plan ``p``'s error in launch ``l``. A launch (its own profile run and its own
    measurements) is the independent unit, so one bootstrap draw resamples *launches* with replacement and
    applies the same draw to every plan; each plan's error in a draw is the median over the drawn launches,
    and ``stat`` (e.g. the median or the max of the absolute errors) summarizes the plans. With 5 launches the
    interval is coarse -- it says how much the summary moves with the launches we happened to get.
    """
    import numpy as np

    e = np.asarray(errors, dtype=float)  # [plans, launches]
    value = float(stat(np.abs(np.median(e, axis=1))))
    if e.shape[1] < 2:
        return value, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, e.shape[1], size=(draws, e.shape[1]))  # [draws, launches]
    vals = [float(stat(np.abs(np.median(e[:, pick], axis=1)))) for pick in picks]
    lo, hi = np.percentile(vals, [2.5, 97.5])
    return value, float(lo), float(hi)


def launch_offsets(errors: list[list[float]]) -> tuple[list[float], list[list[float]]]:
    """(offsets, residuals) of per-launch relative errors ``errors[p][l]`` (plan ``p``, launch ``l``).

    A launch's profile run shifts every prediction of its world alike (it caught the machine in a fast or a slow
    spell that its speed reference did not see), so a launch's *offset* is the median error of its plans; a plan's
    *residual* in a launch is its error relative to the offset of the *other* plans of that launch,
    ``(1 + e[p][l]) / (1 + median_{q != p} e[q][l]) - 1`` -- leave-one-out, so no plan is judged against itself.
    The residuals say how well the model ranks and spaces the plans of one profile; the offsets say how far one
    profile run is from the steps measured after it. A diagnostic, not the accuracy claim: dividing by the
    other plans' error uses their measurements."""
    plans = len(errors)
    launches = len(errors[0]) if errors else 0
    if any(len(e) != launches for e in errors):
        raise ValueError(f"launches per plan: {[len(e) for e in errors]}; every plan needs the same count. "
                         "HINT: pass one error per launch for every plan.")
    offsets = [statistics.median(errors[p][l] for p in range(plans)) for l in range(launches)]
    if plans < 2:
        return offsets, [[0.0] * launches for _ in range(plans)]
    residuals = [[(1 + errors[p][l]) / (1 + statistics.median(errors[q][l] for q in range(plans) if q != p)) - 1
                  for l in range(launches)] for p in range(plans)]
    return offsets, residuals
