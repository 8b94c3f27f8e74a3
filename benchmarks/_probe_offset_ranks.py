"""Rank side of benchmarks/probe_offset.py: probes right before and right after each profile run, in one launch;
and probes between a plan's training steps next to probes seconds before and after that plan, with no model alive."""

from __future__ import annotations

import gc
import statistics

import torch

from costmodel_accuracy import CFG, SEQ
from costmodel_ranks import measure_plan, probe, profile_machine

SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 24)  # costmodel_accuracy.profile_world's collective sizes


def rounds(n: int, probes: int) -> list[tuple[float, list[float], list[float]]]:
    """Per round: the profile's interleaved speed reference (``profile_machine``'s ``interleaved_s``, the
    reference until 6565948), and ``probes`` probes taken right before and right after that profile run
    (seconds)."""
    torch.set_num_threads(1)
    out = []
    for _ in range(n):
        before = [probe(CFG, SEQ) for _ in range(probes)]
        ref = profile_machine(SIZES, 5, CFG, SEQ)["interleaved_s"]
        after = [probe(CFG, SEQ) for _ in range(probes)]
        out.append((ref, before, after))
    return out


def between_steps(plans: list[tuple[str, dict]], probes: int, warmup: int = 2, steps: int = 5
                  ) -> dict[str, list[float]]:
    """Per plan, three medians (seconds): ``probes`` probes with no model alive right before the plan is built,
    the probes between its training steps (as ``costmodel_ranks.measure_plan`` takes them for the accuracy
    benchmark: right before each measured step and after the last), and ``probes`` probes right after the plan is
    freed. The first and last are seconds apart from the middle one: a ratio away from 1 between them is what
    the probe picks up from running between training steps (the plan's tensors alive, the step just run), not
    drift."""
    torch.set_num_threads(1)
    out = {}
    for name, plan in plans:
        gc.collect()
        before = [probe(CFG, SEQ) for _ in range(probes)]
        r = measure_plan(plan, CFG, SEQ, warmup, steps, track_memory=False)
        gc.collect()
        after = [probe(CFG, SEQ) for _ in range(probes)]
        between = r["probes"] + r["probes_after"][-1:]
        out[name] = [statistics.median(before), statistics.median(between), statistics.median(after)]
    return out
