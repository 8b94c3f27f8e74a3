"""Collective timeouts: one deadline for every process group, and an error that names who is missing.

Why this module exists:

* ``init_process_group(timeout=...)`` only sets the world group's deadline. The sub-groups that
  ``DeviceMesh`` creates (tp, dp, pp, flattened Ulysses groups) get the backend default -- 30 minutes
  for gloo in torch 2.13 -- so a stopped rank would hang the others three times longer than the user
  asked. :func:`set_mesh_timeout` puts the strategy's deadline on every group a mesh owns.
* gloo's own error ("Timed out waiting 600000ms for recv operation to complete") names neither the
  group nor the rank that never came. :func:`diagnose` turns it into a :class:`CollectiveTimeoutError`
  that does: the collective this rank was in (from torch's flight recorder: op, group description,
  group ranks, sequence number) and the ranks that never reported a timeout of their own. The
  second part is a small protocol over the rendezvous store: every rank whose collective times out
  writes what it was waiting in; a rank that is stopped (SIGSTOP), dead or stuck in user code writes
  nothing. Ranks that are merely waiting behind the culprit time out too and do report, so the silent
  ranks are the suspects. The exchange is bounded by ``grace`` seconds and never raises on its own.
"""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

DEFAULT_TIMEOUT = timedelta(minutes=10)
FLIGHT_RECORDER_ENTRIES = 256  # ring-buffer length; only the newest entries matter for a diagnosis
_PREFIX = "galv/timeout"
# gloo: "Timed out waiting 5000ms for recv operation to complete"; NCCL: "Watchdog caught collective
# operation timeout: WorkNCCL(...)" or, with blocking wait, "... WorkNCCL(...) timed out ...".
_TIMEOUT_RE = re.compile(r"Timed out waiting \d+ ?ms|collective operation timeout|WorkNCCL\(.*timed out")


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the strategy's timeout; the message names group and peers."""

    def __init__(self, message: str, *, rank: int, group: str | None, group_ranks: list[int] | None,
                 silent_ranks: list[int]) -> None:
        super().__init__(message)
        self.rank = rank
        self.group = group
        self.group_ranks = group_ranks
        self.silent_ranks = silent_ranks


def check_timeout(timeout: Any) -> timedelta:
    """Validate a user-given collective timeout (a positive ``timedelta`` or number of seconds)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (timedelta, int, float)):
        raise TypeError(f"timeout={timeout!r}: must be a datetime.timedelta or a number of seconds. "
                        "HINT: timeout=timedelta(minutes=10) (the default) or timeout=60.")
    td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if td.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout!r}: must be positive. "
                         "HINT: a collective that may never wait is not useful; use e.g. timedelta(seconds=30).")
    return td


def enable_flight_recorder() -> None:
    """Ask torch to record recent collectives (needed to name the group); must precede group creation.

    Respects a value the user set. The recorder keeps a fixed-size ring buffer per process, so the
    cost is a few microseconds per collective.
    """
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))


def set_group_timeout(group: Any, timeout: timedelta) -> None:
    """Give one process group ``timeout`` (torch only exposes this privately, hence the guard)."""
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is None:  # pragma: no cover - depends on the torch version
        return
    setter(timeout, group)


def set_mesh_timeout(mesh: Any, timeout: timedelta) -> None:
    """Give every process group of ``mesh`` (one per mesh dimension) ``timeout``."""
    for dim in range(mesh.ndim):
        set_group_timeout(mesh.get_group(dim), timeout)


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a backend's collective timeout (gloo: "Timed out waiting"; NCCL: watchdog)."""
    if isinstance(exc, CollectiveTimeoutError) or not isinstance(exc, RuntimeError):
        return False
    return bool(_TIMEOUT_RE.search(str(exc)))


def _group_by_name() -> dict[str, Any]:
    from torch.distributed import distributed_c10d as c10d

    return {name: pg for pg, name in c10d._world.pg_names.items()}


def pending_collective() -> dict[str, Any] | None:
    """The newest collective this rank issued, from torch's flight recorder (None if not recording).

    On CPU/gloo a collective blocks the caller, so the newest entry is the one that timed out.
    """
    import pickle

    import torch.distributed as dist

    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        entries = pickle.loads(_dump_fr_trace()).get("entries", [])
    except Exception:  # noqa: BLE001 - diagnosis is best effort; the original error is raised anyway
        return None
    if not entries:
        return None
    last = max(entries, key=lambda e: e.get("time_created_ns", 0))
    name, desc = (tuple(last.get("process_group", ("", ""))) + ("", ""))[:2]
    ranks: list[int] | None = None
    pg = _group_by_name().get(str(name))
    if pg is not None:
        try:
            ranks = dist.get_process_group_ranks(pg)
        except Exception:  # noqa: BLE001 - a group this rank is not part of
            ranks = None
    return {"op": last.get("profiling_name", "?"), "group": desc or f"group {name}", "ranks": ranks,
            "seq": last.get("collective_seq_id"), "sizes": last.get("input_sizes"), "where": _caller(last)}


def _caller(entry: dict[str, Any]) -> str | None:
    """The innermost recorded frame outside torch itself: who issued the collective."""
    for frame in entry.get("frames", []):
        path = str(frame.get("filename", ""))
        if "/torch/" not in path:
            return f"{frame.get('name')} ({os.path.basename(path)}:{frame.get('line')})"
    return None


def _describe(p: dict[str, Any] | None) -> str:
    if p is None:
        return "an unrecorded collective (set TORCH_FR_BUFFER_SIZE before the process group starts to record it)"
    ranks = f" (ranks {p['ranks']})" if p.get("ranks") is not None else ""
    where = f", called from {p['where']}" if p.get("where") else ""
    return f"{p['op']} #{p['seq']} on group '{p['group']}'{ranks}{where}"


def exchange_reports(rank: int, world: int, mine: dict[str, Any] | None, grace: float) -> dict[int, Any] | None:
    """Publish this rank's pending collective; collect the others' for up to ``grace`` seconds.

    Returns {rank: report} (this rank included), or None when the rendezvous store cannot be used
    (e.g. rank 0, which hosts it, is the stopped one).
    """
    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
        store.set_timeout(timedelta(seconds=max(grace, 1.0)))
        store.set(f"{_PREFIX}/{rank}", json.dumps(mine))
        reports: dict[int, Any] = {rank: mine}
        deadline = time.monotonic() + grace
        while len(reports) < world and time.monotonic() < deadline:
            for r in range(world):
                if r not in reports and store.check([f"{_PREFIX}/{r}"]):
                    reports[r] = json.loads(store.get(f"{_PREFIX}/{r}"))
            time.sleep(0.05)
        store.add(f"{_PREFIX}/read", 1)
        if rank == 0:  # the store lives in this process: keep it up until every reporter has read
            while int(store.add(f"{_PREFIX}/read", 0)) < len(reports) and time.monotonic() < deadline + grace:
                time.sleep(0.05)
        return reports
    except Exception:  # noqa: BLE001 - the store is part of what may have failed
        return None


def diagnose(exc: BaseException, timeout: timedelta | None, grace: float | None = None) -> CollectiveTimeoutError:
    """Build the named error for a collective timeout ``exc`` on this rank (collective across ranks).

    Ranks that time out call this too, so it waits up to ``grace`` seconds (default: the timeout,
    at most 60 s) for them to report; ranks that never report are named as the likely cause.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if grace is None:
        grace = min(timeout.total_seconds(), 60.0) if timeout is not None else 30.0
    mine = pending_collective()
    reports = exchange_reports(rank, world, mine, grace)
    after = f" after {timeout}" if timeout is not None else ""
    lines = [f"collective timed out{after} on rank {rank}: it was in {_describe(mine)}."]
    if reports is None:
        silent: list[int] = []
        lines.append("The rendezvous store (hosted by rank 0) did not answer, so rank 0 is probably the stopped "
                     "or crashed rank.")
    else:
        silent = [r for r in range(world) if r not in reports]
        group_ranks = (mine or {}).get("ranks") or []
        peers = [r for r in silent if r in group_ranks]
        if silent:
            who = f"rank {peers[0]}" if len(peers) == 1 else f"ranks {peers or silent}"
            lines.append(f"Waiting for {who}: ranks {silent} never reported a timeout of their own, so they are "
                         "stopped, crashed or stuck outside a collective.")
        else:
            lines.append("Every rank reported a timeout: the ranks are waiting in different collectives "
                         "(a mismatched collective order).")
        others = [f"rank {r}: {_describe(p)}" for r, p in sorted(reports.items()) if r != rank]
        if others:
            lines.append("Where the other ranks waited: " + "; ".join(others) + ".")
    first = silent[0] if silent else 0
    lines.append(f"HINT: read rank {first}'s log first; if a step legitimately takes longer (a slow first "
                 "checkpoint, a long evaluation), raise GalvatronStrategy(timeout=...).")
    return CollectiveTimeoutError(" ".join(lines), rank=rank, group=(mine or {}).get("group"),
                                  group_ranks=(mine or {}).get("ranks"), silent_ranks=silent)


@contextmanager
def naming_timeouts(timeout: timedelta | None) -> Iterator[None]:
    """Re-raise a backend collective timeout inside the block as a :class:`CollectiveTimeoutError`."""
    try:
        yield
    except RuntimeError as exc:
        if not is_collective_timeout(exc):
            raise
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise
        raise diagnose(exc, timeout) from exc
