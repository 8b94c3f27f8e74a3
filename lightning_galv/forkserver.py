"""Start rank processes by forking servers that have imported torch and Lightning once.

Why: ``run_distributed`` (the tests, the benchmarks, the tuner's trials, ``galv profile``) starts every rank
as a new process, and on a slow 2-core machine a fresh ``import lightning`` costs ~11 s of CPU (5 of them
torchmetrics pulling in transformers and scipy), ``import torch`` with its distributed package ~5 s. With 4
ranks on 2 cores that is 10-25 s of wall time per launch before any work, paid again in every trial of a
study. A fork of a process that already holds those modules starts in milliseconds.

Why servers of our own rather than ``multiprocessing``'s forkserver: that one re-runs the parent's main
script (as ``__mp_main__``) in every child, so a user's tuning script without an ``if __name__ ==
"__main__"`` guard would start itself again in every trial. These servers only ever run the equivalent of
``python -m <module> <args>``, exactly what the subprocess launch runs.

Fidelity to fresh interpreters, and where it stops:

- **One server per rank slot and environment** (:func:`servers_for`). Rank ``r`` of a launch forks from slot
  ``r``'s server (ranks beyond the eighth share the last slot's), and each slot's server has its own
  string-hash seed (``PYTHONHASHSEED``, unless the user fixed one; kept for the server's life, where fresh
  interpreters draw one per launch): ranks iterate sets of strings in different orders, as torchrun's ranks
  do, so code that issues collectives in set order still fails in tests. A server is started in the launch's environment (without
  the per-rank variables), and launches whose environments differ in anything but those variables,
  ``TMPDIR`` (``tempfile``'s cache is cleared, below) and ``GALV_*`` (read when used) get servers of their own -- so settings torch and
  its libraries read once at import (``TORCH_DISTRIBUTED_DEBUG``, ``TORCH_LOGS``, ``OMP_NUM_THREADS`` for
  OpenMP/OpenBLAS, ``PYTHONPATH``) are the launch's. At most :data:`MAX_SERVERS` live at once.
- **In the child** (:func:`_become_fresh`): the launch's environment, working folder (also first on
  ``sys.path``, as ``python -m`` puts it), ``sys.argv``, output to the rank's log unbuffered, ``tempfile``'s
  cached folder cleared, numpy's global random state re-seeded from the OS (Python's ``random`` re-seeds
  itself after a fork), and the import-time rank of Lightning's and torchmetrics' ``rank_zero_only``.
- **Not fresh**: the objects the server's imports made are frozen (``gc.freeze``: a collection in a child
  does not walk them, and any cycle among them is never freed, where a fresh interpreter's collector walks
  and could free them); ``/proc/<pid>/cmdline`` shows the server's command; paths a preloaded module derived from
  ``TMPDIR`` at import stay the server's (``tempfile.gettempdir()`` itself is recomputed); modules imported by the server are
  those of the server's start (edit the package in a notebook, and ranks run the old code until the server
  restarts); on CPU the resident-set peak (``VmHWM``) counts the server's heap from the start but only the
  library code pages the rank touches, where a fresh interpreter also counts those its imports touched.

A server's Python code is single-threaded and it never runs a torch op, so no OpenMP pool or CUDA context is
inherited. It
ignores Ctrl-C (the ranks and the client get it; a rank stopped by it exits by SIGINT, as a fresh one does),
kills a child only while it has not reaped it (no pid-reuse races), and its children die with it
(``PR_SET_PDEATHSIG`` on Linux); it exits when its client closes its stdin or dies.

Protocol, one JSON object per line: the server first writes ``{"ready"}`` once its imports are done; the client writes ``{"id", "module", "args", "env", "cwd", "log"}`` or
``{"kill": id}``; the server answers ``{"id", "pid"}`` (or ``{"id", "error"}``) and later ``{"id",
"returncode"}`` when that child exits (``-N`` for signal N, as ``subprocess`` reports it).
"""

from __future__ import annotations

import gc
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

PRELOAD = ("torch", "torch.distributed", "lightning")  # what every rank of this package's launches imports
READY = "galv-forkserver-ready"
MAX_SERVERS = 8  # idle servers hold ~450 MB each (mostly shared with their children)
# set per rank or per launch by run_distributed, or read when used (not at import): not part of a server's key
PER_LAUNCH = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "NODE_RANK", "GROUP_RANK", "TMPDIR", "PWD", "OLDPWD",
                        "PYTEST_CURRENT_TEST"})  # pytest sets it per test


# ---------------------------------------------------------------------------------------------------- server side
_PROTOCOL_FD = -1  # the server's end of the pipe to its client; closed in every child


def _become_fresh(req: dict[str, Any]) -> None:
    """In a forked child: take on the launch's environment, folder, argv and output (see the module docstring)."""
    import io
    import tempfile

    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    # unbuffered, as PYTHONUNBUFFERED=1 makes a fresh interpreter's: a killed rank loses no output
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True,
                                  errors="surrogateescape")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True,
                                  errors="backslashreplace")
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.path[0] = req["cwd"]  # python -m puts the working folder first (the server's was its own start folder)
    sys.argv = [req["module"], *req["args"]]
    tempfile.tempdir = None  # recomputed from this environment's TMPDIR on first use
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    rank = next((os.environ[k] for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
                 if k in os.environ), "0")
    for name in ("lightning_utilities.core.rank_zero", "torchmetrics.utilities.prints"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "rank_zero_only"):  # what they computed from the environment at import
            mod.rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", 0)) if "torchmetrics" in name else int(rank)


def _die_with_parent(server_pid: int) -> None:
    """Linux: the kernel kills this process when the server exits (ranks never outlive their supervisor)."""
    if sys.platform == "linux":
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != server_pid:  # the server died between fork and prctl (reparented)
            os._exit(1)


def _run_child(req: dict[str, Any], server_pid: int) -> None:
    """In a forked child: run the module as ``__main__`` and leave without returning to the server's loop."""
    import runpy
    import traceback

    code = 0
    interrupted = False
    try:
        os.close(_PROTOCOL_FD)  # the client must see EOF when the server exits
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it; a rank does not
        _die_with_parent(server_pid)
        _become_fresh(req)
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 -- a rank's error must reach its log and its exit code, as in python -m
        traceback.print_exc()
        code = 1
    finally:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:  # noqa: BLE001
                pass
        if interrupted:  # as a fresh interpreter ends on an unhandled Ctrl-C: killed by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _serve(preload: list[str]) -> None:
    """The server's loop: fork a child per request, report each child's exit; single-threaded by design."""
    global _PROTOCOL_FD
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the client and the ranks, not the supervisor
    _PROTOCOL_FD = os.dup(1)  # the protocol gets a private copy of stdout ...
    os.dup2(2, 1)  # ... and what the imports print goes to stderr, not into the protocol
    out = os.fdopen(_PROTOCOL_FD, "w", buffering=1, closefd=False)
    for name in preload:
        try:
            __import__(name)
        except ImportError:
            pass  # a module this environment lacks: children import what they need themselves
    # the imports' objects live as long as any child: freeze them out of the collector's reach, so a full
    # collection in a child walks only what the child made (with torch, Lightning and what they pull in, ~450k
    # objects: 0.2-0.5 s per gc.collect() on a 2-core VM, and a test launch collects between every check)
    gc.collect()
    gc.freeze()

    def send(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    send({"ready": READY})
    buf = b""
    children: dict[int, int] = {}  # pid -> request id, until reaped
    while True:
        ready, _, _ = select.select([0], [], [], 0.02)
        while children:  # reap every child that has exited
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in children:
                send({"id": children.pop(pid), "returncode": os.waitstatus_to_exitcode(status)})
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the client is gone: so is the server, and with it (PDEATHSIG) its children
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if "kill" in req:
                for pid, rid in children.items():
                    if rid == req["kill"]:  # not reaped yet: the pid is still this child's
                        os.kill(pid, signal.SIGKILL)
                continue
            me = os.getpid()
            try:
                pid = os.fork()
            except OSError as e:
                send({"id": req["id"], "error": f"fork failed: {e}"})
                continue
            if pid == 0:
                _run_child(req, me)  # never returns
            children[pid] = req["id"]
            send({"id": req["id"], "pid": pid})


# ---------------------------------------------------------------------------------------------------- client side
class ForkedProcess:
    """The parent's handle on one forked rank, with the part of ``subprocess.Popen``'s interface a launch uses."""

    def __init__(self, server: ForkServer, rid: int, pid: int) -> None:
        self._server, self._rid, self.pid = server, rid, pid
        self.returncode: int | None = None

    @property
    def server_died(self) -> bool:
        """The server exited before reporting this child's exit (the child died with it)."""
        return self.returncode is not None and self._server._exit_code(self._rid) is None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._exit_code(self._rid)
            if self.returncode is None and not self._server.alive():
                self._server._reader.join(5.0)  # exits the server reported just before it ended
                self.returncode = self._server._exit_code(self._rid)
                if self.returncode is None:
                    self.returncode = -signal.SIGKILL  # PR_SET_PDEATHSIG: its children die with the server
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            self._server._kill(self._rid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return self.returncode


class ForkServer:
    """One server process (see the module docstring); :func:`servers_for` starts and reuses them."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = PRELOAD) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "lightning_galv.forkserver", *preload], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pid = self._proc.pid
        self._lock = threading.Lock()  # one request at a time
        self._cond = threading.Condition()
        self._ready = False
        self._pids: dict[int, int] = {}  # request id -> pid
        self._errors: dict[int, str] = {}
        self._exits: dict[int, int] = {}  # request id -> returncode
        self._running: set[int] = set()  # request ids started and not yet reported as exited
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="galv-forkserver-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for raw in self._proc.stdout:
                msg = json.loads(raw)
                with self._cond:
                    if msg.get("ready") == READY:
                        self._ready = True
                    elif "returncode" in msg:
                        self._exits[msg["id"]] = msg["returncode"]
                        self._running.discard(msg["id"])
                    elif "pid" in msg:
                        self._pids[msg["id"]] = msg["pid"]
                    else:
                        self._errors[msg["id"]] = msg["error"]
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._cond.notify_all()

    def wait_ready(self, timeout: float, poll: Callable[[], None] | None = None) -> None:
        """Block until the server has imported its modules (``poll`` is called meanwhile, as a launch does)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                if self._ready:
                    return
                if not self.alive():
                    break
                self._cond.wait(0.2)
            if poll is not None:
                poll()
            if time.monotonic() > deadline:
                break
        self.close()
        raise RuntimeError(f"the fork server did not start within {timeout:.0f}s (exit {self._proc.poll()}). "
                           "HINT: set GALV_START_METHOD=subprocess to start ranks as fresh interpreters.")

    def alive(self) -> bool:
        return self._proc.poll() is None and self._reader.is_alive()

    def running(self) -> int:
        """How many children this server started and has not yet seen exit."""
        with self._cond:
            return len(self._running)

    def _exit_code(self, rid: int) -> int | None:
        with self._cond:
            return self._exits.get(rid)

    def _send(self, msg: dict[str, Any]) -> None:
        self._proc.stdin.write(json.dumps(msg) + "\n")
        self._proc.stdin.flush()

    def _kill(self, rid: int) -> None:
        with self._lock:
            if self.alive():
                try:
                    self._send({"kill": rid})
                except (BrokenPipeError, OSError):
                    pass

    def start(self, module: str, args: list[str], env: dict[str, str], cwd: str, log: str,
              timeout: float = 120.0) -> ForkedProcess:
        """Fork a child that runs ``python -m module *args`` in ``env`` and ``cwd``, output appended to ``log``."""
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            with self._cond:
                self._running.add(rid)
            hint = "HINT: set GALV_START_METHOD=subprocess to start ranks as fresh interpreters."
            try:
                self._send({"id": rid, "module": module, "args": list(args), "env": dict(env), "cwd": cwd,
                            "log": log})
                deadline = time.monotonic() + timeout
                with self._cond:
                    while rid not in self._pids and rid not in self._errors:
                        if time.monotonic() > deadline or not self.alive():
                            raise RuntimeError(f"the fork server did not start {module} within {timeout:.0f}s. {hint}")
                        self._cond.wait(0.5)
                    if rid in self._errors:
                        raise OSError(f"{self._errors.pop(rid)}. {hint}")
                    return ForkedProcess(self, rid, self._pids.pop(rid))
            except BaseException as e:  # the server may still fork it: the kill goes after the request, in order
                with self._cond:
                    self._running.discard(rid)
                try:
                    self._send({"kill": rid})
                except OSError:
                    pass
                if isinstance(e, OSError) and not isinstance(e, RuntimeError) and "HINT" not in str(e):
                    raise RuntimeError(f"the fork server is gone ({e}). {hint}") from e
                raise

    def close(self) -> None:
        """Close the server's stdin (it exits, and its children with it), then reap it."""
        try:
            if self._proc.poll() is None:
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 -- best effort, also at interpreter exit
            self._proc.kill()


_SERVERS: dict[tuple, ForkServer] = {}  # (environment key, rank slot) -> server, least recently used first
_SERVERS_LOCK = threading.Lock()
_AT_EXIT: list[bool] = []  # close_all registered


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in PER_LAUNCH and not k.startswith("GALV_")))


def servers_for(env: dict[str, str], world_size: int, *, timeout: float = 600.0,
                poll: Callable[[], None] | None = None) -> list[ForkServer]:
    """The servers for ranks ``0 .. world_size-1`` of a launch in ``env`` (slot ``min(rank, MAX_SERVERS-1)``),
    started in parallel on first use and reused by later launches in the same environment."""
    import atexit

    key = _key(env)
    slots = min(world_size, MAX_SERVERS)
    with _SERVERS_LOCK:
        if not _AT_EXIT:
            atexit.register(close_all)
            _AT_EXIT.append(True)
        out: list[ForkServer] = []
        for slot in range(slots):
            server = _SERVERS.pop((key, slot), None)
            if server is None or not server.alive():
                base = {k: v for k, v in env.items() if k not in PER_LAUNCH}
                if "PYTHONHASHSEED" not in env:  # each slot its own string-hash seed, as separate interpreters have
                    base["PYTHONHASHSEED"] = str(random.SystemRandom().randrange(1, 2**32 - 1))
                server = ForkServer(base)
            _SERVERS[(key, slot)] = server  # most recently used last
            out.append(server)
        idle = [k for k, s in _SERVERS.items() if s not in out and not s.running()]  # least recently used first
        retire = [_SERVERS.pop(k) for k in idle[:max(0, len(_SERVERS) - MAX_SERVERS)]]
    for server in retire:
        server.close()
    for server in dict.fromkeys(out):  # also those another thread started and may still be waiting for
        server.wait_ready(timeout, poll)
    return [out[min(r, slots - 1)] for r in range(world_size)]


def running_children() -> int:
    """Children started by this process's servers that have not exited (a test's check for leaked ranks)."""
    with _SERVERS_LOCK:
        return sum(s.running() for s in _SERVERS.values() if s.alive())


def close_all() -> None:
    with _SERVERS_LOCK:
        while _SERVERS:
            _SERVERS.popitem()[1].close()


def start_method() -> str:
    """``"fork"`` on Linux unless ``GALV_START_METHOD=subprocess``; ``"subprocess"`` elsewhere (forking after
    importing system frameworks is unsafe on macOS; Windows cannot fork)."""
    chosen = os.environ.get("GALV_START_METHOD", "fork")
    if chosen not in ("fork", "subprocess"):
        raise ValueError(f"GALV_START_METHOD={chosen!r}: must be 'fork' or 'subprocess'. HINT: unset it to fork "
                         "rank processes from servers that have torch imported (fast), or use 'subprocess'.")
    return chosen if sys.platform == "linux" else "subprocess"


if __name__ == "__main__":
    _serve(sys.argv[1:])
