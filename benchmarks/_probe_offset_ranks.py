"""Rank side of benchmarks/probe_offset.py: probes right before and right after each profile run, in one launch."""

from __future__ import annotations

import torch

from costmodel_accuracy import CFG, SEQ
from costmodel_ranks import probe, profile_machine

SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 24)  # costmodel_accuracy.profile_world's collective sizes


def rounds(n: int, probes: int) -> list[tuple[float, list[float], list[float]]]:
    """Per round: the profile's speed reference (``profile_machine``'s ``interleaved_s``, the reference until 6565948), and ``probes`` probes taken
    right before and right after that profile run (seconds)."""
    torch.set_num_threads(1)
    out = []
    for _ in range(n):
        before = [probe(CFG, SEQ) for _ in range(probes)]
        ref = profile_machine(SIZES, 5, CFG, SEQ)["interleaved_s"]
        after = [probe(CFG, SEQ) for _ in range(probes)]
        out.append((ref, before, after))
    return out
