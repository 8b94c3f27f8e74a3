"""Launch N gloo ranks on this machine and collect what each returns.

Used by the test suite and the benchmarks: one launch runs several checks (start-up dominates the
cost of a launch on CPU), every rank has a timeout, and a failing rank brings the launch down at once
with its traceback instead of leaving the others hanging in a collective.

``target`` is ``"path/to/file.py::function"`` (or ``"package.module:function"``); the function is called
in every rank as ``fn(*args)`` and its return value (anything ``torch.save`` can store) is returned to
the caller in rank order.
"""

from __future__ import annotations

import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Collection

from .plan import SCHEDULES, SP_MODES, LayerStrategy, ModelShape, ParallelPlan, divisors


class RankCrashed(RuntimeError):
    """A rank exited abnormally; ``returncode`` < 0 means a signal killed it (a C++ abort, a segfault)."""

    def __init__(self, message: str, *, rank: int, returncode: int, own_log: str = "") -> None:
        super().__init__(message)
        self.rank, self.returncode, self.own_log = rank, returncode, own_log  # own_log: the dead rank's log tail

    @property
    def by_signal(self) -> bool:
        return self.returncode < 0


def _signal_name(code: int) -> str:
    import signal

    if code >= 0:
        return ""
    try:
        return f", killed by {signal.Signals(-code).name}"
    except ValueError:
        return f", killed by signal {-code}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(target: str, world_size: int, args: tuple = (), *, timeout: float = 600.0,
                    init_process_group: bool = True, env: dict[str, str] | None = None,
                    threads: int = 1, may_die: Collection[int] = (), poll: Callable[[], None] | None = None,
                    log_tail: list[str] | None = None, rank0_lines: Callable[[str], None] | None = None,
                    rank_logs: list[str] | None = None) -> list[Any]:
    """Run ``target(*args)`` on ``world_size`` ranks (separate processes, gloo) and return results.

    ``init_process_group=False`` leaves process-group creation to the function (a Lightning Trainer
    does it itself from the same environment variables torchrun would set). Ranks in ``may_die`` may
    exit abnormally (a failure test kills them on purpose): their result is None and the others run on.
    ``poll`` is called while the ranks run; if it raises (the tuner's pruner does), every rank is killed
    and the exception propagates. ``log_tail``, if given, receives the ranks' log tails (also on failure).
    ``rank0_lines``, if given, is called with each complete line rank 0 writes while the ranks run (the
    CLI shows profiling progress so). ``rank_logs``, if given, receives every rank's whole log (stdout and
    stderr), in rank order, once the ranks are done (also on failure).

    The ranks are forks of a server process that has torch and Lightning imported (``lightning_galv.forkserver``:
    a fresh ``import lightning`` costs seconds per rank); ``GALV_START_METHOD=subprocess`` starts each rank as a
    fresh interpreter instead (``python -m lightning_galv.testing``, what the forked rank also runs).
    """
    import torch

    from .forkserver import ForkedProcess, servers_for, start_method

    with tempfile.TemporaryDirectory(prefix="galv_launch_") as tmp:
        torch.save(args, Path(tmp) / "args.pt")
        port = free_port()
        envs = []
        for rank in range(world_size):
            penv = {**os.environ, **(env or {})}
            penv.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                        RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                        NODE_RANK="0", OMP_NUM_THREADS=str(threads), GALV_TEST_THREADS=str(threads),
                        PYTHONUNBUFFERED="1")
            envs.append(penv)
        # forks of servers that have torch and Lightning imported, one per rank slot (see forkserver.py)
        servers = servers_for(envs[0], world_size, poll=poll) if start_method() == "fork" else None
        procs: list[subprocess.Popen | ForkedProcess] = []
        logs = []
        failed: int | None = None
        follow = _LineFollower(Path(tmp) / "rank0.log", rank0_lines) if rank0_lines is not None else None
        try:
            for rank in range(world_size):
                log = open(Path(tmp) / f"rank{rank}.log", "w+")
                logs.append(log)
                argv = [target, tmp, str(int(init_process_group))]
                if servers is not None:
                    procs.append(servers[rank].start("lightning_galv.testing", argv, envs[rank], os.getcwd(),
                                                     log.name))
                else:
                    procs.append(subprocess.Popen([sys.executable, "-m", "lightning_galv.testing", *argv],
                                                  env=envs[rank], stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            while True:
                if follow is not None:
                    follow.read()
                codes = [p.poll() for p in procs]
                gone = [r for r, p in enumerate(procs) if isinstance(p, ForkedProcess) and p.server_died]
                if gone:
                    raise RuntimeError(f"the fork server of rank {gone[0]} of {target} died during the launch (its "
                                       f"ranks with it).\n{_tails(logs)}\nHINT: set GALV_START_METHOD=subprocess "
                                       "to start ranks as fresh interpreters.")
                bad = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in may_die]
                if bad:
                    failed = _culprit(procs, may_die)
                    break
                if all(c == 0 or (c is not None and r in may_die) for r, c in enumerate(codes)):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed launch of {target} on {world_size} ranks exceeded "
                                       f"{timeout:.0f}s.\n{_tails(logs)}")
                if poll is not None:
                    poll()
                time.sleep(0.05)
        finally:
            if follow is not None:
                follow.read()  # what rank 0 wrote since the last poll
            if log_tail is not None:
                log_tail.append(_tails(logs, chars=3000))
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            if rank_logs is not None:
                rank_logs.extend(Path(log.name).read_text(errors="replace") for log in logs)
        if failed is not None:
            code = procs[failed].returncode
            raise RankCrashed(f"rank {failed} of {target} failed (exit {code}{_signal_name(code)}).\n"
                              f"{_tails(logs, first=failed)}", rank=failed, returncode=code,
                              own_log=_tails(logs[failed:failed + 1]))
        results = [None if procs[r].returncode and r in may_die else
                   torch.load(Path(tmp) / f"result{r}.pt", weights_only=False) for r in range(world_size)]
        for log in logs:
            log.close()
        return results


def _culprit(procs: list[Any], may_die: Collection[int], grace_s: float = 2.0) -> int:
    """The rank to blame once one has failed: give the others ``grace_s`` to exit too, then prefer a rank a
    signal killed (an abort, a segfault) over ranks that raised because that peer vanished.

    Why: a rank dying of SIGABRT can take longer to go (the abort handler, a core dump) than its peer takes to
    see the closed connection and exit with a Python error; naming the first exit seen then blamed the peer,
    and the tuner, which relaunches only signal deaths before the first step, failed a trial it should have
    relaunched.
    """
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    codes = [p.poll() for p in procs]
    bad = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in may_die]
    by_signal = [r for r in bad if codes[r] < 0]
    return (by_signal or bad)[0]


class _LineFollower:
    """Hands the complete lines appended to a log file to a callback (``tail -f`` for rank 0's log)."""

    def __init__(self, path: Path, emit: Callable[[str], None]) -> None:
        self.path, self.emit, self.offset, self.partial = path, emit, 0, ""

    def read(self) -> None:
        with open(self.path, errors="replace") as f:
            f.seek(self.offset)
            text = f.read()
            self.offset = f.tell()
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self.emit(line)


def leftover_ranks() -> int:
    """Rank processes this process started that are still alive after their launches ended: descendants running
    ``lightning_galv.testing`` (fresh-interpreter ranks) or forked from a fork server (whose command line they
    keep, one level below it). Linux only (reads ``/proc``); a launch must never leave any behind."""
    parent: dict[int, int] = {}
    cmd: dict[int, bytes] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            parent[int(d.name)] = int(stat[stat.rindex(")") + 2:].split()[1])  # field 4, after "(comm) state"
            cmd[int(d.name)] = (d / "cmdline").read_bytes()
        except (OSError, ValueError):
            pass  # exited meanwhile
    me, n = os.getpid(), 0
    for pid, c in cmd.items():
        chain, p = [], parent.get(pid)
        while p and p not in chain and p != me:
            chain.append(p)
            p = parent.get(p)
        if p != me:
            continue  # not a descendant of this process
        forked = b"lightning_galv.forkserver" in c and parent.get(pid) != me  # a server's child, not a server
        n += forked or b"lightning_galv.testing" in c
    return n


def _tails(logs: list, first: int | None = None, chars: int = 6000) -> str:
    order = list(range(len(logs)))
    if first is not None:
        order.remove(first)
        order.insert(0, first)
    out = []
    for r in order:
        logs[r].flush()
        logs[r].seek(0)
        text = logs[r].read()
        out.append(f"----- rank {r} -----\n{text[-chars:]}")
    return "\n".join(out)


def _resolve(target: str) -> Callable[..., Any]:
    import importlib
    import importlib.util

    if "::" in target:
        path, name = target.split("::")
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"target={target!r}: {path!r} is not a Python file that can be loaded. HINT: give "
                             "'/path/to/file.py::function' (a file path) or 'package.module:function'.")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        sys.path.insert(0, str(Path(path).parent))
        spec.loader.exec_module(module)
    else:
        mod_name, name = target.split(":")
        module = importlib.import_module(mod_name)
    return getattr(module, name)


def _worker(target: str, tmp: str, init_pg: bool) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("GALV_TEST_THREADS", "1")))
    rank = int(os.environ["RANK"])
    if init_pg:
        dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    fn = _resolve(target)
    args = torch.load(Path(tmp) / "args.pt", weights_only=False)
    result = fn(*args)
    torch.save(result, Path(tmp) / f"result{rank}.pt")
    if dist.is_initialized():
        dist.barrier()  # every rank is past its last collective


def release_subgroups() -> int:
    """Destroy every process group but WORLD, and the DTensor caches that still point at them.

    Why: each gloo group owns a transport thread that polls every few milliseconds even when idle, and
    torch keeps every DeviceMesh it has seen alive in its DTensor caches (sharding propagation, the
    redistribute planner, mesh topology). A launch that runs forty checks would otherwise end with about a
    thousand threads and spend most of a core polling sockets, so late checks ran 3-5x slower than alone.
    A destroyed group's threads end only when its C++ object is freed, i.e. once no cached mesh holds it.
    Call it between checks, after a barrier, on every rank: destroying a group is collective in spirit (no
    rank may still use it). Returns how many groups it destroyed.
    """
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from .layout import clear_dtensor_caches

    world = dist.group.WORLD
    groups = [pg for pg in list(c10d._world.pg_map) if pg is not world]
    # drain first: a gloo barrier completes only after every earlier operation of its group has, so no work a check
    # launched and never waited for (an async collective, a prefetch) still runs in a group's worker thread when
    # the group is destroyed and freed -- a fresh-clone CI run at b9e0846 lost rank 0 to "double free or corruption"
    # right there, between two checks. Every rank meets its groups in creation order, the same on all ranks, so
    # the barriers cannot wait on each other in a cycle.
    for pg in groups:
        dist.barrier(group=pg)
    for pg in groups:
        dist.destroy_process_group(pg)
    clear_dtensor_caches()
    gc.collect()  # the finished checks' models and meshes, and with them the groups' C++ objects and threads
    return len(groups)


def assert_matches_one_process(rank: int, name: str, r: dict[str, Any], tol: float) -> None:
    """One rank's report of a parity case (``tests/dist_runtime_checks.py``) against the single-process run:
    losses, final weights, the total gradient norm and the first-step gradient of every parameter, gathered
    to full (pipelines report weights only: a stage holds its own layers), each within ``tol``."""
    assert r["loss_err"] < tol, (rank, name, r["loss_err"], r["losses"], r["ref_losses"])
    assert r["weight_err"] < tol, (rank, name, r["weight_err"], r["worst"])
    assert r["norm_err"] < tol, (rank, name, r["norm_err"])
    bad = {k: e for k, e in r["grad_err"].items() if not e < tol}
    assert not bad, (rank, name, bad)


def count_refused(parts: Any, plans: Collection[ParallelPlan]) -> int:
    """How many of ``plans`` the model's own plan check (``ModelParts.check_plan``) refuses: auto-mode tests
    assert the search offers none of them once the model's limits are known."""
    n = 0
    for p in plans:
        try:
            parts.check_plan(p)
        except ValueError:
            n += 1
    return n


def random_strategy(rng: random.Random, width: int, *, edge: bool = False) -> LayerStrategy:
    """A random valid factorization of ``width`` ranks with random sp / ZeRO / checkpointing / grouping.

    ``edge``: for the embedding or head (no Ulysses, no activation checkpointing there).
    """
    tp = rng.choice(divisors(width))
    dp = width // tp
    sp = "none"
    if tp > 1 and not edge:
        sp = rng.choice(SP_MODES)
    return LayerStrategy(tp=tp, dp=dp, sp=sp, zero=rng.randrange(4), checkpoint=(not edge) and rng.random() < 0.3,
                         tp_consecutive=tp == 1 or dp == 1 or rng.random() < 0.6)


def random_plan(rng: random.Random, world_size: int, shape: ModelShape, *, pp_choices: tuple[int, ...] = (1, 2),
                micro_batch_choices: tuple[int, ...] = (2, 4), max_tries: int = 1000,
                moe_layers: tuple[int, ...] = (), num_experts: int = 4) -> ParallelPlan:
    """A seeded random *valid* heterogeneous plan for a model of ``shape`` (rejection sampling).

    Draws every plan dimension the runtime supports: pp (with schedule, micro-batches and an uneven
    division), per-layer tp / dp / sp / ZeRO / checkpointing / strided-vs-consecutive groups, and the
    embedding and head strategies; the global batch is the smallest multiple of the plan's batch unit
    that is at least ``2 * data_parallel_size`` (so every shard sees two samples or more); a vocab-parallel
    head computes its loss on vocab-sharded logits half of the time. Plans the
    model cannot take (``ParallelPlan.check_model``) are redrawn. The MoE layers ``moe_layers`` (of
    ``num_experts`` experts) also draw an expert-parallel degree among those their data group allows.
    """
    from dataclasses import replace

    for _ in range(max_tries):
        pp = rng.choice([p for p in pp_choices if world_size % p == 0 and shape.num_layers >= p])
        stage = world_size // pp
        kwargs: dict[str, Any] = {"pp": pp}
        if pp > 1:
            kwargs["micro_batches"] = m = rng.choice(micro_batch_choices)
            kwargs["pipeline_schedule"] = rng.choice([s for s in SCHEDULES if s != "interleaved_1f1b"
                                                      and (s == "gpipe" or m >= pp)])
            cuts = sorted(rng.sample(range(1, shape.num_layers), pp - 1))
            bounds = [0, *cuts, shape.num_layers]
            kwargs["pp_division"] = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        layers = tuple(random_strategy(rng, stage) for _ in range(shape.num_layers))
        layers = tuple(replace(s, ep=rng.choice([d for d in divisors(s.data_group) if num_experts % d == 0]))
                       if i in moe_layers else s for i, s in enumerate(layers))
        try:
            plan = ParallelPlan(world_size, layers, embed=random_strategy(rng, stage, edge=True),
                                head=random_strategy(rng, stage, edge=True), **kwargs)
            plan.check_model(shape)
        except ValueError:
            continue
        unit = plan.batch_unit
        vocab_loss = plan.head is not None and plan.head.tp > 1 and rng.random() < 0.5
        return plan.with_(global_batch=unit * math.ceil(2 * plan.data_parallel_size / unit),
                          vocab_parallel_loss=vocab_loss)
    raise ValueError(f"no valid plan for world_size={world_size}, shape={shape} in {max_tries} draws. "
                     "HINT: the model's heads / ffn / sequence must be divisible by some tp > 1, or use pp_choices=(1,).")


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], bool(int(sys.argv[3])))
    # Leave without tearing the process group and interpreter down: gloo's threads sometimes abort the
    # process in their destructors ("terminate called without an active exception", exit -6) after the
    # result was written -- seen in CI in tuner trials and profiling launches. The result file and the
    # barrier above are the contract; the OS closes the sockets.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
