"""Confidence intervals for benchmark tables (a few repeats on a noisy machine: Student's t, not a normal)."""

from __future__ import annotations

import math
import statistics

T95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}  # two-sided, n-1 dof


def interval(xs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % t-interval of the mean of ``xs``."""
    n = len(xs)
    mean = statistics.fmean(xs)
    half = T95.get(n, 1.96) * statistics.stdev(xs) / math.sqrt(n) if n > 1 else float("nan")
    return mean, mean - half, mean + half
