"""Failures are seen on every rank (issue 9 item 9): a rank-0-only decision that fails is raised everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_galv.testing import run_distributed

LIGHTNING = str(Path(__file__).parent / "dist_lightning_checks.py")


@pytest.mark.slow
@pytest.mark.distributed
def test_infeasible_auto_budget_raises_the_same_value_error_on_every_rank() -> None:
    results = run_distributed(LIGHTNING + "::fit_infeasible_budget", 2, ("1KB",), init_process_group=False,
                              timeout=300)
    assert [r["type"] for r in results] == ["ValueError", "ValueError"], results
    assert results[0]["message"] == results[1]["message"], results
    msg = results[0]["message"]
    assert "memory_budget=1000 bytes" in msg and "no plan fits" in msg and "HINT:" in msg, msg


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stopped_rank_fails_every_other_rank_with_its_name_within_the_timeout(tmp_path: Path) -> None:
    """Issue 9 item 9: SIGSTOP one rank mid-step; the others must not hang for gloo's 30-minute default.

    tp=2 x dp=2 on 4 ranks, rank 3 stops at the start of a step: rank 2 waits for it in their tp group,
    ranks 0 and 1 finish their forward and wait in the loss logging's world barrier. Every waiting rank
    must raise CollectiveTimeoutError naming the group it waited in and rank 3 as the rank that never came.
    """
    timeout = 8.0
    plan = {"world_size": 4, "layers": [{"tp": 2, "dp": 2}] * 3, "embed": {"tp": 2, "dp": 2},
            "head": {"tp": 2, "dp": 2}}
    # no TORCH_FR_BUFFER_SIZE here: the strategy sets it before its first collective (the launcher's process group
    # already exists then, so this also checks that the recorder is sized at its first use, not at group creation)
    results = run_distributed(LIGHTNING + "::fit_stopped_rank", 4, (plan, str(tmp_path), 3, timeout),
                              may_die={3}, timeout=300)
    assert results[3] is None  # killed by rank 0 after the diagnosis
    for rank, r in enumerate(results[:3]):
        assert r["type"] == "CollectiveTimeoutError", (rank, r)
        assert r["silent"] == [3], (rank, r)
        assert "Timed out waiting" in r["cause"], (rank, r)  # the backend's error is kept as __cause__
        assert f"on rank {rank}" in r["message"] and "HINT:" in r["message"], r["message"]
        assert "rank 3" in r["message"], r["message"]
        # bounded: the strategy's timeout (not gloo's 30 minutes) plus the report exchange (<= timeout)
        assert r["elapsed"] < 120, (rank, r["elapsed"])
    assert results[2]["group_ranks"] == [2, 3], results[2]  # rank 2's tp peer is the stopped rank
    for rank, r in enumerate(results[:3]):
        assert rank in r["group_ranks"] and "called from" in r["message"], r  # group and caller are named
    assert "(ranks [2, 3])" in results[2]["message"], results[2]["message"]


def test_timeout_argument_is_validated_and_backend_timeouts_are_recognized() -> None:
    from datetime import timedelta

    from lightning_galv import GalvatronStrategy
    from lightning_galv.parallel.timeouts import CollectiveTimeoutError, check_timeout, is_collective_timeout

    assert check_timeout(30) == timedelta(seconds=30)
    assert check_timeout(timedelta(minutes=2)) == timedelta(minutes=2)
    with pytest.raises(ValueError, match=r"timeout=0: must be positive.*HINT:"):
        GalvatronStrategy(tp=1, timeout=0)
    with pytest.raises(TypeError, match=r"timeout='10m'.*HINT:"):
        GalvatronStrategy(tp=1, timeout="10m")
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")
    nccl = RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)")
    assert is_collective_timeout(gloo) and is_collective_timeout(nccl)
    assert not is_collective_timeout(RuntimeError("DataLoader worker (pid 12) timed out after 5 seconds"))
    assert not is_collective_timeout(ValueError("Timed out waiting 3000ms"))  # only backend RuntimeErrors
    named = CollectiveTimeoutError("x", rank=0, group="mesh_tp", group_ranks=[0, 1], silent_ranks=[1])
    assert not is_collective_timeout(named)  # never diagnosed twice when entry points nest


def test_a_target_that_is_not_a_loadable_file_is_a_value_error_with_a_hint() -> None:
    """The launcher's ``path::function`` target must name a file (a module name there once failed a bare assert)."""
    from lightning_galv.testing import _resolve

    with pytest.raises(ValueError, match=r"target='perstep::run'.*HINT: give '/path/to/file.py::function'"):
        _resolve("perstep::run")
