"""The rank launcher: a rank forked from the server (``lightning_galv.forkserver``) must look like a fresh interpreter.

Every multi-process test, benchmark and tuner trial starts its ranks through ``run_distributed``; these checks
compare what a forked rank sees with what a fresh ``python -m lightning_galv.testing`` rank sees, and the
crash reports of both.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

from lightning_galv.forkserver import ForkServer, start_method
from lightning_galv.testing import RankCrashed, leftover_ranks, run_distributed

HERE = str(Path(__file__))


def _facts(tag: str) -> dict[str, Any]:
    """Runs in every rank: what a fresh process would have, and one collective."""
    import tempfile

    import numpy
    import torch
    import torch.distributed as dist
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle the rank made: its collector must still free it
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    print(f"rank {dist.get_rank()} says {tag}")  # no flush: the log must get it unbuffered
    return {"sum": t.item(), "lightning_rank": rank_zero_only.rank, "tmp": tempfile.gettempdir(),
            "cwd": os.getcwd(), "on_path": os.getcwd() in sys.path, "tag": os.environ.get("GALV_TEST_TAG"),
            "threads": torch.get_num_threads(), "numpy_draw": float(numpy.random.rand()),
            "main": sys.modules["__main__"].__spec__.name, "hash": hash("galv-launch"),
            "stdin": os.path.realpath("/proc/self/fd/0"), "pid": os.getpid(), "frozen": gc.get_freeze_count(),
            "cycle_freed": gone() is None}


def _crash(how: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("rank 1 going down")  # no flush: a rank's output is unbuffered, so even SIGKILL keeps it
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "interrupt":
            raise KeyboardInterrupt
        raise ValueError("rank 1 refuses on purpose")
    time.sleep(600)  # rank 0 waits: the launch must end at once when rank 1 dies


def _slow_abort() -> None:
    """Rank 1 dies of a signal a moment after rank 0 has exited with a Python error (as a peer does when the
    aborting rank's connection closes before the abort finishes)."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("rank 1 aborting slowly")
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    raise ConnectionError("rank 0: peer closed the connection")


@pytest.mark.distributed
def test_a_signal_death_is_blamed_over_a_peer_that_exited_first() -> None:
    """The tuner relaunches a trial only when a rank died of a signal before its first step; naming the first
    rank seen to exit (here rank 0, whose Python error is a consequence) made such a trial fail instead
    (tests/test_tuning.py::test_a_rank_killed_by_a_signal_before_its_first_step_is_relaunched_once, a CI run)."""
    with pytest.raises(RankCrashed) as e:
        run_distributed(HERE + "::_slow_abort", 2, (), timeout=120)
    assert e.value.rank == 1 and e.value.by_signal and "rank 1 aborting slowly" in e.value.own_log
    assert leftover_ranks() == 0


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["fork", "subprocess"])
def test_a_forked_rank_sees_what_a_fresh_interpreter_sees(method: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GALV_START_METHOD", method)
    work, scratch = tmp_path / "work", tmp_path / "scratch"
    work.mkdir()
    scratch.mkdir()
    monkeypatch.chdir(work)
    lines: list[str] = []
    res = run_distributed(HERE + "::_facts", 2, ("hello",), env={"GALV_TEST_TAG": method, "TMPDIR": str(scratch)},
                          threads=1, rank0_lines=lines.append)
    for rank, r in enumerate(res):
        assert r["sum"] == 3.0, r
        assert r["lightning_rank"] == rank, r  # Lightning reads the rank at import time: not the server's
        assert r["tmp"] == str(scratch), r  # tempfile caches its folder: not the server's
        assert r["cwd"] == str(work) and r["on_path"], r  # python -m puts the working folder on the path
        assert r["tag"] == method and r["threads"] == 1, r
        assert r["main"] == "lightning_galv.testing", r
        assert r["cycle_freed"], r
        if method == "fork":
            assert r["stdin"] == "/dev/null", r  # not the server's pipe to its client
            # the server's imports are frozen out of the collector's walk (torch + Lightning: ~450k objects)
            assert r["frozen"] > 100_000, r
        else:
            assert r["frozen"] == 0, r
    # each rank its own string-hash seed (sets of strings iterate differently on each rank, as under torchrun)
    if "PYTHONHASHSEED" in os.environ:
        assert res[0]["hash"] == res[1]["hash"]
    else:
        assert res[0]["hash"] != res[1]["hash"]
    assert "rank 0 says hello" in lines, lines
    # numpy is seeded per process: rank 0 of the next launch (a new fork of the same server) draws anew
    again = run_distributed(HERE + "::_facts", 2, ("again",), env={"GALV_TEST_TAG": method, "TMPDIR": str(scratch)},
                            threads=1)
    assert again[0]["pid"] != res[0]["pid"] and again[0]["numpy_draw"] != res[0]["numpy_draw"]


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["fork", "subprocess"])
@pytest.mark.parametrize("how", ["exception", "signal", "interrupt"])
def test_a_crashed_rank_ends_the_launch_with_its_exit_code_and_traceback(method: str, how: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GALV_START_METHOD", method)
    t0 = time.monotonic()
    with pytest.raises(RankCrashed) as e:
        run_distributed(HERE + "::_crash", 2, (how,), timeout=500)
    assert e.value.rank == 1 and "rank 1 going down" in e.value.own_log
    if how == "signal":
        assert e.value.returncode == -signal.SIGKILL and e.value.by_signal and "killed by SIGKILL" in str(e.value)
    elif how == "interrupt":  # an unhandled Ctrl-C ends a Python process by SIGINT
        assert e.value.returncode == -signal.SIGINT and "KeyboardInterrupt" in e.value.own_log
    else:
        assert e.value.returncode == 1 and "ValueError: rank 1 refuses on purpose" in e.value.own_log
    assert time.monotonic() - t0 < 300, "rank 0's 600 s sleep was waited for"
    assert leftover_ranks() == 0


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, not yet reaped by whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def _kill_my_server(pid_file: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        Path(pid_file).write_text(str(os.getpid()))
        os.kill(os.getppid(), signal.SIGKILL)  # the fork server this rank came from
    time.sleep(600)


@pytest.mark.distributed
def test_a_fork_server_that_dies_ends_the_launch_at_once_with_a_hint(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GALV_START_METHOD", "fork")
    t0 = time.monotonic()
    pid_file = tmp_path / "rank1.pid"
    with pytest.raises(RuntimeError, match="(?s)fork server of rank 1 .* died.*HINT: set GALV_START_METHOD=subprocess"):
        run_distributed(HERE + "::_kill_my_server", 2, (str(pid_file),), timeout=500)
    assert time.monotonic() - t0 < 300, "the launch waited for its timeout or for rank 0's sleep"
    rank1 = int(pid_file.read_text())
    for _ in range(100):  # the rank died with its server (PR_SET_PDEATHSIG), it did not run on as an orphan
        if _gone(rank1):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"rank 1 (pid {rank1}) outlived its fork server")
    assert leftover_ranks() == 0
    assert run_distributed(HERE + "::_facts", 2, ("again",))[1]["sum"] == 3.0  # a new server takes over


def test_the_start_method_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GALV_START_METHOD", "spawn")
    with pytest.raises(ValueError, match="GALV_START_METHOD='spawn'.*HINT"):
        start_method()
    monkeypatch.delenv("GALV_START_METHOD")
    assert start_method() == "fork"


def test_the_server_reports_exits_ignores_ctrl_c_and_leaves_when_its_client_closes(tmp_path: Path) -> None:
    server = ForkServer(dict(os.environ), preload=())  # nothing preloaded: this checks the protocol, not the speed
    server.wait_ready(60)
    os.kill(server.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the whole process group
    log = tmp_path / "child.log"
    ok = server.start("json.tool", ["--help"], dict(os.environ), str(tmp_path), str(log))
    bad = server.start("json.tool", [str(tmp_path / "missing.json")], dict(os.environ), str(tmp_path), str(log))
    assert ok.wait(timeout=60) == 0 and bad.wait(timeout=60) != 0
    assert "usage" in log.read_text() and "missing.json" in log.read_text()
    server._proc.stdin.close()  # the client goes away: the server must leave by itself (close() would kill it)
    assert server._proc.wait(timeout=30) == 0
