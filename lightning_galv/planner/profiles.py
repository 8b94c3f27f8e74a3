"""Hardware and model profiles as plain, frozen data.

The cost model never measures anything: it reads a :class:`HardwareProfile` (how fast collectives
and point-to-point transfers are on this cluster) and a :class:`ModelProfile` (how long each layer
type takes and how much memory it needs). Keeping them as data means they can be produced by the
profilers in :mod:`lightning_galv.profiling`, imported from Galvatron's JSON files
(:mod:`lightning_galv.compat.galvatron`), derived analytically from a :class:`~lightning_galv.plan.ModelShape`,
saved, fingerprinted and cached -- all without torch.

Units: seconds, bytes, bytes/second, samples. Bandwidths are *bus* bandwidths (the NCCL-tests
convention), so a ring all-reduce of ``n`` bytes over ``g`` ranks takes ``2 (g-1)/g * n / bw``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..errors import bad_value
from ..plan import ModelShape

COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall")
PRECISIONS = ("bf16", "fp16", "fp32")


# ---------------------------------------------------------------------------------------------------
# hardware
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkFit:
    """``time(bytes) = latency_s + volume(bytes) / bandwidth`` for one collective on one kind of group.

    ``volume`` is the per-rank traffic of the algorithm (2(g-1)/g n for all-reduce, (g-1)/g n for
    all-gather / reduce-scatter / all-to-all, n for p2p): a latency-bandwidth (alpha-beta) model.
    """

    bandwidth: float  # bytes / s (bus bandwidth)
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise bad_value(f"bandwidth={self.bandwidth}", "must be a positive finite number of bytes/s",
                            "a profile with bandwidth 0 would make every plan infinitely slow; re-profile.")
        if self.latency_s < 0:
            raise bad_value(f"latency_s={self.latency_s}", "must be >= 0", "use 0 when unknown.")

    def time(self, volume_bytes: float) -> float:
        return self.latency_s + volume_bytes / self.bandwidth if volume_bytes > 0 else 0.0

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> "LinkFit":
        """Alpha-beta fit of ``(volume_bytes, seconds)`` points minimizing *relative* error (latency >= 0).

        Relative, because plain least squares lets the largest message decide everything and leaves the
        latency (what small messages cost) as noise; sizes spanning 64 KiB..16 MiB matter equally here.
        """
        if len(points) < 2:
            raise bad_value(points, "need at least 2 (bytes, seconds) points to fit a link", "measure >= 2 sizes.")
        # minimize sum ((a + x*k - y) / y)^2: weighted normal equations with w = 1/y^2
        w = [1.0 / (y * y) if y > 0 else 0.0 for _, y in points]
        s1 = sum(w)
        sx = sum(wi * x for wi, (x, _) in zip(w, points))
        sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
        sy = sum(wi * y for wi, (_, y) in zip(w, points))
        sxy = sum(wi * x * y for wi, (x, y) in zip(w, points))
        det = s1 * sxx - sx * sx
        k = (s1 * sxy - sx * sy) / det if det > 0 else 0.0
        a = (sy - k * sx) / s1 if s1 > 0 else 0.0
        if a < 0 or k <= 0:  # through the origin (pure bandwidth), still relative
            k = sxy / sxx if sxx > 0 else 0.0
            a = 0.0
        if k <= 0:
            k = max(y for _, y in points) / max(x for x, _ in points)
        return cls(bandwidth=1.0 / k, latency_s=a)


def link_key(op: str, size: int, consecutive: bool, intra_node: bool) -> str:
    """Canonical key of a collective measurement, e.g. ``allreduce/8/consec/intra``."""
    return f"{op}/{size}/{'consec' if consecutive else 'strided'}/{'intra' if intra_node else 'inter'}"


def _parse_link_key(key: str) -> tuple[str, int, bool, bool]:
    try:
        op, size, consec, where = key.split("/")
        if op not in COLLECTIVES or consec not in ("consec", "strided") or where not in ("intra", "inter"):
            raise ValueError
        return op, int(size), consec == "consec", where == "intra"
    except ValueError:
        raise bad_value(key, "collective key must look like 'allreduce/8/consec/intra'",
                        f"op in {COLLECTIVES}, then group size, consec|strided, intra|inter.") from None


@dataclass(frozen=True)
class HardwareProfile:
    """Communication and memory facts of one cluster shape (``num_nodes x gpus_per_node``)."""

    num_nodes: int
    gpus_per_node: int
    device_memory_bytes: float
    links: Mapping[str, LinkFit]  # link_key(...) -> fit
    p2p: Mapping[str, LinkFit] = field(default_factory=dict)  # "intra" / "inter" -> fit
    overlap_slowdown: float = 1.0  # compute and communication each run this much slower while overlapped
    memory_bandwidth: float = 0.0  # device memory bytes/s, prices the optimizer step (0 = ignore)
    name: str = "custom"
    # whether the runtime's FSDP/ZeRO collectives can run concurrently with compute: on GPUs they go on
    # their own CUDA stream; on CPU (gloo) FSDP2 issues them synchronously, so they add to compute time
    async_collectives: bool = True
    # as ``overlap_slowdown``, for an all-gather beside compute (FSDP2's prefetched parameter gathers); 0 = not
    # measured: the all-reduce's. Why its own: an all-gather only moves bytes where an all-reduce also sums
    # them, so on a CPU whose cores the collective's thread shares with compute the two overlap differently
    gather_overlap_slowdown: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.gather_overlap_slowdown, bool) or \
                not isinstance(self.gather_overlap_slowdown, (int, float)) or \
                not (self.gather_overlap_slowdown == 0.0 or 1.0 <= self.gather_overlap_slowdown < math.inf):
            raise bad_value(f"gather_overlap_slowdown={self.gather_overlap_slowdown!r}", "must be 0 (not measured: "
                            "overlap_slowdown is used) or a finite number >= 1", "use 1.0 for perfect overlap.")
        for attr in ("num_nodes", "gpus_per_node"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad_value(f"{attr}={v}", "must be a positive int", "e.g. num_nodes=2, gpus_per_node=8.")
        if not self.device_memory_bytes > 0:
            raise bad_value(f"device_memory_bytes={self.device_memory_bytes}", "must be > 0",
                            "pass the per-device memory in bytes, e.g. 40 * 2**30.")
        if self.overlap_slowdown < 1.0:
            raise bad_value(f"overlap_slowdown={self.overlap_slowdown}", "must be >= 1 (overlap cannot speed "
                            "both sides up)", "use 1.0 for perfect overlap.")
        links = {}
        for k, v in dict(self.links).items():
            _parse_link_key(k)
            links[k] = v if isinstance(v, LinkFit) else LinkFit(**v)
        object.__setattr__(self, "links", links)
        p2p = {}
        for k, v in dict(self.p2p).items():
            if k not in ("intra", "inter"):
                raise bad_value(f"p2p key {k}", "must be 'intra' or 'inter'", "key p2p fits by node locality.")
            p2p[k] = v if isinstance(v, LinkFit) else LinkFit(**v)
        object.__setattr__(self, "p2p", p2p)
        # link() answers from this memo: a search asks for the same few links millions of times, and the fallback
        # scan parses every key (not a field: equality, hashing and serialization see the links only)
        object.__setattr__(self, "_link_memo", {})
        if not links:
            raise bad_value("links={}", "a hardware profile needs at least one collective measurement",
                            "use HardwareProfile.uniform(...) or run HardwareProfiler.")

    @property
    def gather_slowdown(self) -> float:
        """The overlap slowdown of an all-gather beside compute: measured, else the all-reduce's."""
        return self.gather_overlap_slowdown or self.overlap_slowdown

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    # -- lookups ------------------------------------------------------------------------------------
    def is_intra_node(self, size: int, stride: int) -> bool:
        """A group of ``size`` ranks ``stride`` apart (aligned) stays inside one node."""
        return size * stride <= self.gpus_per_node

    def link(self, op: str, size: int, consecutive: bool, intra_node: bool) -> LinkFit:
        """Best available fit: exact key, else same op/locality (nearest size), else all-reduce's."""
        memo = self.__dict__.setdefault("_link_memo", {})
        key = (op, size, consecutive, intra_node)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = self._find_link(op, size, consecutive, intra_node)
        return hit

    def _find_link(self, op: str, size: int, consecutive: bool, intra_node: bool) -> LinkFit:
        if op not in COLLECTIVES:
            raise bad_value(op, f"unknown collective (known: {COLLECTIVES})", "use 'allreduce', 'alltoall', ...")
        for o in (op, "allreduce"):
            for c in (consecutive, not consecutive):
                hit = self.links.get(link_key(o, size, c, intra_node))
                if hit is not None:
                    return hit
        parsed = [(_parse_link_key(k), v) for k, v in self.links.items()]
        for o in (op, "allreduce"):
            same = [(key[1], v) for key, v in parsed if key[0] == o and key[3] == intra_node]
            if same:
                return min(same, key=lambda sv: (abs(math.log(sv[0] / size)), -sv[0]))[1]
        # no measurement with this locality at all: the slowest link we know (conservative)
        return min(self.links.values(), key=lambda f: f.bandwidth)

    def collective_time(self, op: str, nbytes: float, size: int, stride: int = 1) -> float:
        """Seconds for ``op`` on ``nbytes`` (per-rank buffer, full tensor for all-gather output)."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        fit = self.link(op, size, stride == 1, self.is_intra_node(size, stride))
        factor = 2.0 * (size - 1) / size if op == "allreduce" else (size - 1) / size
        return fit.time(factor * nbytes)

    def p2p_time(self, nbytes: float, intra_node: bool) -> float:
        if nbytes <= 0:
            return 0.0
        fit = self.p2p.get("intra" if intra_node else "inter") or self.p2p.get("inter") or self.p2p.get("intra")
        if fit is None:  # no p2p profile: a send is about a 2-rank all-gather of the same buffer
            fit = self.link("allgather", 2, True, intra_node)
        return fit.time(nbytes)

    # -- constructors / serialization --------------------------------------------------------------------
    @classmethod
    def uniform(cls, num_nodes: int, gpus_per_node: int, device_memory_bytes: float,
                intra_bw: float = 150e9, inter_bw: float = 20e9, latency_s: float = 20e-6,
                overlap_slowdown: float = 1.1, memory_bandwidth: float = 1.5e12,
                name: str = "uniform") -> "HardwareProfile":
        """A synthetic profile: one intra-node and one inter-node bandwidth for every collective.

        Useful for simulated large clusters (tests, what-if planning) where no measurement exists.
        """
        links: dict[str, LinkFit] = {}
        world = num_nodes * gpus_per_node
        size = 2
        sizes = sorted({d for d in range(2, world + 1) if world % d == 0} | {2})
        for op in COLLECTIVES:
            for size in sizes:
                for consec in (True, False):
                    links[link_key(op, size, consec, True)] = LinkFit(intra_bw, latency_s)
                    links[link_key(op, size, consec, False)] = LinkFit(inter_bw, 2 * latency_s)
        return cls(num_nodes, gpus_per_node, device_memory_bytes, links,
                   {"intra": LinkFit(intra_bw, latency_s), "inter": LinkFit(inter_bw, 2 * latency_s)},
                   overlap_slowdown, memory_bandwidth, name)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "HardwareProfile", "name": self.name, "num_nodes": self.num_nodes,
                "gpus_per_node": self.gpus_per_node, "device_memory_bytes": self.device_memory_bytes,
                "overlap_slowdown": self.overlap_slowdown, "memory_bandwidth": self.memory_bandwidth,
                "async_collectives": self.async_collectives,
                "links": {k: asdict(v) for k, v in sorted(self.links.items())},
                "p2p": {k: asdict(v) for k, v in sorted(self.p2p.items())},
                # profiles without a measured all-gather overlap serialize (and fingerprint) as before it existed
                **({"gather_overlap_slowdown": self.gather_overlap_slowdown} if self.gather_overlap_slowdown else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HardwareProfile":
        data = dict(data)
        if data.pop("kind", "HardwareProfile") != "HardwareProfile":
            raise bad_value(data.get("kind"), "not a HardwareProfile document", "load it with ModelProfile.from_dict.")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        return cls.from_dict(_loads(text, "HardwareProfile"))

    def fingerprint(self) -> str:
        return fingerprint(self.to_dict())


# ---------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimeFit:
    """Seconds of one layer pass: ``const + per_token * b*s + per_token_ctx * b*s*s``, or, at the sequence length
    it was measured at, the measured times themselves.

    Affine in tokens plus the attention term quadratic in sequence length (Narayanan et al. SC'21
    count 24bsh^2 + 4bs^2h FLOPs per layer). ``const`` is the per-call launch overhead: it is what
    makes larger micro-batches more efficient, and it is *zero* when only per-sample times are known.

    ``points``: measured ``(tokens, seconds)`` at sequence length ``points_seq`` (:meth:`fit` keeps them). There
    the time is read off them piecewise linearly -- exact at every measured batch, linear between two, and past
    the ends along the nearest segment (never sloping down) -- and the line serves other sequence lengths. Why:
    on CPU a block's time is not affine in the batch (caches: one dense block ran 7.7, 6.4, 6.1 and 6.7 ms per
    sample at 1, 2, 4 and 8 samples on one rank), so a line through three measured batches missed them by up to
    8 % -- and a plan runs at one of exactly those batches.
    """

    const: float = 0.0
    per_token: float = 0.0
    per_token_ctx: float = 0.0
    points: tuple[tuple[float, float], ...] = ()
    points_seq: float = 0.0

    def __post_init__(self) -> None:
        pts = tuple(sorted((float(t), float(y)) for t, y in self.points))
        if pts and (len(pts) < 2 or self.points_seq <= 0 or len({t for t, _ in pts}) != len(pts)
                    or any(not (math.isfinite(t) and math.isfinite(y) and t > 0 and y >= 0) for t, y in pts)):
            raise bad_value(f"points={list(self.points)}, points_seq={self.points_seq}",
                            "needs >= 2 (tokens, seconds) pairs with distinct positive token counts, finite seconds "
                            ">= 0, and the sequence length they were measured at (> 0)",
                            "let TimeFit.fit keep them, or leave points empty (the line only).")
        object.__setattr__(self, "points", pts)

    def line(self, batch: float, seq: float) -> float:
        return self.const + self.per_token * batch * seq + self.per_token_ctx * batch * seq * seq

    def __call__(self, batch: float, seq: float) -> float:
        if not self.points or seq != self.points_seq:
            return self.line(batch, seq)
        return _piecewise(self.points, batch * seq)

    def scaled(self, factor: float) -> "TimeFit":
        """The per-token work ``factor`` times, the launch overhead as it is. A measured point below the line's
        overhead (a noisy short pass) is taken as all overhead: it keeps its time, never turns negative."""
        pts = tuple((t, min(y, self.const) + (y - min(y, self.const)) * factor) for t, y in self.points)
        return TimeFit(self.const, self.per_token * factor, self.per_token_ctx * factor, pts, self.points_seq)

    def split_scaled(self, matmul_per_token: float, matmul_factor: float, rest_factor: float) -> "TimeFit":
        """The per-token work split in two, each part scaled by its own factor, the launch overhead as it is: matmul
        seconds (``matmul_per_token`` a token, never more than the work there is) times ``matmul_factor``, the rest
        (the attention-span term included) times ``rest_factor``. Points keep their token counts."""
        def point(t: float, y: float) -> float:
            over = min(y, self.const)
            work = y - over
            mm = min(work, matmul_per_token * t)
            return over + mm * matmul_factor + (work - mm) * rest_factor

        mm = min(self.per_token, matmul_per_token)
        return TimeFit(self.const, mm * matmul_factor + (self.per_token - mm) * rest_factor,
                       self.per_token_ctx * rest_factor, tuple((t, point(t, y)) for t, y in self.points),
                       self.points_seq)

    def times(self, factor: float) -> "TimeFit":
        """Every term ``factor`` times (a whole pass slower or faster)."""
        return TimeFit(self.const * factor, self.per_token * factor, self.per_token_ctx * factor,
                       tuple((t, y * factor) for t, y in self.points), self.points_seq)

    def carried(self, seq_from: float, seq_to: float, factor: float = 1.0) -> "TimeFit":
        """The fit planned at sequence length ``seq_to`` when its points were measured at ``seq_from``: each point
        keeps its token count (``b * s``: a pass over as many tokens makes the same kernel calls on rows of the same
        width) and takes ``factor`` times its seconds (the per-token work that grows with the attention span, see
        :func:`attention_time_factor`). A fit without points at ``seq_from`` is returned as it is: its line already
        is a function of the sequence length."""
        if not self.points or self.points_seq != seq_from:
            return self
        return TimeFit(self.const, self.per_token, self.per_token_ctx,
                       tuple((t, y * factor) for t, y in self.points), float(seq_to))

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float, float]]) -> "TimeFit":
        """Non-negative least squares fit of ``(batch, seq, seconds)`` measurements, keeping the measurements at
        the longest sequence length as ``points`` when they span two or more batch sizes (repeats averaged).

        With one sequence length the quadratic term is not identifiable and is left at 0; with one
        batch size the constant is not identifiable either (a pure per-sample fit).
        """
        if not samples:
            raise bad_value(samples, "need at least one (batch, seq, seconds) measurement", "profile >= 2 batch sizes.")
        seqs = {s for _, s, _ in samples}
        tokens = {b * s for b, s, _ in samples}
        cols = [lambda b, s: b * s]
        names = ["per_token"]
        if len(tokens) > 1:
            cols.insert(0, lambda b, s: 1.0)
            names.insert(0, "const")
        if len(seqs) > 1:
            cols.append(lambda b, s: b * s * s)
            names.append("per_token_ctx")
        coef = _nnls([[c(b, s) for c in cols] for b, s, _ in samples], [t for _, _, t in samples])
        top = max(seqs)
        at: dict[float, list[float]] = {}
        for b, s, t in samples:
            if s == top:
                at.setdefault(float(b * s), []).append(max(0.0, float(t)))
        points = tuple((t, sum(v) / len(v)) for t, v in at.items()) if len(at) >= 2 else ()
        return cls(**dict(zip(names, coef)), points=points, points_seq=float(top) if points else 0.0)


def block_flops_per_token(hidden: int, active_params: float, seq: float, causal: bool = True) -> float:
    """Forward FLOPs one token costs a transformer block: 2 per active weight plus attention over the sequence
    (``4 s h``, half of it skipped under a causal mask by flash-style kernels, CPU ones included) (Narayanan et
    al. SC'21: 24bsh^2 + 4bs^2h FLOPs per layer)."""
    return 2.0 * active_params + 4.0 * hidden * (0.5 if causal else 1.0) * seq


def attention_time_factor(hidden: int, active_params: float, seq_from: float, seq_to: float,
                          causal: bool = True) -> float:
    """Time per token of a block pass at ``seq_to`` over that at ``seq_from``, taking time as proportional to
    FLOPs (:func:`block_flops_per_token`). Tensor and sequence parallelism divide both terms alike, so one factor
    serves every sharding of the block."""
    return (block_flops_per_token(hidden, active_params, seq_to, causal)
            / block_flops_per_token(hidden, active_params, seq_from, causal))


def _without_empty_points(obj: Any) -> Any:
    """``obj`` (a serialized profile) with the ``points`` / ``points_seq`` entries of fits that have no points
    dropped, so such fits serialize (and fingerprint) as before :class:`TimeFit` kept points."""
    if isinstance(obj, dict):
        drop = {"points", "points_seq"} if "points" in obj and "per_token" in obj and not obj["points"] else set()
        return {k: _without_empty_points(v) for k, v in obj.items() if k not in drop}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_without_empty_points(v) for v in obj)
    return obj


def _piecewise(points: tuple[tuple[float, float], ...], x: float) -> float:
    """``points`` (sorted by x, >= 2) joined by straight lines, continued past either end along the end segment, whose
    slope is taken as >= 0 there (more tokens never take less time); never below 0."""
    i = next((k for k in range(1, len(points) - 1) if x < points[k][0]), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    slope = (y1 - y0) / (x1 - x0)
    if x < x0 or x > x1:  # past an end
        slope = max(0.0, slope)
        return max(0.0, (y0 if x < x0 else y1) + slope * (x - (x0 if x < x0 else x1)))
    return max(0.0, y0 + slope * (x - x0))


def _nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Tiny non-negative least squares (active set by dropping negative columns); no numpy needed."""
    active = list(range(len(rows[0])))
    while True:
        a = [[r[j] for j in active] for r in rows]
        # normal equations, scaled per column for conditioning
        n = len(active)
        scale = [max(1e-300, max(abs(r[j]) for r in a)) for j in range(n)]
        a = [[r[j] / scale[j] for j in range(n)] for r in a]
        ata = [[sum(r[i] * r[j] for r in a) for j in range(n)] for i in range(n)]
        aty = [sum(r[i] * y for r, y in zip(a, ys)) for i in range(n)]
        for i in range(n):
            ata[i][i] += 1e-12
        x = _solve(ata, aty)
        x = [xi / scale[i] for i, xi in enumerate(x)]
        neg = [active[i] for i, xi in enumerate(x) if xi < 0]
        if not neg or len(active) == 1:
            out = [0.0] * len(rows[0])
            for j, xi in zip(active, x):
                out[j] = max(0.0, xi)
            return out
        active = [j for j in active if j != neg[0]]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-300:
            continue
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] if abs(m[i][i]) > 1e-300 else 0.0 for i in range(n)]


def time_key(tp: int, sp: str, ep: int = 1) -> str:
    """Key of a sharded compute measurement, e.g. ``tp2/megatron``, or ``tp1/none/ep2`` for an MoE block whose
    experts are split over 2 ranks (all-to-all dispatch)."""
    return f"tp{tp}/{sp}" + (f"/ep{ep}" if ep > 1 else "")


def zero_key(zero: int, ep: int = 1, edp: int = 1) -> str:
    """Key of a measured FSDP2 overhead (``LayerTypeProfile.zero_overhead``): ``zero3`` for the whole block as
    one unit, ``zero3/ep4`` for an MoE block with its experts over 4 ranks left plain (a one-rank expert-data
    group), ``zero3/ep2/edp2`` for one whose experts are FSDP2 units of their own over 2 expert-data ranks."""
    return f"zero{zero}" + (f"/ep{ep}" if ep > 1 else "") + (f"/edp{edp}" if ep > 1 and edp > 1 else "")


_ZERO_KEY = re.compile(r"zero([23])(?:/ep([1-9][0-9]*)(?:/edp([1-9][0-9]*))?)?")


def parse_zero_key(key: str) -> tuple[int, int, int] | None:
    """(zero, ep, edp) of a :func:`zero_key`, or None when ``key`` is not one."""
    m = _ZERO_KEY.fullmatch(key)
    if m is None or (m.group(2) is not None and int(m.group(2)) < 2) or (m.group(3) is not None and int(m.group(3)) < 2):
        return None
    return int(m.group(1)), int(m.group(2) or 1), int(m.group(3) or 1)


def transient_key(tp: int, sp: str, ep: int = 1) -> str:
    """Key of the measured recompute peak of a checkpointed layer, e.g. ``tp2/ulysses/ckpt/peak``."""
    return act_key(tp, sp, True, ep) + "/peak"


def act_key(tp: int, sp: str, checkpoint: bool, ep: int = 1) -> str:
    """Key of an activation measurement, e.g. ``tp2/none``, ``tp1/none/ckpt`` or, for an MoE block with its
    experts over 2 ranks, ``tp1/none/ep2/ckpt``."""
    return time_key(tp, sp, ep) + ("/ckpt" if checkpoint else "")


def _raise(exc: Exception) -> Any:
    raise exc


def check_routing_skew(value: Any) -> tuple[tuple[int, float], ...]:
    """``value`` ({ep: factor} or (ep, factor) pairs) as sorted pairs, or a ``ValueError`` with a HINT: every ep an
    int >= 2, once; every factor finite and >= 1 (the busiest EP rank's routed copies over the mean)."""
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        skew = tuple(sorted((int(e), float(f)) for e, f in pairs
                            if not isinstance(e, bool) and float(e).is_integer() or _raise(TypeError())))
    except (TypeError, ValueError):
        raise bad_value(f"routing_skew={value!r}", "must be (ep, factor) pairs, ep an int",
                        "pass e.g. ((2, 1.2), (4, 1.4)), or a dict {ep: factor}.") from None
    for (e, f), (e0, _) in zip(skew, ((None, None),) + skew):
        if e < 2 or e == e0 or not (math.isfinite(f) and f >= 1.0):
            raise bad_value(f"routing_skew={value!r}", "needs distinct ep >= 2, each with a finite factor >= 1 "
                            "(the busiest rank over the mean)",
                            "measure it with lightning_galv.profiling.measure_routing_skew.")
    return skew


@dataclass(frozen=True)
class MoELayerFacts:
    """What the cost model must know of a block's Mixture-of-Experts layer beyond its measured time and memory.

    The profiler measures an MoE block whole, with every expert in one process (balanced routing makes
    the per-rank expert compute independent of expert parallelism), so the fits need no MoE terms. What
    they cannot tell is how the *parameters* split and what travels between ranks under ``ep``: routed
    experts are spread over the EP group, while router and shared expert stay with the block's dense
    parameters; every routed copy of a token (``top_k`` per token, ``dim`` wide) crosses the all-to-all.
    Counts mirror :class:`lightning_galv.models.moe.MoELayer` (router ``[dim -> E]``, SwiGLU experts).
    """

    num_experts: int
    top_k: int
    expert_params: int  # one routed expert
    dim: int  # width of the rows the all-to-alls carry (the model's hidden size)
    shared_params: int = 0  # always-on shared expert and its gate (replicated like the dense parameters)
    router_params: int = 0
    capacity_factor: float | None = None  # None: dropless (every routed copy is dispatched)
    # share of the block's parameter *tensors* that belong to routed experts: the optimizer's per-tensor
    # DTensor overhead (LayerTypeProfile.optimizer_overhead) splits by it, since expert parallelism leaves
    # the experts plain tensors where their expert-data group is one rank (0: unknown, charged whole)
    expert_tensor_share: float = 0.0
    # ((ep, factor), ...): under expert parallelism over ep ranks, the busiest rank's routed copies over its EP
    # group's mean, measured by routing real training data (``profiling.measure_routing_skew``); () = balanced.
    # The profiler times the block on random hidden states, which route nearly evenly, and the busiest rank sets
    # an EP group's pace: an untrained MoE decoder's routers gave 1.2-1.5x on the accuracy benchmark's batch, and
    # expert-parallel plans priced for balanced routing read 4-10 % fast (benchmarks/moe_routing_skew.py).
    routing_skew: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "routing_skew", check_routing_skew(self.routing_skew))
        if not (isinstance(self.expert_tensor_share, (int, float)) and 0.0 <= self.expert_tensor_share < 1.0):
            raise bad_value(f"expert_tensor_share={self.expert_tensor_share}", "must be a number in [0, 1)",
                            "count the routed experts' parameter tensors over the block's (moe_facts does).")
        for attr in ("num_experts", "top_k", "expert_params", "dim"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad_value(f"{attr}={v}", "must be a positive int",
                                "describe the MoE layer as MoELayerFacts.swiglu(dim, num_experts, top_k, expert_hidden).")
        for attr in ("shared_params", "router_params"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad_value(f"{attr}={v}", "must be an int >= 0", "use 0 when the layer has none.")
        if self.top_k > self.num_experts:
            raise bad_value(f"top_k={self.top_k}", f"cannot exceed num_experts={self.num_experts}",
                            "a token picks top_k distinct experts.")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise bad_value(f"capacity_factor={self.capacity_factor}", "must be > 0 or None (dropless)",
                            "use None unless the model drops tokens.")

    def skew(self, ep: int) -> float:
        """The busiest rank's routed copies over the mean at expert-parallel degree ``ep`` (1.0: balanced or not
        measured at that degree)."""
        return dict(self.routing_skew).get(ep, 1.0)

    @property
    def routed_params(self) -> int:
        """All routed experts together (what expert parallelism spreads over the EP group)."""
        return self.num_experts * self.expert_params

    @property
    def params(self) -> int:
        """Every parameter of the MoE layer: routed experts, shared expert, router."""
        return self.routed_params + self.shared_params + self.router_params

    @property
    def active_params(self) -> int:
        """Weights one token multiplies: router, its top_k experts, the shared expert."""
        return self.top_k * self.expert_params + self.shared_params + self.router_params

    @property
    def expert_hidden(self) -> float:
        """Width of one routed SwiGLU expert (3 matrices of dim x width)."""
        return self.expert_params / (3.0 * self.dim)

    def saved_bytes_per_token(self, el: int) -> float:
        """Activation bytes the MoE layer keeps per token for backward, when only its parameters are known.

        Counted as Korthikanti et al. '22 count a dense MLP (every matmul / elementwise input that autograd
        saves): per routed copy the gathered input row, SwiGLU's two projections, the activation and their
        product (4 x width) and the output row kept for the weighted combine; the shared expert's four
        width-sized tensors and output; fp32 router logits and probabilities.
        """
        routed = self.top_k * el * (2.0 * self.dim + 4.0 * self.expert_hidden)
        shared_width = max(0.0, (self.shared_params - self.dim) / (3.0 * self.dim)) if self.shared_params else 0.0
        shared = el * (self.dim + 4.0 * shared_width) if self.shared_params else 0.0
        return routed + shared + 8.0 * self.num_experts

    @classmethod
    def swiglu(cls, dim: int, num_experts: int, top_k: int, expert_hidden: int, shared_hidden: int = 0,
               shared_gate: bool = True, capacity_factor: float | None = None) -> "MoELayerFacts":
        """The facts of a router ``[dim -> E]`` + E SwiGLU experts (3 matrices each) + an optional shared
        SwiGLU expert with a sigmoid gate (Mixtral, Qwen-MoE; ``lightning_galv.models.moe``)."""
        shared = 3 * dim * shared_hidden + (dim if shared_hidden and shared_gate else 0)
        return cls(num_experts, top_k, 3 * dim * expert_hidden, dim, shared, dim * num_experts, capacity_factor)


@dataclass(frozen=True)
class LayerTypeProfile:
    """One kind of layer (e.g. a decoder block): time fits, parameters, activation memory."""

    name: str
    forward: TimeFit
    backward: TimeFit
    params: int
    activation_bytes: Mapping[str, float]  # act_key -> bytes per local sample at the profile seq_len
    hidden: int
    recompute: TimeFit | None = None  # None: recomputation costs one more forward
    # time_key(tp, sp) -> {"forward": fit, "backward": fit}: per-rank compute of the layer *as the runtime
    # shards it* (framework dispatch included, collectives excluded) vs the samples of one data shard.
    # Measured because dispatch overhead does not shrink with 1/tp (large on CPU); missing entries fall
    # back to dividing the unsharded fit (cost.sharded_compute). Optionally also, from the same variant
    # checkpointed: "checkpoint_forward" (its forward) and "recompute" (its backward minus the plain one's);
    # without them a recompute is priced as one more forward.
    sharded: Mapping[str, Mapping[str, TimeFit]] = field(default_factory=dict)
    # zero_key() -> {"forward": fit, "backward": fit[, "backward_nosync": fit]}: what FSDP2 adds to one pass of
    # the layer beyond the collectives themselves -- copy-in/out of the flat buffers, hooks. "backward_nosync":
    # a backward with gradient sync off (FSDP2's set_requires_gradient_sync(False): the micro-batches before the
    # last under accumulation), which skips the reduce-scatter's own copies too; missing = "backward". Per unit of
    # a chain of such units under one shared FSDP2 root, as parallelize() runs a model's blocks (the root's work
    # shared among them; until the sharded-profile cache v18, one unit alone, its own root: every root's work
    # charged per layer); "forward_alone"/"backward_alone": one unit alone (a plan's only ZeRO-2/3 unit, its own
    # root, every gather inline: cost.GalvatronCostModel.lone_unit_time). "zero2"/"zero3": the whole (unsharded)
    # layer as one unit; for an MoE block also per expert-parallel degree as the runtime wraps it (experts left
    # plain on a one-rank expert-data group, else FSDP2 units of their own), since much of the work is per unit
    # and per tensor, not per byte. Measured; scaled by the rank's share of the FSDP2-managed parameters of the
    # entry used (cost.zero_overhead_entry); missing = free.
    zero_overhead: Mapping[str, Mapping[str, TimeFit]] = field(default_factory=dict)
    # the block's Mixture-of-Experts layer, if it has one: only such layer types may take ep > 1 (the
    # measured times, parameters and activations above are of the whole block, experts included)
    moe: MoELayerFacts | None = None
    # Galvatron's "parameter_size" of the layer from its Megatron-SP memory run (layertype_i_sp), when it
    # differs from ``params`` (run-to-run noise: llama-7b's legacy file says 773.017 vs 773.251 MB). Galvatron's
    # search prices states and gradient traffic from that table under --sequence_parallel
    # (search_engine.py get_profiled_model_configs), so a Galvatron-compatible model must too; None: ``params``.
    params_sp: int | None = None
    # "tp" / "zero" -> seconds per step the optimizer update of this layer takes *beyond* its memory traffic
    # when its parameters are DTensors -- split by tensor parallelism, or sharded by FSDP2 under ZeRO-2/3.
    # Every update of a DTensor goes through sharding propagation: on CPU ~75-130 us per tensor per step
    # against ~20 us for a plain tensor, which for small shards outweighs the traffic the sharding saves
    # (ShardedLayerProfiler measures it; missing = free, as in profiles from before it did).
    optimizer_overhead: Mapping[str, float] = field(default_factory=dict)
    # time_key(tp, sp[, ep]) -> share (0..1) of the forward's collectives that a recompute of the checkpointed
    # variant runs again. Non-reentrant checkpointing stops once the last tensor the backward needs is back, so
    # a collective after it -- a dense block's final row-parallel all-reduce or reduce-scatter -- is not
    # repeated, unless the block saves something after it (dropout's mask does). ShardedLayerProfiler measures
    # it by the collectives' payload bytes; missing = 1.0 (all repeated, Galvatron's assumption).
    recompute_comm: Mapping[str, float] = field(default_factory=dict)
    # share (0..1) of the unsharded block's per-token forward + backward time at the profiled sequence length that
    # grows in proportion to the sequence length: the attention span's part, what :meth:`at_seq_len` carries.
    # Measured by ShardedLayerProfiler's attention probe (the block's own core attention timed at two sequence
    # lengths over the same tokens); 0 = not measured: FLOP-based (:func:`attention_time_factor`).
    span_share: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.span_share, bool) or not isinstance(self.span_share, (int, float)) or \
                not (0.0 <= self.span_share < 1.0):
            raise bad_value(f"span_share={self.span_share!r}", "a share of the block's per-token time, a number "
                            "in [0, 1)", "let ShardedLayerProfiler's attention probe measure it (or leave it at 0: "
                            "unmeasured = FLOP-based).")
        object.__setattr__(self, "span_share", float(self.span_share))
        if isinstance(self.moe, Mapping):
            object.__setattr__(self, "moe", MoELayerFacts(**self.moe))
        if self.moe is not None and self.moe.params > self.params:
            raise bad_value(f"moe.params={self.moe.params}", f"the MoE layer cannot hold more than the block's "
                            f"{self.params} parameters", "params counts the whole block, experts included.")
        if "tp1/none" not in self.activation_bytes:
            raise bad_value(sorted(self.activation_bytes), "activation_bytes needs the 'tp1/none' entry",
                            "profile at least the unsharded layer.")
        for attr in ("forward", "backward", "recompute"):
            v = getattr(self, attr)
            if isinstance(v, Mapping):
                object.__setattr__(self, attr, TimeFit(**v))
        object.__setattr__(self, "activation_bytes", dict(self.activation_bytes))
        sharded = {}
        for key, fits in dict(self.sharded).items():
            if set(fits) not in ({"forward", "backward"}, {"forward", "backward", "checkpoint_forward", "recompute"}):
                raise bad_value(f"sharded[{key!r}]={sorted(fits)}", "needs exactly 'forward' and 'backward' fits, "
                                "plus 'checkpoint_forward' and 'recompute' together or neither",
                                "record the passes of the sharded layer with ShardedLayerProfiler.")
            sharded[key] = {k: v if isinstance(v, TimeFit) else TimeFit(**v) for k, v in fits.items()}
        object.__setattr__(self, "sharded", sharded)
        over = {}
        for key, fits in dict(self.zero_overhead).items():
            names = set(fits) - {"backward_nosync"}
            if parse_zero_key(key) is None or names not in ({"forward", "backward"},
                                                            {"forward", "backward", "forward_alone", "backward_alone"}):
                raise bad_value(f"zero_overhead[{key!r}]={sorted(fits)}", "keys are zero_key()s ('zero2'/'zero3', or "
                                "for an MoE block e.g. 'zero3/ep4', 'zero3/ep2/edp2'), each with 'forward' and "
                                "'backward' (optionally 'backward_nosync', and 'forward_alone' with 'backward_alone')",
                                "record both passes (ShardedLayerProfiler).")
            if key != f"zero{parse_zero_key(key)[0]}" and self.moe is None:
                raise bad_value(f"zero_overhead[{key!r}]", "expert-parallel keys need an MoE layer type (moe set)",
                                "profile a dense block's FSDP2 overhead as 'zero2'/'zero3'.")
            over[key] = {k: v if isinstance(v, TimeFit) else TimeFit(**v) for k, v in fits.items()}
        object.__setattr__(self, "zero_overhead", over)
        for key, sec in dict(self.optimizer_overhead).items():
            if key not in ("tp", "zero") or not (isinstance(sec, (int, float)) and math.isfinite(sec) and sec >= 0):
                raise bad_value(f"optimizer_overhead[{key!r}]={sec!r}",
                                "keys are 'tp'/'zero', each a finite number of seconds >= 0",
                                "record it with ShardedLayerProfiler (or leave it out: unmeasured = free).")
        object.__setattr__(self, "optimizer_overhead", {k: float(v) for k, v in dict(self.optimizer_overhead).items()})
        for key, share in dict(self.recompute_comm).items():
            if isinstance(share, bool) or not (isinstance(share, (int, float)) and math.isfinite(share)
                                                   and 0.0 <= share <= 1.0):
                raise bad_value(f"recompute_comm[{key!r}]={share!r}", "a share of the forward's collectives, "
                                "a number in [0, 1]", "let ShardedLayerProfiler count them (or leave the entry "
                                "out: unmeasured = every collective repeated).")
        object.__setattr__(self, "recompute_comm", {k: float(v) for k, v in dict(self.recompute_comm).items()})

    @property
    def active_params(self) -> float:
        """Weights one token multiplies: the block's, less the routed experts it is not sent to (top_k of E)."""
        if self.moe is None:
            return float(self.params)
        m = self.moe
        return float(self.params - (m.num_experts - m.top_k) * m.expert_params)

    def span_factor(self, seq_from: int, seq_to: int) -> float:
        """Time per token of a block pass at ``seq_to`` over that at ``seq_from``: the measured span-proportional
        share (``span_share``) times ``seq_to / seq_from``, the rest as it is; without a measurement, by FLOPs
        (:func:`attention_time_factor`).

        Why measured: by FLOPs attention is ~8 % of a dense width-256 block's forward work at 128 tokens, so
        doubling the sequence would add 4 % per token; on CPU the block's core attention (RoPE and the causal
        scaled-dot-product kernel) runs at a lower rate than its matmuls, and on one rank its span-proportional part
        was 10.5 % of the block's per-token time (2 runs) -- the block's time per token at 256 over 128 read 1.09
        and 1.13, where the FLOP rule says 1.04. costmodel_accuracy.py's held-out sequence lengths read it: at
        47b1834 every 2-rank plan carried to 256 tokens was under-priced (-5.3 %, -6.2 %) and the one carried to 64
        over-priced (+3.3 %)."""
        if seq_from == seq_to:
            return 1.0
        if self.span_share > 0:
            return 1.0 + self.span_share * (seq_to / seq_from - 1.0)
        return attention_time_factor(self.hidden, self.active_params, seq_from, seq_to)

    def at_seq_len(self, seq_from: int, seq_to: int) -> "LayerTypeProfile":
        """This layer type measured at ``seq_from``, carried to ``seq_to`` (see :meth:`ModelProfile.with_seq_len`):
        every compute fit by its token count times :meth:`span_factor` (a tensor-parallel variant's by
        :meth:`variant_span_factor`), FSDP2's overhead by its token count alone (its work is per parameter and per
        call, not per attention span), every activation entry in proportion to the sequence length (each saved
        tensor of a block with fused attention is ``[b, s, ...]``)."""
        f = self.span_factor(seq_from, seq_to)
        r = seq_to / seq_from
        sharded = {k: {kind: fit.carried(seq_from, seq_to, g) for kind, fit in v.items()}
                   for k, v in self.sharded.items() for g in (self.variant_span_factor(k, seq_from, seq_to),)}
        return replace(self, forward=self.forward.carried(seq_from, seq_to, f),
                       backward=self.backward.carried(seq_from, seq_to, f),
                       recompute=None if self.recompute is None else self.recompute.carried(seq_from, seq_to, f),
                       activation_bytes={k: v * r for k, v in self.activation_bytes.items()},
                       sharded=sharded, zero_overhead={k: {kind: fit.carried(seq_from, seq_to, 1.0)
                                                           for kind, fit in v.items()}
                                                       for k, v in self.zero_overhead.items()})

    def variant_span_factor(self, key: str, seq_from: int, seq_to: int) -> float:
        """:meth:`span_factor` of the sharded variant ``key`` (``time_key``): with a measured ``span_share`` -- a
        share of the *unsharded* pass -- a tp-t variant's share is the unsharded pass's span seconds over t (its
        heads are split t ways, under Megatron-TP/SP and Ulysses alike) against its own pass at the same samples per
        rank, ``share * T_1(b) / (t * T_t(b))``: its pass also holds work that does not grow with the span
        (DTensor dispatch, re-layouts), so the unsharded share over-carried it. ``b``: the variant's largest
        measured batch; ``T_1``: the ``tp1/none`` variant timed beside it, else the unsharded fits. By FLOPs
        (no measured share) every sharding divides both terms alike: :meth:`span_factor` as it is.

        Why: in the 5-launch run of costmodel_accuracy.py at 66982c8 the unsharded share carried 4r tp2·dp2 to 256
        tokens +4.8 % high, 2r tp+sp2 +1.0 %; re-predicted with this rule +2.9 % and -1.9 % (the FLOP rule: -0.6 %,
        -3.9 %)."""
        f = self.span_factor(seq_from, seq_to)
        m = re.match(r"tp([0-9]+)/", key)
        t = int(m.group(1)) if m else 1
        fits = self.sharded.get(key)
        if self.span_share <= 0 or t == 1 or seq_from == seq_to or not fits or not fits["forward"].points:
            return f
        b = max(tok for tok, _ in fits["forward"].points) / seq_from
        ref = self.sharded.get(time_key(1, "none")) or {"forward": self.forward, "backward": self.backward}
        own = fits["forward"](b, seq_from) + fits["backward"](b, seq_from)
        if own <= 0:
            return f
        share = min(0.9, self.span_share * (ref["forward"](b, seq_from) + ref["backward"](b, seq_from)) / (t * own))
        return 1.0 + share * (seq_to / seq_from - 1.0)

    def at_width(self, hidden: int, params: int, seq_len: int, matmul_flops: float = 0.0) -> "LayerTypeProfile":
        """This dense layer type carried to another width (see :meth:`ModelProfile.with_width`): every compute
        fit's per-token work -- with ``matmul_flops`` (the rank's matmul rate, FLOP/s) split into the weights'
        matmuls (2 FLOPs per weight and token forward and in a recompute, 4 backward, over ``tp`` ranks) times the
        weight ratio and the rest times the width ratio (:meth:`TimeFit.split_scaled`); without it, all of it times
        the FLOP ratio (:func:`block_flops_per_token`); the per-call launch overhead as measured either way --,
        FSDP2's overhead in proportion to the parameters it copies, every activation entry in
        proportion to the width (a block's saved tensors are ``[b, s, h]`` or ``[b, s, ffn]``, and the FFN is
        taken to keep its ratio to ``h``), the optimizer's per-tensor DTensor overhead as it is (same tensors), the
        attention span's share of the per-token time (``span_share``) as its work grows with the width."""
        if self.moe is not None:
            raise bad_value(f"layer type {self.name!r}", "an MoE block's experts, router and all-to-all rows do not "
                            "follow one width ratio", "profile the MoE model at the width you plan for.")
        f = block_flops_per_token(hidden, params, seq_len) / block_flops_per_token(self.hidden, self.params, seq_len)
        r, rp = hidden / self.hidden, params / self.params

        def fits(table: Mapping[str, Mapping[str, TimeFit]], factor: float) -> dict[str, dict[str, TimeFit]]:
            # the whole fit, its constant too: FSDP2's work beside its collectives is per byte it copies, whatever
            # the batch (scaling the per-token slope only, as until 0d94279, kept a narrower model's copies at the
            # profiled width's: the 4-rank dp4 zero3 plan at width 192 read +7 to +9 % in two 10-launch runs of
            # costmodel_accuracy.py, +1.7 % re-predicted with the whole fit scaled)
            return {k: {kind: fit.times(factor) for kind, fit in v.items()} for k, v in table.items()}

        def wider(fit: TimeFit, kind: str, tp: int = 1) -> TimeFit:
            if matmul_flops <= 0:
                return fit.scaled(f)
            per_token = (4.0 if kind == "backward" else 2.0) * self.params / tp / matmul_flops
            return fit.split_scaled(per_token, rp, r)

        def tp_of(key: str) -> int:
            m = re.match(r"tp([0-9]+)/", key)
            return int(m.group(1)) if m else 1

        sharded = {k: {kind: wider(fit, kind, tp_of(k)) for kind, fit in v.items()} for k, v in self.sharded.items()}
        fwd, bwd = wider(self.forward, "forward"), wider(self.backward, "backward")
        # the attention span's per-token work grows with the width alone (4 h s FLOPs a token), the whole block's
        # as the fits above carried it: the span's share of the new per-token time
        before = self.forward.per_token + self.backward.per_token
        after = fwd.per_token + bwd.per_token
        span = min(0.99, self.span_share * r * before / after) if self.span_share > 0 and after > 0 else 0.0
        return replace(self, forward=fwd, backward=bwd, span_share=span,
                       recompute=None if self.recompute is None else wider(self.recompute, "recompute"),
                       params=params, hidden=hidden,
                       params_sp=None if self.params_sp is None else round(self.params_sp * rp),
                       activation_bytes={k: v * r for k, v in self.activation_bytes.items()},
                       sharded=sharded, zero_overhead=fits(self.zero_overhead, rp))

    def sharded_fit(self, kind: str, tp: int, sp: str, ep: int = 1) -> TimeFit | None:
        """The measured per-rank fit of ``kind`` (``"forward"``/``"backward"``, or ``"checkpoint_forward"``/
        ``"recompute"`` where the checkpointed variant was timed) under (tp, sp, ep), if profiled; an ep
        without its own measurement falls back to the (tp, sp) one (profiles from before ep variants)."""
        hit = self.sharded.get(time_key(tp, sp, ep)) if ep > 1 else None
        if hit is None:
            hit = self.sharded.get(time_key(tp, sp))
        return hit.get(kind) if hit is not None else None

    def recompute_comm_share(self, tp: int, sp: str, ep: int = 1) -> float:
        """Share of the forward's collectives a recompute under (tp, sp, ep) repeats: measured, else the
        (tp, sp) one for an unmeasured ep, else 1.0 (every one)."""
        hit = self.recompute_comm.get(time_key(tp, sp, ep)) if ep > 1 else None
        if hit is None:
            hit = self.recompute_comm.get(time_key(tp, sp))
        return 1.0 if hit is None else hit

    def recompute_fit(self) -> TimeFit:
        return self.recompute if self.recompute is not None else self.forward

    def recompute_peak(self, tp: int, sp: str, ep: int = 1) -> float:
        """Bytes per local sample alive while a checkpointed layer recomputes and runs backward
        (activations + gradient temporaries); an ep without its own measurement takes the (tp, sp) one;
        unmeasured: its full activations."""
        hit = self.activation_bytes.get(transient_key(tp, sp, ep)) if ep > 1 else None
        if hit is None:
            hit = self.activation_bytes.get(transient_key(tp, sp))
        return hit if hit is not None else self.activation(tp, sp, False, ep)

    def activation(self, tp: int, sp: str, checkpoint: bool, ep: int = 1) -> float:
        """Bytes per local sample; an ep without its own measurement takes the (tp, sp) one (balanced routing
        hands a rank tokens x top_k expert rows whatever ep is); missing entries follow Korthikanti et al. '22
        (Table 2)."""
        table = self.activation_bytes
        hit = table.get(act_key(tp, sp, checkpoint, ep)) if ep > 1 else None
        if hit is not None:
            return hit
        hit = table.get(act_key(tp, sp, checkpoint))
        if hit is not None:
            return hit
        full = table["tp1/none"]
        if checkpoint:  # only the layer input is kept: 2sbh (bf16), sharded on sequence by SP
            base = table.get(act_key(1, "none", True), full / 17.0)
            return base / tp if sp != "none" else base
        if sp != "none":  # sequence parallel shards everything: 34sbh / t
            return full / tp
        # plain TP shards only part: sbh(10 + 24/t) out of 34sbh
        return full * (10.0 + 24.0 / tp) / 34.0


END_PLACES = ("pp_off", "first", "last")


def _vtp_table(value: Any, what: str) -> dict[str, dict[int, float]]:
    """``place -> vtp -> float`` with int vtp keys (JSON turns them into strings) and known places."""
    out: dict[str, dict[int, float]] = {}
    for place, per_vtp in dict(value).items():
        if place not in END_PLACES:
            raise bad_value(f"{what}[{place!r}]", f"place must be one of {END_PLACES}",
                            "pp_off = embedding and head on one stage, first / last = their pipeline stages.")
        table = {}
        for k, v in dict(per_vtp).items():
            if not str(k).isdigit() or int(k) < 1:
                raise bad_value(f"{what}[{place!r}][{k!r}]", "keys are vocabulary-parallel degrees >= 1",
                                "key the table by vtp: {1: ..., 2: ...}.")
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise bad_value(f"{what}[{place!r}][{k}]={v!r}", "must be a finite number >= 0", "re-profile.")
            table[int(k)] = float(v)
        out[place] = table
    return out


@dataclass(frozen=True)
class EndsProfile:
    """Everything outside the transformer blocks as Galvatron measures it, per vocabulary-parallel degree.

    Galvatron does not split the embedding from the head: per vocab-tp degree (vtp) it measures the memory
    of all "other" layers together with the pipeline off (both ends on one stage, ``pp_off``) and on the
    first and last stage with it on, once without and once with Megatron-SP (``*_sp``), and one forward
    time for all of them. Kept whole, as measured, because a Galvatron-compatible cost model prices exactly
    these numbers, and any split into embedding and head would be a guess. ``ModelProfile``'s own
    ``embed_*`` / ``head_*`` fields are derived from it for the native model.

    Units: bytes; ``model_states`` at ZeRO-0 (what the profile measured, 4x Galvatron's "parameter size"
    in mixed precision), ``activation`` per sample of one micro-batch; ``forward`` for ``b`` samples.
    """

    model_states: Mapping[str, Mapping[int, float]]  # place -> vtp -> bytes
    activation: Mapping[str, Mapping[int, float]]  # place -> vtp -> bytes per sample
    model_states_sp: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    activation_sp: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    forward: TimeFit = TimeFit()

    def __post_init__(self) -> None:
        for attr in ("model_states", "activation", "model_states_sp", "activation_sp"):
            object.__setattr__(self, attr, _vtp_table(getattr(self, attr), attr))
        if isinstance(self.forward, Mapping):
            object.__setattr__(self, "forward", TimeFit(**self.forward))
        if not self.model_states and not self.model_states_sp:
            raise bad_value("EndsProfile()", "needs the model states with or without Megatron-SP",
                            "read it with compat.galvatron.read_model_profile.")

    def table(self, kind: str, sp: bool) -> Mapping[str, Mapping[int, float]]:
        """``model_states`` / ``activation`` with (``sp``) or without Megatron-SP; the other one when only
        that was measured (with vtp 1 they are the same layers)."""
        plain, with_sp = getattr(self, kind), getattr(self, kind + "_sp")
        return (with_sp or plain) if sp else (plain or with_sp)

    def to_dict(self) -> dict[str, Any]:
        return {"model_states": self.model_states, "activation": self.activation,
                "model_states_sp": self.model_states_sp, "activation_sp": self.activation_sp,
                "forward": _without_empty_points(asdict(self.forward))}


@dataclass(frozen=True)
class ModelProfile:
    """Everything the cost model needs about one model at one sequence length and precision."""

    name: str
    shape: ModelShape
    layer_types: tuple[LayerTypeProfile, ...]
    layer_type_of: tuple[int, ...]  # per transformer block: index into layer_types
    precision: str = "bf16"  # "bf16"/"fp16" = mixed precision with fp32 master weights, or "fp32"
    embed_params: int = 0
    head_params: int = 0
    embed_act_bytes: float = 0.0  # per local sample, on the first stage
    head_act_bytes: float = 0.0  # per local sample, on the last stage (logits, loss)
    embed_forward: TimeFit = TimeFit()
    head_forward: TimeFit = TimeFit()  # final norm + output projection + loss
    # measured backwards of the ends (ModelProfiler with make_embed / make_head); None: not measured, and the cost
    # model prices them from the forward (embedding: as long; head: twice as long)
    embed_backward: TimeFit | None = None
    head_backward: TimeFit | None = None
    framework_bytes: float = 0.0  # CUDA/CPU context, allocator slack, workspace: per rank
    source: str = "custom"
    # bytes/s of a memory-bound optimizer step measured on this model's block (0 = not measured). Kept with
    # the profile because it was measured with it: a cached profile must price the optimizer step exactly
    # like the run that measured it (it becomes HardwareProfile.memory_bandwidth in automatic mode).
    optimizer_bandwidth: float = 0.0
    # FLOP/s of a dense matmul of the block's FFN shape on one rank, timed beside the sharded block variants with
    # every rank busy (0 = not measured). Kept with the profile for the same reason; :meth:`with_width` splits a
    # block's time by it into matmul work (scales with the weights) and the rest (with the width).
    matmul_flops: float = 0.0
    # the ends as Galvatron measured them (per vocab-tp degree, with and without Megatron-SP); None for
    # profiles from our own profiler or from the shape, whose ends are the embed_* / head_* fields above
    ends: EndsProfile | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ends, Mapping):
            object.__setattr__(self, "ends", EndsProfile(**self.ends))
        if isinstance(self.shape, Mapping):
            object.__setattr__(self, "shape", ModelShape(**self.shape))
        lts = tuple(LayerTypeProfile(**lt) if isinstance(lt, Mapping) else lt for lt in self.layer_types)
        object.__setattr__(self, "layer_types", lts)
        object.__setattr__(self, "layer_type_of", tuple(self.layer_type_of))
        for attr in ("embed_forward", "head_forward", "embed_backward", "head_backward"):
            v = getattr(self, attr)
            if isinstance(v, Mapping):
                object.__setattr__(self, attr, TimeFit(**v))
        if not (self.optimizer_bandwidth >= 0 and math.isfinite(self.optimizer_bandwidth)):
            raise bad_value(f"optimizer_bandwidth={self.optimizer_bandwidth}", "must be a finite number >= 0 (bytes/s)",
                            "use 0 when unknown; re-profile otherwise.")
        if isinstance(self.matmul_flops, bool) or not isinstance(self.matmul_flops, (int, float)) or \
                not (self.matmul_flops >= 0 and math.isfinite(self.matmul_flops)):
            raise bad_value(f"matmul_flops={self.matmul_flops!r}", "must be a finite number >= 0 (FLOP/s)",
                            "use 0 when unknown; re-profile otherwise.")
        if self.precision not in PRECISIONS:
            raise bad_value(f"precision={self.precision}", f"must be one of {PRECISIONS}",
                            "use 'bf16' for mixed precision.")
        if len(self.layer_type_of) != self.shape.num_layers:
            raise bad_value(f"{len(self.layer_type_of)} layer types", f"the shape has {self.shape.num_layers} layers",
                            "give layer_type_of one entry per transformer block.")
        if any(not 0 <= t < len(lts) for t in self.layer_type_of):
            raise bad_value(list(self.layer_type_of), f"layer_type_of must index layer_types (0..{len(lts) - 1})",
                            "check the profile file.")

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def seq_len(self) -> int:
        return self.shape.seq_len

    @property
    def act_dtype_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def num_experts(self) -> tuple[int, ...]:
        """Expert counts of the MoE layer types (ascending, distinct); empty for a dense model."""
        return tuple(sorted({lt.moe.num_experts for lt in self.layer_types if lt.moe is not None}))

    @property
    def homogeneous(self) -> bool:
        return len(set(self.layer_type_of)) == 1

    def layer(self, i: int) -> LayerTypeProfile:
        return self.layer_types[self.layer_type_of[i]]

    @property
    def per_sample_only(self) -> bool:
        """True when no time fit has a per-call constant: throughput cannot depend on micro-batch size."""
        fits = [lt.forward for lt in self.layer_types] + [lt.backward for lt in self.layer_types]
        return all(f.const == 0.0 for f in fits)

    @property
    def total_params(self) -> int:
        return sum(self.layer(i).params for i in range(self.num_layers)) + self.embed_params + self.head_params

    # -- analytic profile ------------------------------------------------------------------------------
    @classmethod
    def from_shape(cls, shape: ModelShape, flops_per_s: float = 150e12, precision: str = "bf16",
                   gated_mlp: bool = True, tied_embeddings: bool = False, launch_s: float = 50e-6,
                   framework_bytes: float = 1.0 * 2**30, name: str = "analytic", moe: MoELayerFacts | None = None,
                   moe_layers: Sequence[int] | None = None) -> "ModelProfile":
        """A profile from the shape alone (no measurement): FLOPs / achieved throughput.

        Forward FLOPs follow Narayanan et al. SC'21 (2 x params x tokens + 4 b s^2 h for attention);
        backward is 2x forward (weight + input gradients). Activations follow Korthikanti et al. '22
        with flash attention (no s^2 term): 34 s h bytes per sample in 16-bit precision.

        With ``moe``, the blocks ``moe_layers`` (default: all) replace the dense MLP by that MoE layer
        (a second layer type): FLOPs count the weights a token is routed through (router, top_k experts,
        shared expert), activations the attention half of Korthikanti's 34 s h (15 s h with the norms)
        plus :meth:`MoELayerFacts.saved_bytes_per_token`.
        """
        h, f = shape.hidden, shape.ffn_hidden
        hd = h // shape.num_heads
        attn_params = h * h * 2 + 2 * h * hd * shape.num_kv_heads
        mlp_params = h * f * (3 if gated_mlp else 2)
        params = attn_params + mlp_params + 4 * h
        per_token = 2.0 * params / flops_per_s
        per_token_ctx = 4.0 * h / flops_per_s
        fwd = TimeFit(launch_s, per_token, per_token_ctx)
        bwd = TimeFit(2 * launch_s, 2 * per_token, 2 * per_token_ctx)
        el = 4 if precision == "fp32" else 2
        s = shape.seq_len
        acts = {act_key(1, "none", False): 17.0 * el * s * h, act_key(1, "none", True): el * s * h}
        layer = LayerTypeProfile("block", fwd, bwd, params, acts, h)
        layers, type_of = (layer,), (0,) * shape.num_layers
        if moe is not None:
            ids = set(range(shape.num_layers) if moe_layers is None else moe_layers)
            if not ids or not ids <= set(range(shape.num_layers)):
                raise bad_value(f"moe_layers={sorted(ids)}", f"must be block indices in 0..{shape.num_layers - 1}",
                                "list the MoE blocks, or leave moe_layers=None for an all-MoE model.")
            moe_params = attn_params + moe.params + 4 * h
            active = 2.0 * (attn_params + moe.active_params + 4 * h) / flops_per_s
            moe_acts = {act_key(1, "none", False): 7.5 * el * s * h + s * moe.saved_bytes_per_token(el),
                        act_key(1, "none", True): el * s * h}
            moe_layer = LayerTypeProfile("moe_block", TimeFit(launch_s, active, per_token_ctx),
                                         TimeFit(2 * launch_s, 2 * active, 2 * per_token_ctx), moe_params, moe_acts,
                                         h, moe=moe)
            if len(ids) == shape.num_layers:
                layers, type_of = (moe_layer,), (0,) * shape.num_layers
            else:
                layers, type_of = (layer, moe_layer), tuple(int(i in ids) for i in range(shape.num_layers))
        vocab_params = shape.vocab_size * h
        head_fwd = TimeFit(launch_s, 2.0 * vocab_params / flops_per_s, 0.0)
        return cls(name, shape, layers, type_of, precision,
                   embed_params=vocab_params, head_params=0 if tied_embeddings else vocab_params,
                   embed_act_bytes=el * s * h, head_act_bytes=(4 + el) * s * shape.vocab_size,
                   embed_forward=TimeFit(launch_s, 0.0, 0.0), head_forward=head_fwd,
                   framework_bytes=framework_bytes, source="analytic")

    # -- serialization ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = _without_empty_points(asdict(self))  # fits without measured points serialize as before they existed
        for lt in d["layer_types"]:  # dense layer types serialize exactly as before MoE existed
            if lt.get("moe") is None:
                lt.pop("moe", None)
            elif not lt["moe"].get("routing_skew"):  # and MoE facts without a measured routing skew
                lt["moe"].pop("routing_skew", None)
            if lt.get("params_sp") is None:  # and profiles without a separate Megatron-SP parameter size too
                lt.pop("params_sp", None)
            if not lt.get("optimizer_overhead"):  # and profiles without a measured DTensor optimizer overhead
                lt.pop("optimizer_overhead", None)
            if not lt.get("recompute_comm"):  # and profiles without measured recompute collectives
                lt.pop("recompute_comm", None)
            if not lt.get("span_share"):  # and profiles without a measured attention span share
                lt.pop("span_share", None)
        for attr in ("embed_backward", "head_backward"):  # and profiles whose ends' backwards were not measured
            if d[attr] is None:
                d.pop(attr)
        if not d["matmul_flops"]:  # and profiles without a measured matmul rate
            d.pop("matmul_flops")
        if self.ends is None:  # so do profiles without Galvatron's end tables
            d.pop("ends")
        else:
            d["ends"] = self.ends.to_dict()
        d["kind"] = "ModelProfile"
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelProfile":
        data = dict(data)
        if data.pop("kind", "ModelProfile") != "ModelProfile":
            raise bad_value(data.get("kind"), "not a ModelProfile document", "load it with HardwareProfile.from_dict.")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelProfile":
        return cls.from_dict(_loads(text, "ModelProfile"))

    def with_(self, **changes: Any) -> "ModelProfile":
        return replace(self, **changes)

    def with_routing_skew(self, skew: Mapping[int, float]) -> "ModelProfile":
        """This profile with every MoE layer type's ``MoELayerFacts.routing_skew`` set to ``skew`` ({ep: busiest
        rank's routed copies over the mean}, e.g. from ``profiling.measure_routing_skew``): what the training data
        does to expert parallelism, which the profiler's random inputs do not show. ``{}`` restores balance."""
        if not any(lt.moe is not None for lt in self.layer_types):
            raise bad_value(f"routing_skew={dict(skew)!r}", "applies to MoE layer types and this profile has none",
                            "profile an MoE model (LayerTypeProfile.moe set), or drop the skew.")
        types = tuple(lt if lt.moe is None else replace(lt, moe=replace(lt.moe, routing_skew=tuple(skew.items())))
                      for lt in self.layer_types)
        return replace(self, layer_types=types)

    def with_seq_len(self, seq_len: int) -> "ModelProfile":
        """This profile carried to another sequence length: plan for a sequence length that was not profiled.

        Why: a profile is measured at one sequence length (its shape's), yet the question is often another one --
        plan for 4k tokens from a profile taken at 2k, or check how far a plan's price moves with the sequence
        (issue 17 validates the cost model on held-out sequence lengths this way). Galvatron instead profiles
        every sequence length it plans for; this is the first-order rule that needs no second profile:

        - compute: a measured point keeps its token count (``b * s``), times the per-token growth of the
          attention span (:meth:`LayerTypeProfile.span_factor`: measured where the profiler timed the block's
          core attention, else by FLOPs); the ends (embedding, head and loss) by token count;
        - memory: activation bytes per sample in proportion to ``seq_len`` (fused attention saves no ``s x s``
          scores; a model whose attention materializes them would be under-priced above the profiled length);
        - communication: the cost model sizes every collective from the shape's sequence length already.

        Parameters, buffers and the optimizer do not depend on it. The rule is checked on real runs by
        ``benchmarks/costmodel_accuracy.py`` (held-out sequence lengths) and on measured activations by the tests."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise bad_value(f"seq_len={seq_len!r}", "must be a positive int (tokens per sample)",
                            f"e.g. profile.with_seq_len({2 * self.seq_len}).")
        if seq_len == self.seq_len:
            return self
        if self.ends is not None:
            raise bad_value(f"seq_len={seq_len}", f"this profile holds Galvatron's own end tables, measured at "
                            f"{self.seq_len} tokens, which no first-order rule carries",
                            "read Galvatron's profile measured at that sequence length (Galvatron profiles each "
                            "one it plans for).")
        s0, r = self.seq_len, seq_len / self.seq_len
        return replace(self, shape=replace(self.shape, seq_len=seq_len),
                       layer_types=tuple(lt.at_seq_len(s0, seq_len) for lt in self.layer_types),
                       embed_act_bytes=self.embed_act_bytes * r, head_act_bytes=self.head_act_bytes * r,
                       embed_forward=self.embed_forward.carried(s0, seq_len),
                       head_forward=self.head_forward.carried(s0, seq_len),
                       embed_backward=None if self.embed_backward is None else self.embed_backward.carried(s0, seq_len),
                       head_backward=None if self.head_backward is None else self.head_backward.carried(s0, seq_len))

    def with_width(self, shape: ModelShape, params: int | Sequence[int], embed_params: int | None = None,
                   head_params: int | None = None) -> "ModelProfile":
        """This profile carried to a wider or narrower model of the same family: plan for a width that was not
        profiled.

        Why: a model family grows mostly in width (hidden size, heads, FFN in a fixed ratio), and profiling the
        large member may itself not fit; issue 17 validates the cost model on held-out widths this way. The
        first-order rule, beside :meth:`with_seq_len`'s:

        - compute: each layer type's per-token work, split by the profile's ``matmul_flops`` into the weights'
          matmuls, times the ratio of the weights, and the rest (attention over the sequence, norms, activations,
          residuals: all ``h`` wide per token), times the ratio of the widths (:meth:`LayerTypeProfile.at_width`);
          a profile without a matmul rate takes all of it times the ratio of the forward FLOPs per token
          (:func:`block_flops_per_token` at the new ``params`` and ``hidden``); the measured per-call overhead
          kept either way; the embedding's and the head's (a ``V x h`` gather and matmul) in proportion to the
          width;
        - memory: activation bytes per sample in proportion to the width, but for the head's logits and their
          copy in the loss (``V`` wide);
          parameters, gradients and optimizer states from ``params`` / ``embed_params`` / ``head_params``;
        - communication: sized from the new shape by the cost model already.

        ``shape``: the new model's (``hidden``, heads, ``ffn_hidden`` may change; depth, vocabulary and sequence
        length may not -- repeat layers or use :meth:`with_seq_len` for those). ``params``: each layer type's
        parameter count in the new model (one int: the same for every type). ``embed_params`` /
        ``head_params``: the new ends' (default: in proportion to the width). Refused: MoE layer types, Galvatron
        profiles (per-shape end tables), and an FFN whose ratio to the width moves by more than 10 % (the
        activations' rule assumes it stays). Why the split: taking all of a block's time as proportional to FLOPs
        over-priced widening and under-priced narrowing on CPU, where the matmuls' rate barely moves with their
        size but the rest of the work grows with the width alone (see ``profiling.profilers._MatmulProbe``). On
        hardware whose matmuls run faster the larger they are (GPUs at these sizes), the matmul part is still
        priced by its FLOPs and so tends to over-price widening."""
        if not isinstance(shape, ModelShape):
            raise bad_value(f"shape={shape!r}", "must be a ModelShape (the new model's)",
                            "e.g. model.galv_shape(seq_len) of the model you plan for.")
        old = self.shape
        for attr in ("num_layers", "vocab_size", "seq_len"):
            if getattr(shape, attr) != getattr(old, attr):
                raise bad_value(f"shape.{attr}={getattr(shape, attr)}", f"with_width changes the width only; the "
                                f"profile has {attr}={getattr(old, attr)}",
                                "carry the sequence length with with_seq_len, and give depth / vocabulary as "
                                "profiled (re-size the depth with with_(shape=..., layer_type_of=...)).")
        if shape.hidden < 1:
            raise bad_value(f"shape.hidden={shape.hidden}", "must be >= 1", "pass the new model's shape.")
        if abs((shape.ffn_hidden / shape.hidden) / (old.ffn_hidden / old.hidden) - 1.0) > 0.10:
            raise bad_value(f"ffn_hidden / hidden = {shape.ffn_hidden}/{shape.hidden}",
                            f"moves by more than 10 % from the profiled {old.ffn_hidden}/{old.hidden}, and the "
                            "activation rule assumes the FFN keeps its ratio to the width",
                            "profile the model at the shape you plan for.")
        counts = [params] * len(self.layer_types) if isinstance(params, (int, float)) else list(params)
        if len(counts) != len(self.layer_types) or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                                                       for c in counts):
            raise bad_value(f"params={params!r}", f"one positive int per layer type ({len(self.layer_types)}), "
                            "or one int for all", "count the new block's parameters, e.g. "
                            "sum(p.numel() for p in block.parameters()).")
        if self.ends is not None:
            raise bad_value(f"hidden={shape.hidden}", f"this profile holds Galvatron's own end tables, measured at "
                            f"hidden {old.hidden}, which no first-order rule carries",
                            "read Galvatron's profile of the model at that width.")
        ends = {n: v for n, v in (("embed_params", embed_params), ("head_params", head_params)) if v is not None}
        for n, v in ends.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad_value(f"{n}={v!r}", "must be an int >= 0", "count the new model's end parameters.")
        if shape == old and counts == [lt.params for lt in self.layer_types] and \
                all(v == getattr(self, n) for n, v in ends.items()):
            return self
        r = shape.hidden / old.hidden

        def wider(fit: TimeFit | None) -> TimeFit | None:
            return None if fit is None else fit.scaled(r)

        # the head saves three h-wide tensors per token (the final norm's input and output, the projection's input:
        # measured on the LLaMA head, tests/test_profilers.py) and, V wide, the logits and the loss's copies of
        # them, which the width leaves alone
        narrow = min(self.head_act_bytes, 3.0 * self.act_dtype_bytes * old.seq_len * old.hidden)

        return replace(self, shape=shape,
                       layer_types=tuple(lt.at_width(shape.hidden, c, old.seq_len, self.matmul_flops)
                                         for lt, c in zip(self.layer_types, counts)),
                       embed_params=ends.get("embed_params", round(self.embed_params * r)),
                       head_params=ends.get("head_params", round(self.head_params * r)),
                       embed_act_bytes=self.embed_act_bytes * r,
                       head_act_bytes=self.head_act_bytes + narrow * (r - 1.0),
                       embed_forward=wider(self.embed_forward), head_forward=wider(self.head_forward),
                       embed_backward=wider(self.embed_backward), head_backward=wider(self.head_backward))


def _loads(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} JSON: cannot parse ({exc}). HINT: re-profile or delete the cached file.") from exc
    if not isinstance(data, dict):
        raise TypeError(f"{what} JSON: top level is {type(data).__name__}, expected an object. HINT: re-profile.")
    return data


# ---------------------------------------------------------------------------------------------------
# fingerprints and cache
# ---------------------------------------------------------------------------------------------------
def fingerprint(facts: Mapping[str, Any] | Iterable[Any]) -> str:
    """A short stable hash of JSON-able facts (machine, model, software versions, ...)."""
    blob = json.dumps(facts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_dir() -> Path:
    """``$GALV_CACHE_DIR`` or ``~/.cache/lightning_galv`` (created on first use)."""
    return Path(os.environ.get("GALV_CACHE_DIR") or Path.home() / ".cache" / "lightning_galv")


class ProfileCache:
    """Profiles on disk keyed by the fingerprint of what was measured, so re-runs skip profiling."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_dir()

    def path(self, kind: str, key: str) -> Path:
        if not key.isalnum() or not kind.isidentifier():
            raise bad_value(f"{kind}/{key}", "cache kind must be an identifier and key alphanumeric",
                            "pass fingerprint(...) as the key.")
        return self.directory / f"{kind}-{key}.json"

    def load(self, kind: str, key: str) -> HardwareProfile | ModelProfile | None:
        p = self.path(kind, key)
        if not p.is_file():
            return None
        try:
            data = _loads(p.read_text(), kind)
            return (HardwareProfile.from_dict(data) if data.get("kind") == "HardwareProfile"
                    else ModelProfile.from_dict(data))
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            # a half-written or hand-edited file: the user must know which file, and that deleting it is safe
            why = " ".join(str(exc).split(" HINT:")[0].split())  # one HINT in the message: this one
            raise bad_value(str(p), f"cached {kind} profile is corrupt ({type(exc).__name__}: {why})",
                            f"delete this file (it is re-measured on the next run) or clear the cache folder "
                            f"{str(self.directory)!r} ($GALV_CACHE_DIR)") from exc

    def save(self, kind: str, key: str, profile: HardwareProfile | ModelProfile) -> Path:
        p = self.path(kind, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(profile.to_json())
        tmp.replace(p)  # atomic: concurrent ranks never read half a file
        return p
