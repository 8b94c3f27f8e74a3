"""Degrees -> rank groups -> DeviceMesh, owned by one object.

The rank arithmetic (:class:`RankLayout`) is pure, testable at any simulated world size;
:class:`MeshFactory` is the single place that builds ``DeviceMesh`` objects. It caches them, so every
layer with the same factorization shares one set of process groups, and it gives every group it creates
the strategy's collective timeout.

Rank numbering (as in Galvatron): pipeline stages are the outermost dimension, so stage ``s`` owns
global ranks ``[s*S, (s+1)*S)`` with ``S = world_size // pp``. Inside a stage a layer factorizes the
``S`` ranks as ``dp x tp``:

* consecutive tp groups (default): local rank ``l`` has ``tp_index = l % tp``, ``dp_index = l // tp``;
* strided tp groups: ``tp_index = l // dp``, ``dp_index = l % dp``.

A layer's *activation layout* is which batch shard a rank holds: shard ``dp_index`` of ``dp`` equal
shards, replicated over the rank's tp group.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator

from .plan import LayerStrategy, ParallelPlan

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class RankLayout:
    """Pure rank arithmetic for one world of ``world_size`` ranks split into ``pp`` stages."""

    world_size: int
    pp: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.pp < 1 or self.world_size % self.pp:
            raise ValueError(f"world_size={self.world_size}, pp={self.pp}: pp must divide the world size. "
                             "HINT: pick pp from the divisors of the world size.")

    @property
    def stage_size(self) -> int:
        return self.world_size // self.pp

    def stage_of(self, rank: int) -> int:
        return rank // self.stage_size

    def stage_ranks(self, stage: int) -> list[int]:
        start = stage * self.stage_size
        return list(range(start, start + self.stage_size))

    def grid(self, s: LayerStrategy, stage: int = 0) -> list[list[int]]:
        """Global ranks of ``stage`` arranged ``[dp_index][tp_index]`` for strategy ``s``."""
        if s.width != self.stage_size:
            raise ValueError(f"strategy {s.short()} spans {s.width} ranks but a stage has {self.stage_size}. "
                             "HINT: tp*dp must equal world_size/pp.")
        base = stage * self.stage_size
        if s.tp_consecutive:
            return [[base + d * s.tp + t for t in range(s.tp)] for d in range(s.dp)]
        return [[base + t * s.dp + d for t in range(s.tp)] for d in range(s.dp)]

    def coords(self, s: LayerStrategy, rank: int) -> tuple[int, int]:
        """(dp_index, tp_index) of ``rank`` under strategy ``s``."""
        local = rank - self.stage_of(rank) * self.stage_size
        if s.tp_consecutive:
            return local // s.tp, local % s.tp
        return local % s.dp, local // s.dp

    def tp_group(self, s: LayerStrategy, rank: int) -> list[int]:
        d, _ = self.coords(s, rank)
        return self.grid(s, self.stage_of(rank))[d]

    def dp_group(self, s: LayerStrategy, rank: int) -> list[int]:
        _, t = self.coords(s, rank)
        return [row[t] for row in self.grid(s, self.stage_of(rank))]

    def expert_grid(self, s: LayerStrategy) -> list[Any]:
        """Global ranks of an MoE layer under ``s`` (``s.ep > 1``), arranged ``[pp][edp][ep]`` for Ulysses and
        ``[pp][tp_index][edp][ep]`` otherwise.

        An EP group is a run of ``ep`` consecutive ranks of the layer's data group (dp ranks of one tp index; for
        Ulysses every rank of the stage, flattened row-major from ``(dp, tp)``); ``edp`` joins the ranks at the same
        position of every EP group, which hold the same experts. Every dimension is ascending -- inside an EP
        group, and the EP groups ordered by their smallest rank, which makes each ``edp`` column ascending too --
        because a 1-D mesh's process group numbers its ranks in ascending order (FSDP2's shard ``i`` and the
        dispatcher's all-to-alls go by that) while DTensor places shard ``c`` on mesh coordinate ``c``. With strided
        tp groups the row-major order is not ascending (world 8, Ulysses tp4 x dp2, ep2: edp ``[0, 4, 1, 5]``
        before the groups were ordered). Which ranks form an EP or edp group does not change with the order."""
        k = s.ep
        out: list[Any] = []
        for stage in range(self.pp):
            g = self.grid(s, stage)  # [dp][tp]
            datas = [[r for row in g for r in row]] if s.ulysses else [[row[t] for row in g] for t in range(s.tp)]
            blocks = [sorted(sorted(data[i:i + k]) for i in range(0, len(data), k)) for data in datas]
            out.append(blocks[0] if s.ulysses else blocks)
        return out

    def batch_shard(self, s: LayerStrategy, rank: int) -> tuple[int, int]:
        """(shard index, shard count) of the batch that ``rank`` holds under ``s``."""
        return self.coords(s, rank)[0], s.dp

    def data_strategy(self, plan: ParallelPlan) -> LayerStrategy:
        """The layout the data loader serves: the finest dp in the plan, consecutive replicas."""
        dp = plan.data_parallel_size
        return LayerStrategy(tp=self.stage_size // dp, dp=dp)


@dataclass
class MeshFactory:
    """Builds and caches the DeviceMeshes a plan needs (the only place meshes are created).

    For a factorization ``(tp, dp, consecutive)`` it builds one world mesh ``("pp", "dp", "tp")`` and
    hands out the current stage's ``("dp", "tp")`` sub-mesh. Every rank must request meshes in the
    same order (mesh creation is collective); :meth:`build_all` does that for a whole plan up front.
    ``timeout`` (if given) is put on every process group the factory creates: DeviceMesh sub-groups
    otherwise get the backend default (30 minutes for gloo), not the world group's timeout.

    :meth:`close` destroys the groups the factory created, for meshes that served a temporary model (a
    profile, a benchmark's plan): torch never frees a process group on its own, and each idle gloo group
    keeps a transport thread polling its sockets, which slows every later measurement in the process.
    """

    layout: RankLayout
    device_type: str
    rank: int
    timeout: timedelta | None = None
    _cache: dict[tuple[int, int, bool], Any] = field(default_factory=dict)
    _flat: dict[Any, Any] = field(default_factory=dict)  # flattened (Ulysses) and expert meshes
    _groups: list[Any] = field(default_factory=list)  # the process groups its meshes created, in order

    @contextmanager
    def _tracking(self) -> Iterator[None]:
        """Record the process groups created inside the block (mesh creation makes them)."""
        from torch.distributed import distributed_c10d as c10d

        before = set(map(id, c10d._world.pg_map))
        try:
            yield
        finally:
            self._groups += [pg for pg in c10d._world.pg_map if id(pg) not in before]

    def close(self) -> int:
        """Destroy every process group this factory's meshes created (collective: every rank calls it, after
        the last use of any of its meshes; the meshes are unusable afterwards). Returns how many."""
        import torch.distributed as dist

        groups, self._groups = self._groups, []
        self._cache.clear()
        self._flat.clear()
        if not groups or not dist.is_initialized():
            return 0
        dist.barrier()  # no rank may still be in a collective on a group another rank destroys
        clear_dtensor_caches()  # they hold the meshes, and so the groups' C++ objects and threads
        for pg in groups:
            dist.destroy_process_group(pg)
        return len(groups)

    def __enter__(self) -> "MeshFactory":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()  # after an error the ranks may disagree on where they stopped: no barrier then

    def world_mesh(self, s: LayerStrategy) -> "DeviceMesh":
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        key = (s.tp, s.dp, s.tp_consecutive)
        if key not in self._cache:
            grids = [self.layout.grid(s, stage) for stage in range(self.layout.pp)]
            mesh = torch.tensor(grids, dtype=torch.int)  # [pp, dp, tp]
            with self._tracking():
                built = DeviceMesh(self.device_type, mesh, mesh_dim_names=("pp", "dp", "tp"))
            if self.timeout is not None:
                from .parallel.timeouts import set_mesh_timeout

                set_mesh_timeout(built, self.timeout)
            self._cache[key] = built
        return self._cache[key]

    def mesh(self, s: LayerStrategy) -> "DeviceMesh":
        """This rank's ``("dp", "tp")`` mesh for strategy ``s``."""
        world = self.world_mesh(s)
        with self._tracking():  # slicing reuses the parent's groups today; tracked in case a torch makes new ones
            return world["dp", "tp"]

    def data_mesh(self, s: LayerStrategy) -> "DeviceMesh":
        """1-D mesh over which ``s`` reduces gradients and ZeRO shards (dp, or dp*tp for Ulysses), its ranks in
        ascending order.

        Why ascending: a 1-D mesh's process group numbers its ranks in ascending order, and FSDP2 keeps shard
        ``i`` on group rank ``i`` (``get_local_rank``), while DTensor -- and with it DCP's checkpoint offsets and
        the state-dict gathers -- places shard ``c`` on mesh coordinate ``c``. Flattening ``(dp, tp)`` row-major
        gave a Ulysses layer with strided tp groups the order ``[0, 2, 1, 3]``: training stayed exact (FSDP2 agrees
        with itself), but a sharded checkpoint held such a layer's rows 1 and 2 swapped, so it loaded wrongly
        under any other plan (found by a random-plan hunt, tests/test_reshard.py pair U). The dp slices of the
        world mesh are ascending already (:meth:`RankLayout.grid`); a Ulysses data group is every rank of the
        stage."""
        mesh = self.mesh(s)
        if not s.ulysses:
            return mesh["dp"]
        name = f"dp_tp_{s.tp}_{s.dp}_{int(s.tp_consecutive)}"
        if name not in self._flat:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            grids = torch.tensor([self.layout.grid(s, stage) for stage in range(self.layout.pp)], dtype=torch.int)
            ranks = torch.sort(grids.reshape(self.layout.pp, s.dp * s.tp), dim=-1).values  # [pp, dp*tp], ascending
            with self._tracking():
                flat = DeviceMesh(self.device_type, ranks, mesh_dim_names=("pp", name))[name]
            if self.timeout is not None:
                from .parallel.timeouts import set_mesh_timeout

                set_mesh_timeout(flat, self.timeout)
            self._flat[name] = flat
        return self._flat[name]

    def expert_mesh(self, s: LayerStrategy) -> "DeviceMesh":
        """This rank's ``("edp", "ep")`` mesh for an MoE layer under ``s`` (``s.ep > 1``).

        Its ranks are :meth:`RankLayout.expert_grid`'s: EP groups of consecutive data-group ranks, every
        dimension ascending (a strided Ulysses data group, e.g. ``[0, 2, 1, 3]``, once gave a rank the rows of
        another rank's experts: fully sharded and fused expert tensors).
        """
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        key = ("ep", s.tp, s.dp, s.tp_consecutive, s.ulysses, s.ep)
        if key not in self._flat:
            ranks = torch.tensor(self.layout.expert_grid(s), dtype=torch.int)  # [pp, edp, ep] / [pp, tp, edp, ep]
            names: tuple[str, ...] = ("pp", "edp", "ep") if s.ulysses else ("pp", "tpx", "edp", "ep")
            with self._tracking():
                built = DeviceMesh(self.device_type, ranks, mesh_dim_names=names)
            if self.timeout is not None:
                from .parallel.timeouts import set_mesh_timeout

                set_mesh_timeout(built, self.timeout)
            self._flat[key] = built
        with self._tracking():
            return self._flat[key]["edp", "ep"]

    def build_all(self, plan: ParallelPlan) -> None:
        seen: set[tuple[int, int, bool]] = set()
        for s in (self.layout.data_strategy(plan), *plan.all_strategies()):
            key = (s.tp, s.dp, s.tp_consecutive)
            if key not in seen:
                seen.add(key)
                self.world_mesh(s)
            if s.ulysses:
                self.data_mesh(s)
            if s.ep > 1:
                self.expert_mesh(s)


def clear_dtensor_caches() -> None:
    """Empty torch's DTensor caches that hold DeviceMeshes (private names in torch 2.13, each looked up
    defensively: a torch without one has nothing to clear there).

    Why: they keep every mesh they have seen alive, and with it its process groups' C++ objects, whose gloo
    threads run until those are freed (``tests/test_parity.py``: 6 threads per rank outlived a closed factory
    without this). They also match meshes by ranks and dim names: a test launch that destroyed groups without
    clearing them once failed in a later check with "Could not resolve the process group"."""
    import torch

    def clear(obj: Any, *names: str) -> None:
        for name in names[:-1]:
            obj = getattr(obj, name, None)
            if obj is None:
                return
        fn = getattr(obj, names[-1], None)
        if callable(fn):
            fn()

    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop
    except ImportError:  # pragma: no cover - a torch without DTensor caches nothing
        return
    clear(DTensor, "_op_dispatcher", "sharding_propagator", "propagate_op_sharding", "cache_clear")
    clear(_sharding_prop.ShardingPropagator, "_propagate_tensor_meta_cached", "cache_clear")
    clear(torch._C, "_clear_DTensor_sharding_propagator_cache")
    clear(_redistribute, "clear_redistribute_planner_cache")
    clear(_redistribute, "_gen_transform_infos", "cache_clear")
    clear(_collective_utils, "MeshTopoInfo", "build_from_mesh", "cache_clear")
