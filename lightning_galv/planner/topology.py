"""Ranks grouped into nodes, and what an all-to-all costs on them (pure: numpy, no torch).

The MoE callbacks of issue 12 reason about *where* bytes travel: an all-to-all whose traffic stays inside a
node rides NVLink-class links, one that crosses nodes rides the NIC, an order of magnitude slower (Galvatron's
A100 profile: ~150 GB/s vs ~8 GB/s per GPU pair). :class:`Topology` is the one place that says which rank
sits on which node, splits a ``[src, dst]`` byte matrix into intra- and inter-node bytes, and predicts the
all-to-all time from a :class:`~lightning_galv.planner.profiles.HardwareProfile`.

Rank ``r`` lives on node ``r // gpus_per_node``: the layout torchrun and SLURM give (consecutive local ranks).
On one CPU machine ``gpus_per_node=4`` with 8 ranks *simulates* 2 nodes x 4: nothing is slower, but every byte
is counted as if it were.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..errors import bad_value
from .profiles import HardwareProfile

__all__ = ["Topology", "resolve_bandwidths"]


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 1:
        raise bad_value(f"{name}={v!r}", "must be a positive int", f"e.g. {name}=8.")
    return int(v)


@dataclass(frozen=True)
class Topology:
    """``ranks`` processes, ``gpus_per_node`` consecutive ranks per node.

    Valid when ``gpus_per_node`` divides ``ranks`` (full nodes) or ``ranks <= gpus_per_node`` (one node,
    possibly not full: 4 CPU ranks with the default ``gpus_per_node=8`` are one node).
    """

    ranks: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        _positive_int("ranks", self.ranks)
        _positive_int("gpus_per_node", self.gpus_per_node)
        object.__setattr__(self, "ranks", int(self.ranks))
        object.__setattr__(self, "gpus_per_node", int(self.gpus_per_node))
        if self.ranks > self.gpus_per_node and self.ranks % self.gpus_per_node:
            raise bad_value(f"ranks={self.ranks}, gpus_per_node={self.gpus_per_node}",
                            "gpus_per_node must divide ranks (nodes are full) or be >= ranks (one node)",
                            f"use a divisor of {self.ranks} such as "
                            f"{max(d for d in range(1, self.gpus_per_node + 1) if self.ranks % d == 0)}.")

    # -- structure ------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return max(1, self.ranks // self.gpus_per_node)

    @property
    def ranks_per_node(self) -> int:
        """Ranks actually on each node (``ranks`` when they all fit in one node)."""
        return min(self.ranks, self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.ranks:
            raise bad_value(f"rank={rank!r}", f"must be an int in 0..{self.ranks - 1}", "pass a rank of this topology.")
        return int(rank) // self.gpus_per_node

    def node_array(self) -> np.ndarray:
        """``[ranks]`` node id of every rank (vectorized :meth:`node_of`)."""
        return np.arange(self.ranks) // self.gpus_per_node

    def same_node(self) -> np.ndarray:
        """``[ranks, ranks]`` bool: ranks i and j share a node."""
        n = self.node_array()
        return n[:, None] == n[None, :]

    # -- bytes and time -------------------------------------------------------------------------------
    def _check_matrix(self, matrix: np.ndarray) -> np.ndarray:
        m = np.asarray(matrix, dtype=np.float64)
        if m.shape != (self.ranks, self.ranks):
            raise bad_value(f"matrix shape {m.shape}", f"must be [src, dst] = ({self.ranks}, {self.ranks})",
                            "pass one row and one column per rank of the topology.")
        if not np.all(np.isfinite(m)) or np.any(m < 0):
            raise bad_value("matrix", "byte counts must be finite and >= 0", "check the routing counts.")
        return m

    def split_bytes(self, matrix: np.ndarray) -> tuple[float, float]:
        """(intra-node, inter-node) bytes of a ``[src, dst]`` byte matrix; the diagonal (a rank's tokens for
        its own experts) moves no byte and counts in neither."""
        m = self._check_matrix(matrix)
        same = self.same_node()
        off = ~np.eye(self.ranks, dtype=bool)
        return float(m[same & off].sum()), float(m[~same].sum())

    def per_rank_bytes(self, matrix: np.ndarray) -> dict[str, np.ndarray]:
        """Per rank ``[ranks]``: bytes sent / received inside its node and across nodes (diagonal excluded)."""
        m = self._check_matrix(matrix).copy()
        np.fill_diagonal(m, 0.0)
        same = self.same_node()
        intra, inter = np.where(same, m, 0.0), np.where(same, 0.0, m)
        return {"send_intra": intra.sum(1), "recv_intra": intra.sum(0),
                "send_inter": inter.sum(1), "recv_inter": inter.sum(0)}

    def a2a_time(self, matrix: np.ndarray, hw: HardwareProfile | None, intra_bw: float | None = None,
                 inter_bw: float | None = None) -> float:
        """Predicted seconds of one all-to-all moving ``matrix[src, dst]`` bytes.

        Model (bandwidth only, no per-message latency): every rank sends and receives at the same time over
        full-duplex links, so its intra-node part takes ``max(sent, received) / intra_bw`` and its inter-node
        part ``max(sent, received) / inter_bw``; the two parts are *added* (a conservative choice: NCCL posts
        both kinds of send together, but the NIC path also crosses the node's PCIe/NVLink fabric, and with a
        ~20x bandwidth gap the inter-node part dominates either way). The collective ends when the slowest
        rank ends: the max over ranks. Bandwidths are per rank (per GPU), see :func:`resolve_bandwidths`.
        """
        bi, bx = resolve_bandwidths(hw, self, intra_bw, inter_bw)
        p = self.per_rank_bytes(matrix)
        t = np.maximum(p["send_intra"], p["recv_intra"]) / bi + np.maximum(p["send_inter"], p["recv_inter"]) / bx
        return float(t.max()) if t.size else 0.0

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, ranks: int, gpus_per_node: int | None = None,
                 env: Mapping[str, str] | None = None) -> "Topology":
        """``gpus_per_node`` when given, else ``LOCAL_WORLD_SIZE`` (torchrun, Lightning), else
        ``SLURM_NTASKS_PER_NODE`` (``"4"`` or ``"4(x2)"``), else one node holding every rank."""
        if gpus_per_node is not None:
            return cls(ranks, gpus_per_node)
        env = os.environ if env is None else env
        for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
            raw = env.get(key)
            if raw:
                mt = re.match(r"\s*(\d+)", raw)
                if not mt or int(mt.group(1)) < 1:
                    raise bad_value(f"{key}={raw!r}", "must start with a positive integer",
                                    "fix the launcher environment or pass gpus_per_node explicitly.")
                return cls(ranks, int(mt.group(1)))
        return cls(ranks, _positive_int("ranks", ranks))


def resolve_bandwidths(hw: HardwareProfile | None, topo: Topology, intra_bw: float | None = None,
                       inter_bw: float | None = None) -> tuple[float, float]:
    """(intra, inter) per-rank bytes/s for all-to-all traffic.

    Explicit values win. Otherwise, from ``hw``: the point-to-point fit of that locality (a rank's traffic
    to one peer is a p2p stream), else the profile's all-to-all fit for a group of the node's size (its
    bandwidth is per-rank off-rank bytes per second, the same unit), else all-reduce's. A profile with only
    an inter-node p2p fit (Galvatron's 2-node files) thus takes its intra-node figure from the all-to-all
    measured inside one node.
    """
    def pick(local: bool) -> float:
        assert hw is not None
        fit = hw.p2p.get("intra" if local else "inter")
        if fit is None:
            size = topo.ranks_per_node if local else max(2, topo.ranks)
            fit = hw.link("alltoall", size, True, local)
        return float(fit.bandwidth)

    out = []
    for name, given, local in (("intra_bw", intra_bw, True), ("inter_bw", inter_bw, False)):
        if given is None:
            if hw is None:
                raise bad_value(f"{name}=None", "needs a HardwareProfile or an explicit bandwidth",
                                f"pass hw=... or {name}=<bytes/s>.")
            given = pick(local)
        if not (isinstance(given, (int, float)) and np.isfinite(given) and given > 0):
            raise bad_value(f"{name}={given!r}", "must be a positive finite bytes/s", "e.g. 150e9 intra, 8e9 inter.")
        out.append(float(given))
    return out[0], out[1]
