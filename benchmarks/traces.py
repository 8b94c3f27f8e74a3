"""Routing traces for the MoE planner benchmarks: load the recorded one, scale it to more devices.

``load_trace()`` reads ``benchmarks/traces/corpus_moe.npz`` (written by ``record_traces.py``: the MoE reference
trained on the shipped corpus, tokens per (step, MoE layer, sample, expert)); ``load_trace(path)`` any other
recording, e.g. ``traces/mixed_moe.npz`` (the mixed-domain corpus of ``mixed_corpus.py``). ``scale_trace`` turns it into a
trace for ``devices x samples_per_device`` samples and ``experts`` experts, e.g. 64 devices x 4 samples with
64 experts, or 1024 x 4 with 1024, for the planners' large-scale numbers.

How the scaling keeps the recorded skew (and where it has to invent):

* **Samples** are drawn with replacement from the *same step's* recorded samples (a seeded generator), one
  draw per new sample, shared by all layers of the step. So every new sample is a real recorded routing:
  the distribution of per-sample routings, the step's expert-load proportions (in expectation) and the
  correlation of one sample's routing across layers are those of the recording.
* **Experts.** With ``experts = g * E`` (g >= 1) each recorded expert ``e`` becomes the ``g`` experts
  ``e*g .. e*g+g-1`` ("children"). A drawn sample's count for ``e`` is split over the children by a
  multinomial whose probabilities are drawn per (sample, layer, parent) from a symmetric Dirichlet with
  concentration ``alpha``. The parent totals are kept exactly, so the skew *between* recorded experts is
  preserved (a hot expert's children are all hot); within a parent the children are balanced in
  expectation. ``alpha`` is our assumption about how a sample's tokens for one coarse expert would spread
  over finer ones: small alpha (e.g. 0.1) keeps them on one child (the sample's concentration survives),
  large alpha spreads them evenly. No recording can tell which is right for a model we did not train; the
  default ``alpha=1.0`` (a uniformly random split) is neutral, and the benchmarks state it.
  With ``experts = E / g`` recorded experts are merged in consecutive groups of ``g`` (exact, no invention).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = HERE / "traces" / "corpus_moe.npz"


@dataclass(frozen=True)
class Trace:
    """``counts[step, layer, sample, expert]``: assignments (token x top-k choice) of each sample per expert."""

    counts: np.ndarray
    layers: tuple[int, ...]
    top_k: int
    tokens_per_sample: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return self.counts.shape[0]

    @property
    def samples(self) -> int:
        return self.counts.shape[2]

    @property
    def experts(self) -> int:
        return self.counts.shape[3]

    def expert_load(self) -> np.ndarray:
        """``[step, layer, expert]`` assignments per expert over the step's samples."""
        return self.counts.sum(axis=2)


def load_trace(path: str | Path = DEFAULT_TRACE) -> Trace:
    with np.load(path) as d:
        meta = json.loads(str(d["meta"]))
        counts = d["counts"].astype(np.int64)
        layers = tuple(int(x) for x in d["layers"])
    return Trace(counts, layers, int(meta["top_k"]), int(meta["seq"]), meta)


def rank_tokens(counts: np.ndarray, ranks: int) -> np.ndarray:
    """``[..., samples, experts]`` -> ``[..., samples, ranks]`` under plain EP (rank r holds experts
    ``[r E/ranks, (r+1) E/ranks)``): what the sample-placement solver takes as ``tokens``."""
    e = counts.shape[-1]
    if e % ranks:
        raise ValueError(f"{e} experts over {ranks} ranks: plain EP needs ranks to divide the experts. HINT: pick "
                         "experts as a multiple of the devices.")
    return counts.reshape(*counts.shape[:-1], ranks, e // ranks).sum(-1)


def scale_trace(trace: Trace, devices: int, samples_per_device: int, experts: int, *, alpha: float = 1.0,
                steps: Sequence[int] | None = None, layers: Sequence[int] | None = None, seed: int = 0) -> Trace:
    """A trace of ``devices * samples_per_device`` samples over ``experts`` experts (see the module
    docstring for how skew is kept). ``steps`` / ``layers`` pick recorded steps and MoE-layer positions
    (default: all): at 1024 devices one (step, layer) is already a 4096 x 1024 matrix."""
    if devices < 1 or samples_per_device < 1 or experts < 1:
        raise ValueError(f"devices={devices}, samples_per_device={samples_per_device}, experts={experts}: must be "
                         ">= 1. HINT: e.g. scale_trace(trace, 64, 4, 64).")
    e = trace.experts
    if experts % e and e % experts:
        raise ValueError(f"experts={experts}: must be a multiple or a divisor of the recorded {e}. HINT: use e.g. "
                         f"{e * max(1, experts // e)}.")
    if not alpha > 0:
        raise ValueError(f"alpha={alpha}: must be > 0. HINT: 1.0 splits a sample's tokens uniformly at random.")
    sel = np.arange(trace.steps) if steps is None else np.asarray(list(steps), dtype=np.int64)
    lay = np.arange(len(trace.layers)) if layers is None else np.asarray(list(layers), dtype=np.int64)
    rng = np.random.default_rng(seed)
    n = devices * samples_per_device
    draws = rng.integers(0, trace.samples, size=(sel.size, n))  # [steps', n], one draw per sample and step
    base = trace.counts[:, lay][sel[:, None], :, draws]  # [steps', n, layers', E]
    base = np.moveaxis(base, 2, 1)  # [steps', layers', n, E]
    if experts <= e:
        g = e // experts
        out = base.reshape(*base.shape[:-1], experts, g).sum(-1)
    else:
        g = experts // e
        out = _dirichlet_multinomial(rng, base.reshape(-1), g, alpha).reshape(*base.shape[:-1], experts)
    meta = dict(trace.meta, scaled=dict(devices=devices, samples_per_device=samples_per_device, experts=experts,
                                        alpha=alpha, seed=seed, steps=sel.tolist(), layers=lay.tolist()))
    return Trace(out.astype(np.int32), tuple(trace.layers[i] for i in lay), trace.top_k, trace.tokens_per_sample,
                 meta)


def _dirichlet_multinomial(rng: np.random.Generator, n: np.ndarray, g: int, alpha: float) -> np.ndarray:
    """``[cells, g]``: ``n[i]`` tokens split over ``g`` children with probabilities ~ Dirichlet(alpha, ..., alpha),
    drawn as a Polya urn (token i joins child j with probability (alpha + n_j) / (g alpha + i)): exact, and
    memory proportional to the tokens, not to cells x g probabilities."""
    cells, most = n.size, int(n.max()) if n.size else 0
    child = np.zeros((cells, max(most, 1)), np.int64)
    for i in range(most):
        live = np.flatnonzero(n > i)
        copy = rng.random(live.size) < i / (g * alpha + i)  # reuse an earlier token's child, else a fresh draw
        pick = np.where(copy, child[live, rng.integers(0, max(i, 1), size=live.size)],
                        rng.integers(0, g, size=live.size))
        child[live, i] = pick
    valid = np.arange(child.shape[1])[None, :] < n[:, None]
    flat = (np.arange(cells)[:, None] * g + child)[valid]
    return np.bincount(flat, minlength=cells * g).reshape(cells, g)
