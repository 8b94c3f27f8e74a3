"""The routing trace shipped under benchmarks/ and its scaling (benchmarks/traces.py): pure numpy."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from traces import _dirichlet_multinomial, load_trace, rank_tokens, scale_trace  # noqa: E402


def test_recorded_trace_is_consistent() -> None:
    t = load_trace()
    assert t.counts.shape == (t.steps, len(t.layers), t.samples, t.experts) == (300, 4, 32, 8)
    # every sample routes each of its tokens to top_k distinct experts
    assert np.all(t.counts.sum(-1) == t.tokens_per_sample * t.top_k)
    assert np.all(t.counts <= t.tokens_per_sample)
    load = t.expert_load()
    assert (load.max(-1) / load.mean(-1)).max() > 1.5  # the corpus trace is skewed somewhere


def test_scale_trace_keeps_parent_totals() -> None:
    t = load_trace()
    sc = scale_trace(t, 16, 4, 64, steps=[0, 150], layers=[1, 3], seed=3)
    assert sc.counts.shape == (2, 2, 64, 64) and sc.layers == (t.layers[1], t.layers[3])
    assert np.all(sc.counts.sum(-1) == t.tokens_per_sample * t.top_k)
    parents = sc.counts.reshape(2, 2, 64, 8, 8).sum(-1)  # children e*8..e*8+7 add back to recorded expert e
    for i, step in enumerate((0, 150)):
        recorded = {tuple(row) for row in t.counts[step, [1, 3]].transpose(1, 0, 2).reshape(t.samples, -1)}
        drawn = parents[i].transpose(1, 0, 2).reshape(64, -1)  # a sample's two layers come from one recording
        assert all(tuple(row) in recorded for row in drawn)
    merged = scale_trace(t, 8, 4, 4, steps=[7], seed=0)  # fewer experts: exact merges of pairs
    assert np.all(merged.counts.sum(-1) == t.tokens_per_sample * t.top_k)
    assert rank_tokens(sc.counts[0, 0], 16).shape == (64, 16)
    with pytest.raises(ValueError, match="HINT:"):
        scale_trace(t, 4, 4, 12)


def test_dirichlet_multinomial_concentration() -> None:
    """Small alpha keeps a cell's tokens on one child, large alpha spreads them (mean share 1/g)."""
    rng = np.random.default_rng(0)
    n = np.full(4000, 16)
    tight = _dirichlet_multinomial(rng, n, 8, 0.01)
    loose = _dirichlet_multinomial(rng, n, 8, 100.0)
    assert np.all(tight.sum(1) == 16) and np.all(loose.sum(1) == 16)
    # Polya urn: all 16 tokens on one child with probability prod_{i=1..15} (alpha + i) / (g alpha + i)
    exact = float(np.prod([(0.01 + i) / (0.08 + i) for i in range(1, 16)]))  # 0.79
    assert (tight.max(1) == 16).mean() == pytest.approx(exact, abs=0.035)  # 5 sigma of 4000 draws
    assert loose.max(1).mean() < 6
    assert loose.mean(0) == pytest.approx(np.full(8, 2.0), rel=0.05)
