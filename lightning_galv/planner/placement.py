"""Dynamic sample placement for MoE all-to-alls (after NetMoE), as a pure assignment problem.

Why samples may move: which data-parallel rank processes which sample does not change the gradient sum (with
a loss normalized by the global token count, dropless routing and aux losses from globally reduced counts),
so before an all-to-all we are free to choose the rank each sample lives on. Its tokens must reach the
ranks of the experts they were routed to wherever it lives; living on the node that holds most of those
experts keeps those bytes off the slow inter-node links.

Formulation
===========
NetMoE (Liu et al., "NetMoE: Accelerating MoE Training through Dynamic Sample Placement", ICLR 2025) states
the placement of a batch's samples over the devices as an integer program whose objective is the all-to-all
communication, solves it in polynomial time with the Kuhn-Munkres (Hungarian) algorithm, and solves it in
two stages: samples to nodes against the inter-node traffic first, then, within each node, samples to
devices against the intra-node traffic. That much follows the paper's published summary. Here, with
``tokens[s, r]`` the assignments of sample ``s`` whose expert lives on rank ``r`` (the static EP layout gives
it from the router's top-k choices), ``b`` bytes per token row and ``rho[s]`` the residual tokens of sample
``s``:

* stage 1, samples -> nodes, every node receiving ``S / num_nodes`` samples::

      cost1[s, n] = b * (sum_{r not on n} tokens[s, r] + rho[s] * [n != node(current[s])])

  an assignment problem on the ``S x S`` matrix whose columns are the node *slots* (each node's column
  repeated ``S / num_nodes`` times), solved by ``scipy.optimize.linear_sum_assignment``;
* stage 2, per node n, its samples -> its ranks, every rank receiving ``S / ranks`` samples::

      cost2[s, d] = b * (sum_{r on n, r != d} tokens[s, r] + rho[s] * [d != current[s], node(current[s]) == n])

  one ``(S/N) x (S/N)`` assignment per node.

Our own choices (not taken from the paper, which this module's author could not consult offline):

* **Cost of moving a sample.** A sample that changes rank drags its residual stream along (the hidden
  state the MoE output is added to): ``rho[s]`` token rows, charged where they cross (inter-node in stage 1,
  intra-node in stage 2) and counted in the ``*_after`` bytes. ``residual_tokens=None`` treats moves as free
  (the runtime piggybacks them on a combine all-to-all that already carries the sample's rows).
* **One direction.** Bytes are those of one dispatch all-to-all (sample's rank -> expert ranks); the combine
  moves the same rows back, so both halves scale alike and the argmin is the same.
* **Exact balance.** Every rank ends with exactly ``S / ranks`` samples (the paper balances computation; an
  equal sample count keeps every rank's micro-batch shape and the data loader's contract).
* **Deterministic ties.** Every rank solves the same problem on its own and must get the same answer, so
  nothing random or order-unstable enters: among placements of equal byte cost we prefer samples staying
  where they are (an exact lexicographic term: integer costs plus ``[moved] / (S + 1)``, whose sum over
  all samples stays below one byte-count unit), then scipy's solver, a pure function of the matrix, picks
  among the rest with samples and slots in index order.
* **Speed.** Stage 2 is ``num_nodes`` independent ``(S/N) x (S/N)`` matrices, cheap. Stage 1 is still an
  ``S x S`` matrix (``num_nodes`` distinct columns, repeated): on the 64-device traces with free moves it takes
  2.5-3 ms (shipped-corpus and mixed-domain traces) against ~4.5 ms for one dense ``S x S`` solve of the
  combined objective (benchmarks/moe_placement.py), so the two stages are cheaper but not by an order of
  magnitude: scipy's shortest-augmenting-path solver augments once per row over all ``S`` columns whatever
  their repetition (with moves charged most samples stay home and it takes ~0.6 ms). At 1024 devices (4096 samples, 128 nodes) stage 1 takes ~1.3 s: fine for a
  benchmark, too slow per step; a transportation solver over the ``S x N`` matrix would be the next step.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..errors import bad_value
from .topology import Topology

__all__ = ["PlacementResult", "PlacementPolicy", "NetMoEPlacement", "solve_placement", "placement_bytes",
           "traffic_matrix"]


@dataclass(frozen=True)
class PlacementResult:
    """Where every sample goes, and the bytes of the all-to-all before and after (``new_rank`` is read-only).

    ``*_before``: samples on ``current``, nothing moves. ``*_after``: samples on ``new_rank``, plus the
    residual rows of the samples that moved (see :func:`placement_bytes`)."""

    new_rank: np.ndarray  # [S] int64
    inter_before: float
    inter_after: float
    intra_before: float
    intra_after: float
    solve_seconds: float  # wall time of the two stages (cost matrices + solver), not validation / accounting


def _counts(name: str, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    arr = np.asarray(a)
    if arr.shape != shape:
        raise bad_value(f"{name} shape {arr.shape}", f"must be {shape}", f"give {name} one entry per sample"
                        + (" and rank" if len(shape) == 2 else "") + ".")
    if arr.size and (not np.all(np.isfinite(arr)) or np.any(arr < 0) or np.any(arr != np.round(arr))):
        raise bad_value(name, "must hold non-negative integer counts (token assignments)",
                        "pass counts of token rows, and bytes per row as token_bytes.")
    return arr.astype(np.int64)


def _validate(tokens: np.ndarray, current: np.ndarray, topo: Topology, residual_tokens: np.ndarray | None,
              token_bytes: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not isinstance(topo, Topology):
        raise bad_value(f"topo={topo!r}", "must be a Topology", "build one with Topology(ranks, gpus_per_node).")
    t = np.asarray(tokens)
    if t.ndim != 2:
        raise bad_value(f"tokens shape {t.shape}", "must be 2-D [samples, ranks]",
                        "sum each sample's expert counts per rank holding the expert.")
    s = t.shape[0]
    tok = _counts("tokens", t, (s, topo.ranks))
    if s == 0 or s % topo.ranks:
        raise bad_value(f"{s} samples", f"must be a positive multiple of ranks={topo.ranks} (every rank holds the "
                        "same number of samples before and after)", "pass the whole global batch of the group.")
    cur = np.asarray(current)
    if cur.shape != (s,) or not np.issubdtype(cur.dtype, np.integer) or np.any(cur < 0) or np.any(cur >= topo.ranks):
        raise bad_value(f"current={cur.tolist() if cur.size <= 16 else cur.shape}",
                        f"must be [{s}] ints in 0..{topo.ranks - 1}", "give the rank holding each sample now.")
    if np.any(np.bincount(cur, minlength=topo.ranks) != s // topo.ranks):
        raise bad_value("current", f"every rank must hold {s // topo.ranks} samples now",
                        "placement keeps ranks balanced; start from the data loader's even split.")
    res = np.zeros(s, np.int64) if residual_tokens is None else _counts("residual_tokens", residual_tokens, (s,))
    if isinstance(token_bytes, bool) or not (np.isfinite(token_bytes) and token_bytes > 0):
        raise bad_value(f"token_bytes={token_bytes!r}", "must be a positive finite number",
                        "bytes of one token row, e.g. hidden * 2 for bf16.")
    return tok, cur.astype(np.int64), res


def placement_bytes(tokens: np.ndarray, placement: np.ndarray, topo: Topology, *,
                    current: np.ndarray | None = None, residual_tokens: np.ndarray | None = None,
                    token_bytes: float = 1.0) -> tuple[float, float]:
    """(intra-node, inter-node) bytes of the all-to-all with sample ``s`` on rank ``placement[s]``, plus the
    residual rows of samples with ``placement[s] != current[s]`` (when both ``current`` and
    ``residual_tokens`` are given). Equals ``topo.split_bytes(traffic_matrix(...))``."""
    return topo.split_bytes(traffic_matrix(tokens, placement, topo, current=current,
                                           residual_tokens=residual_tokens, token_bytes=token_bytes))


def traffic_matrix(tokens: np.ndarray, placement: np.ndarray, topo: Topology, *, current: np.ndarray | None = None,
                   residual_tokens: np.ndarray | None = None, token_bytes: float = 1.0) -> np.ndarray:
    """``[src, dst]`` bytes: sample ``s``'s rows from ``placement[s]`` to each expert rank, and its residual
    from ``current[s]`` to ``placement[s]`` when it moved (``residual_tokens`` given)."""
    tok = np.asarray(tokens, dtype=np.float64)
    p = np.asarray(placement, dtype=np.int64)
    m = np.zeros((topo.ranks, topo.ranks))
    np.add.at(m, p, tok)  # row p[s] += tokens[s, :]
    if residual_tokens is not None and current is not None:
        cur = np.asarray(current, dtype=np.int64)
        moved = cur != p
        np.add.at(m, (cur[moved], p[moved]), np.asarray(residual_tokens, dtype=np.float64)[moved])
    return m * float(token_bytes)


def solve_placement(tokens: np.ndarray, current: np.ndarray, topo: Topology, *,
                    residual_tokens: np.ndarray | None = None, token_bytes: float = 1.0) -> PlacementResult:
    """Two-stage (inter-node, then intra-node) optimal sample placement; see the module docstring.

    ``tokens[s, r]``: assignments of sample ``s`` whose expert lives on rank ``r``; ``current[s]``: the rank
    holding ``s`` now; ``residual_tokens[s]``: rows that move with ``s`` if it changes rank. Returns the new
    rank of every sample (each rank again holds ``S / ranks``) and the bytes before / after.
    """
    tok, cur, res = _validate(tokens, current, topo, residual_tokens, token_bytes)
    t0 = time.perf_counter()
    s, k, g = tok.shape[0], topo.ranks, topo.ranks_per_node
    nn_ = topo.num_nodes
    per_rank = s // k
    tie = 1.0 / (s + 1)  # lexicographic "stay put" term: sums to < 1 over all samples, costs are integers
    node_tok = tok.reshape(s, nn_, g).sum(axis=2)  # [S, N] assignments per node
    home_node = cur // g  # [S]

    # stage 1: samples -> nodes (inter-node rows), N identical slot columns per node
    if nn_ > 1:
        away = np.arange(nn_)[None, :] != home_node[:, None]  # [S, N]
        c1 = (tok.sum(1)[:, None] - node_tok) + res[:, None] * away + tie * away
        per_node = s // nn_
        _, col = linear_sum_assignment(np.repeat(c1, per_node, axis=1))  # rows come back as 0..S-1
        node = col // per_node
    else:
        node = np.zeros(s, np.int64)

    # stage 2: within each node, its samples -> its ranks (intra-node rows)
    new_rank = np.empty(s, np.int64)
    local = np.arange(g)
    for n in range(nn_):
        idx = np.flatnonzero(node == n)  # ascending sample ids: a deterministic row order
        if idx.size == 0:
            continue
        lt = tok[idx, n * g:(n + 1) * g]  # [m, g] rows to this node's ranks
        ranks = n * g + local
        moved = ranks[None, :] != cur[idx, None]  # [m, g]
        from_here = (home_node[idx] == n)[:, None]
        c2 = (lt.sum(1)[:, None] - lt) + res[idx, None] * (moved & from_here) + tie * moved
        _, col = linear_sum_assignment(np.repeat(c2, per_rank, axis=1))
        new_rank[idx] = n * g + col // per_rank
    seconds = time.perf_counter() - t0

    intra_b, inter_b = placement_bytes(tok, cur, topo, token_bytes=token_bytes)
    intra_a, inter_a = placement_bytes(tok, new_rank, topo, current=cur, residual_tokens=res,
                                       token_bytes=token_bytes)
    new_rank.setflags(write=False)
    return PlacementResult(new_rank, inter_b, inter_a, intra_b, intra_a, seconds)


class PlacementPolicy(ABC):
    """Decides where each sample of an expert-parallel group lives next (the replaceable part of sample
    placement; the runtime, ``parallel/sample_placement.py``, executes any answer exactly).

    ``place`` must be a pure function of its inputs: every rank of the group calls it on the same numbers and
    must get the same answer, and an activation-checkpoint recompute calls it again."""

    @abstractmethod
    def place(self, tokens: np.ndarray, current: np.ndarray, topo: Topology,
              residual_tokens: np.ndarray | None = None) -> np.ndarray:
        """New rank of every sample ``[S]`` (each rank keeps ``S / ranks``); see :func:`solve_placement`."""


class NetMoEPlacement(PlacementPolicy):
    """The default: :func:`solve_placement` (NetMoE's two-stage assignment, inter-node first)."""

    def place(self, tokens: np.ndarray, current: np.ndarray, topo: Topology,
              residual_tokens: np.ndarray | None = None) -> np.ndarray:
        return solve_placement(tokens, current, topo, residual_tokens=residual_tokens).new_rank
