"""Topology, NetMoE sample placement and LAER-MoE expert re-layout: pure planners (numpy + scipy, no torch).

Placement optima are checked against brute force on problems small enough to enumerate; re-layout against
its invariants and the issue's balance goal on a skewed load.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lightning_galv.planner.placement import placement_bytes, solve_placement, traffic_matrix
from lightning_galv.planner.profiles import HardwareProfile
from lightning_galv.planner.relayout import ExpertLayout, new_materializations, plan_relayout, split_counts
from lightning_galv.planner.topology import Topology, resolve_bandwidths


# ---------------------------------------------------------------------------------------------------
# topology
# ---------------------------------------------------------------------------------------------------
def test_topology_nodes_and_byte_split() -> None:
    t = Topology(8, 4)
    assert t.num_nodes == 2 and [t.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    m = np.arange(64, dtype=float).reshape(8, 8)
    intra = sum(m[i, j] for i in range(8) for j in range(8) if i != j and i // 4 == j // 4)
    inter = sum(m[i, j] for i in range(8) for j in range(8) if i // 4 != j // 4)
    assert t.split_bytes(m) == (intra, inter)
    one = Topology(4, 8)  # fewer ranks than a node holds: one node
    assert one.num_nodes == 1 and one.split_bytes(np.ones((4, 4))) == (12.0, 0.0)


def test_a2a_time_by_hand() -> None:
    t = Topology(4, 2)
    m = np.zeros((4, 4))
    m[0, 1] = 100.0  # intra
    m[0, 2] = 30.0  # inter
    m[3, 2] = 50.0  # intra, rank 2 receives 50 intra + 30 inter
    # rank 0: 100/10 + 30/1 = 40; rank 2: 50/10 + 30/1 = 35; rank 3: 50/10 = 5
    assert t.a2a_time(m, None, intra_bw=10.0, inter_bw=1.0) == pytest.approx(40.0)
    hw = HardwareProfile.uniform(2, 2, 2**30, intra_bw=10.0, inter_bw=1.0)
    assert resolve_bandwidths(hw, t) == (10.0, 1.0)
    assert t.a2a_time(m, hw) == pytest.approx(40.0)


def test_topology_from_env_and_errors() -> None:
    assert Topology.from_env(8, env={"LOCAL_WORLD_SIZE": "4"}) == Topology(8, 4)
    assert Topology.from_env(16, env={"SLURM_NTASKS_PER_NODE": "8(x2)"}) == Topology(16, 8)
    assert Topology.from_env(8, 2, env={"LOCAL_WORLD_SIZE": "4"}) == Topology(8, 2)
    assert Topology.from_env(6, env={}).num_nodes == 1
    with pytest.raises(ValueError, match="gpus_per_node must divide ranks.*HINT:"):
        Topology(6, 4)
    with pytest.raises(ValueError, match="positive int.*HINT:"):
        Topology(0, 4)
    with pytest.raises(ValueError, match="HINT:"):
        Topology(8, 4).node_of(8)
    with pytest.raises(ValueError, match="must be \\[src, dst\\].*HINT:"):
        Topology(8, 4).split_bytes(np.ones((4, 4)))
    with pytest.raises(ValueError, match="HardwareProfile or an explicit bandwidth.*HINT:"):
        Topology(8, 4).a2a_time(np.ones((8, 8)), None)
    with pytest.raises(ValueError, match="positive integer.*HINT:"):
        Topology.from_env(8, env={"LOCAL_WORLD_SIZE": "x"})


# ---------------------------------------------------------------------------------------------------
# placement
# ---------------------------------------------------------------------------------------------------
def _balanced_placements(samples: int, ranks: int):
    """Every assignment of samples to ranks with samples / ranks each."""
    per = samples // ranks
    slots = [r for r in range(ranks) for _ in range(per)]
    return {p for p in itertools.permutations(slots)}


def _small_case(seed: int, residual: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    rng = np.random.default_rng(seed)
    tok = rng.poisson(rng.gamma(0.6, 6.0, size=(8, 4)))  # skewed, many ties and zeros
    cur = rng.permutation(np.repeat(np.arange(4), 2))
    res = rng.integers(0, 6, size=8) if residual else None
    return tok, cur, res


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("residual", [False, True])
def test_two_stage_matches_brute_force(seed: int, residual: bool) -> None:
    """2 nodes x 2 ranks x 2 samples: stage 1 reaches the least inter-node bytes of *all* 2520 balanced
    placements; stage 2 the least intra-node bytes among placements with the chosen node of every sample."""
    topo = Topology(4, 2)
    tok, cur, res = _small_case(seed, residual)
    r = solve_placement(tok, cur, topo, residual_tokens=res, token_bytes=3.0)
    every = _balanced_placements(8, 4)
    assert len(every) == 2520
    cost = {p: placement_bytes(tok, np.array(p), topo, current=cur, residual_tokens=res, token_bytes=3.0)
            for p in every}
    assert r.inter_after == pytest.approx(min(c[1] for c in cost.values()))
    node = r.new_rank // 2
    same_nodes = [c[0] for p, c in cost.items() if np.array_equal(np.array(p) // 2, node)]
    assert r.intra_after == pytest.approx(min(same_nodes))
    assert (r.intra_before, r.inter_before) == pytest.approx(placement_bytes(tok, cur, topo, token_bytes=3.0))
    assert r.inter_after <= r.inter_before  # staying put is always feasible
    assert r.solve_seconds >= 0


def test_known_optimum_at_64_ranks_and_balance() -> None:
    """Each sample's tokens all go to one rank, four samples per rank: the optimum puts every sample on
    its experts' rank (zero bytes), whatever the starting layout."""
    k, per = 64, 4
    rng = np.random.default_rng(0)
    target = rng.permutation(np.repeat(np.arange(k), per))
    tok = np.zeros((k * per, k), np.int64)
    tok[np.arange(k * per), target] = rng.integers(1, 50, size=k * per)
    cur = np.repeat(np.arange(k), per)
    r = solve_placement(tok, cur, Topology(k, 8))
    assert np.array_equal(r.new_rank, target)
    assert r.inter_after == 0 and r.intra_after == 0 and r.inter_before > 0
    assert np.all(np.bincount(r.new_rank, minlength=k) == per)


def test_balanced_deterministic_and_stays_put_on_ties() -> None:
    rng = np.random.default_rng(3)
    k, per = 16, 4
    tok = rng.poisson(rng.gamma(0.4, 10.0, size=(k * per, k)))
    cur = rng.permutation(np.repeat(np.arange(k), per))
    res = np.full(k * per, 8)
    a = solve_placement(tok, cur, Topology(k, 4), residual_tokens=res, token_bytes=2.0)
    b = solve_placement(tok.copy(), cur.copy(), Topology(k, 4), residual_tokens=res.copy(), token_bytes=2.0)
    assert np.array_equal(a.new_rank, b.new_rank)
    assert np.all(np.bincount(a.new_rank, minlength=k) == per)
    assert not a.new_rank.flags.writeable
    m = traffic_matrix(tok, a.new_rank, Topology(k, 4), current=cur, residual_tokens=res, token_bytes=2.0)
    assert Topology(k, 4).split_bytes(m) == pytest.approx((a.intra_after, a.inter_after))
    # no traffic at all: every placement costs zero, and the tie-break keeps every sample where it is
    zero = solve_placement(np.zeros_like(tok), cur, Topology(k, 4))
    assert np.array_equal(zero.new_rank, cur)
    # one node: only the intra-node stage runs
    single = solve_placement(tok, cur, Topology(k, k))
    assert single.inter_after == single.inter_before == 0
    assert single.intra_after <= single.intra_before


def test_placement_validation() -> None:
    topo = Topology(4, 2)
    tok = np.ones((8, 4), np.int64)
    cur = np.repeat(np.arange(4), 2)
    with pytest.raises(ValueError, match="multiple of ranks=4.*HINT:"):
        solve_placement(np.ones((6, 4)), np.repeat(np.arange(3), 2), topo)
    with pytest.raises(ValueError, match="must hold 2 samples.*HINT:"):
        solve_placement(tok, np.array([0, 0, 0, 1, 1, 2, 3, 3]), topo)
    with pytest.raises(ValueError, match="non-negative integer counts.*HINT:"):
        solve_placement(tok - 2, cur, topo)
    with pytest.raises(ValueError, match="non-negative integer counts.*HINT:"):
        solve_placement(tok * 0.5, cur, topo)
    with pytest.raises(ValueError, match="must be \\(8, 4\\).*HINT:"):
        solve_placement(np.ones((8, 3)), cur, topo)
    with pytest.raises(ValueError, match="ints in 0..3.*HINT:"):
        solve_placement(tok, cur + 1, topo)
    with pytest.raises(ValueError, match="token_bytes.*HINT:"):
        solve_placement(tok, cur, topo, token_bytes=0.0)
    with pytest.raises(ValueError, match="residual_tokens shape.*HINT:"):
        solve_placement(tok, cur, topo, residual_tokens=np.ones(3))
    with pytest.raises(ValueError, match="must be a Topology.*HINT:"):
        solve_placement(tok, cur, (4, 2))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# expert re-layout
# ---------------------------------------------------------------------------------------------------
SKEWED = [5200, 900, 400, 2100, 300, 700, 1500, 600]  # max/mean 2.7 under plain EP on 8 ranks


def _check_layout(layout: ExpertLayout, experts: int, ranks: int, slots: int) -> None:
    assert layout.ranks == ranks and layout.num_experts == experts
    # the greedy fills every slot; the alias construction (max/mean 1) may leave some free
    exact = sum(layout.rank_load) > 0 and layout.imbalance == pytest.approx(1.0, abs=1e-9)
    assert all((len(s) <= slots if exact else len(s) == slots) and list(s) == sorted(set(s)) for s in layout.slots)
    for e in range(experts):
        sh = layout.shares[e]
        assert len(sh) >= 1
        assert [r for r, _ in sh] == sorted(r for r in range(ranks) if e in layout.slots[r])
        assert math.isclose(sum(f for _, f in sh), 1.0, abs_tol=1e-9)


def test_relayout_balances_skewed_load() -> None:
    static = ExpertLayout.static(8, 8).with_load(SKEWED)
    assert static.imbalance >= 1.5
    layout = plan_relayout(SKEWED, 8, 2)
    _check_layout(layout, 8, 8, 2)
    assert layout.imbalance <= 1.10
    assert layout.rank_load == pytest.approx(layout.loads_for(SKEWED))
    assert sum(layout.rank_load) == pytest.approx(sum(SKEWED))
    assert layout.replicas(0) > layout.replicas(4)  # the hottest expert gets more replicas than the coldest
    assert plan_relayout(SKEWED, 8, 2) == layout  # deterministic


def test_relayout_joins_disjoint_replica_groups() -> None:
    """A step of the recorded corpus trace: the greedy's LPT puts both hot experts 6 and 7 on ranks {5, 6, 7}
    (2000 tokens over 3 ranks, 1.30 x the mean whatever the shares); the swap search links them to expert 0's
    ranks. (``plan_relayout`` takes the exact alias construction for this shape: checked below.)"""
    from lightning_galv.planner.relayout import _greedy_layout

    load = [2034, 0, 62, 0, 0, 0, 1179, 821]
    layout = _greedy_layout(np.asarray(load, dtype=np.float64), 8, 2)
    assert all(len(s) == 2 for s in layout.slots)
    assert ExpertLayout.static(8, 8).with_load(load).imbalance >= 3.9
    assert layout.imbalance <= 1.05
    assert layout.rank_load == pytest.approx(layout.loads_for(load))
    assert plan_relayout(load, 8, 2).imbalance == pytest.approx(1.0)


def test_relayout_alias_is_exact_and_keeps_experts_home() -> None:
    """No more experts than ranks, two slots: Walker's alias construction balances to the mean exactly, each rank
    keeps its plain-EP expert (experts == ranks) and materializes at most one other; the greedy left 1.26 on a
    skewed 64-rank step (benchmarks/moe_relayout.py at 10dac32)."""
    rng = np.random.default_rng(3)
    for k, e, slots in ((8, 8, 2), (64, 64, 2), (64, 64, 3), (1024, 1024, 2), (8, 5, 2), (6, 2, 2)):
        for _ in range(20):
            load = (rng.pareto(0.8, size=e) * 50).astype(int) * (rng.random(e) < 0.8)
            if load.sum() == 0:
                continue
            layout = plan_relayout(load.tolist(), k, slots)
            _check_layout(layout, e, k, slots)
            assert layout.imbalance == pytest.approx(1.0, abs=1e-9) and all(len(s) <= 2 for s in layout.slots)
            assert layout.rank_load == pytest.approx(layout.loads_for(load.tolist()))
            if e == k:
                assert all(x in layout.slots[x] for x in range(e))
            for x in range(e):
                assert sum(split_counts(layout, x, int(load[x]))) == load[x]


@pytest.mark.parametrize("load,ranks,slots", [
    ([2, 0, 41, 0, 46, 42, 45, 0, 0], 4, 8),  # full slots: the placement needs its swap repair
    ([0, 9, 24, 0, 9, 0, 7, 0], 4, 7),
    ([0] * 6, 3, 2),  # nothing routed
    ([10], 1, 1),
    (list(range(1, 17)), 4, 5),
])
def test_relayout_invariants(load: list[int], ranks: int, slots: int) -> None:
    layout = plan_relayout(load, ranks, slots)
    _check_layout(layout, len(load), ranks, slots)
    for e, total in enumerate(load):
        counts = split_counts(layout, e, total)
        assert sum(counts) == total and len(counts) == layout.replicas(e) and min(counts) >= 0


def test_static_layout_is_plain_ep() -> None:
    layout = ExpertLayout.static(8, 4)
    assert layout.slots == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.shares == tuple(((e // 2, 1.0),) for e in range(8))
    assert layout.with_load(range(8)).rank_load == (1.0, 5.0, 9.0, 13.0)
    assert new_materializations(layout, layout) == []
    moved = plan_relayout([100, 0, 0, 0, 0, 0, 0, 0], 4, 3)
    assert all((r, 0) in new_materializations(layout, moved) for r in range(1, 4))  # expert 0 everywhere


def test_split_counts_largest_remainder() -> None:
    layout = ExpertLayout(((0,), (0,), (0,)), (((0, 0.5), (1, 0.3), (2, 0.2)),), (0.0, 0.0, 0.0))
    assert split_counts(layout, 0, 7) == [4, 2, 1]  # exact 3.5, 2.1, 1.4: the .5 remainder wins the token
    assert split_counts(layout, 0, 0) == [0, 0, 0]
    even = ExpertLayout(((0,), (0,), (0,)), (((0, 1 / 3), (1, 1 / 3), (2, 1 / 3)),), (0.0, 0.0, 0.0))
    assert split_counts(even, 0, 4) == [2, 1, 1]  # ties go to the lower index
    with pytest.raises(ValueError, match="expert=1.*HINT:"):
        split_counts(layout, 1, 4)
    with pytest.raises(ValueError, match="total=-1.*HINT:"):
        split_counts(layout, 0, -1)


def test_relayout_validation() -> None:
    with pytest.raises(ValueError, match="slots_per_rank=1.*ceil\\(experts / ranks\\) = 2.*HINT:"):
        plan_relayout([1] * 8, 4, 1)
    with pytest.raises(ValueError, match="slots_per_rank=5.*HINT:"):
        plan_relayout([1] * 4, 4, 5)
    with pytest.raises(ValueError, match="non-negative token counts.*HINT:"):
        plan_relayout([1, -1], 2, 1)
    with pytest.raises(ValueError, match="non-negative token counts.*HINT:"):
        plan_relayout([], 2, 1)
    with pytest.raises(ValueError, match="ranks to divide the experts.*HINT:"):
        ExpertLayout.static(6, 4)
    with pytest.raises(ValueError, match="sum to 1.*HINT:"):
        ExpertLayout(((0,), (0,)), (((0, 0.5), (1, 0.4)),), (0.0, 0.0))
    with pytest.raises(ValueError, match="must be the ranks whose slots hold expert 0.*HINT:"):
        ExpertLayout(((0,), ()), (((0, 0.5), (1, 0.5)),), (0.0, 0.0))
    with pytest.raises(ValueError, match="at least one replica.*HINT:"):
        ExpertLayout(((0,), (0,)), (((0, 0.5), (1, 0.5)), ()), (0.0, 0.0))


def test_relayout_random_loads_always_valid() -> None:
    """Random shapes and loads (zeros included, all slots filled): always a valid layout, never worse than
    plain EP where plain EP exists."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        k = int(rng.integers(1, 9))
        e = int(rng.integers(1, 17))
        spr = int(rng.integers(-(-e // k), e + 1))
        load = (rng.integers(0, 60, size=e) * (rng.random(e) < 0.7)).tolist()
        layout = plan_relayout(load, k, spr)
        _check_layout(layout, e, k, spr)
        if e % k == 0 and spr >= e // k:
            assert layout.imbalance <= ExpertLayout.static(e, k).with_load(load).imbalance + 1e-9
