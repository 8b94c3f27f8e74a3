"""Start rank processes by forking a server that has imported torch and Lightning once.

Why: ``run_distributed`` (the tests, the benchmarks, the tuner's trials, ``galv profile``) starts every rank
as a fresh interpreter, and on a slow 2-core machine a fresh ``import lightning`` costs ~11 s of CPU (5 of
them torchmetrics pulling in transformers and scipy), ``import torch`` with its distributed package ~5 s.
With 4 ranks on 2 cores that is 10-25 s of wall time per launch before any work, paid again in every trial
of a study. A fork of a process that already holds those modules starts in milliseconds.

Why a server of our own rather than ``multiprocessing``'s forkserver: that one re-runs the parent's main
script (as ``__mp_main__``) in every child, so a user's tuning script without an ``if __name__ ==
"__main__"`` guard would start itself again in every trial. This server only ever runs
``python -m <module> <args>`` equivalents, exactly what the subprocess launch ran.

What a forked rank shares with the server, and how it is made to look fresh (:func:`_become_fresh`):
the environment (replaced by the launch's), the working directory, ``sys.argv``, ``sys.path`` (the launch's
working directory and ``PYTHONPATH`` in front, as a fresh ``python -m`` would have them), ``tempfile``'s cached
folder (``TMPDIR`` may differ), numpy's global random state (re-seeded from the OS, as a fresh process is;
Python's ``random`` re-seeds itself after a fork), and Lightning's import-time rank (``rank_zero_only.rank``,
read from ``RANK``/``LOCAL_RANK`` when ``lightning`` was first imported). The server is single-threaded and
never runs a torch op, so no OpenMP pool or CUDA context exists to be inherited.

Protocol (one JSON object per line): the client writes ``{"id", "module", "args", "env", "cwd", "log"}``; the
server answers ``{"id", "pid"}`` (or ``{"id", "error"}``) and later ``{"pid", "returncode"}`` when that child
exits (``-N`` for signal N, as ``subprocess`` reports it). The server exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

PRELOAD = ("torch", "torch.distributed", "lightning")  # what every rank of this package's launches imports
READY = "galv-forkserver-ready"


# ---------------------------------------------------------------------------------------------------- server side
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
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True,
                                  errors="backslashreplace")
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    front = [req["cwd"]] + [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = front + [p for p in sys.path[1:] if p not in front]
    sys.argv = [req["module"], *req["args"]]
    tempfile.tempdir = None  # recomputed from this environment's TMPDIR on first use
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    rz = sys.modules.get("lightning_utilities.core.rank_zero")
    if rz is not None:  # what lightning.fabric.utilities.rank_zero computes at import time
        rank = next((os.environ[k] for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
                     if k in os.environ), "0")
        rz.rank_zero_only.rank = int(rank)


def _run_child(req: dict[str, Any]) -> None:
    """In a forked child: run the module as ``__main__`` and leave without returning to the server's loop."""
    import runpy
    import traceback

    code = 0
    try:
        os.close(_PROTOCOL_FD)  # the client must see EOF when the server exits, even while ranks still run
        _become_fresh(req)
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- a rank's error must reach its log and its exit code, as in python -m
        traceback.print_exc()
        code = 1
    finally:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


_PROTOCOL_FD = -1  # the server's end of the pipe to its client; closed in every child


def _serve(preload: list[str]) -> None:
    """The server's loop: fork a child per request, report each child's exit; single-threaded by design."""
    global _PROTOCOL_FD
    _PROTOCOL_FD = os.dup(1)  # the protocol gets a private copy of stdout ...
    os.dup2(2, 1)  # ... and what the imports print goes to stderr, not into the protocol
    out = os.fdopen(_PROTOCOL_FD, "w", buffering=1, closefd=False)
    for name in preload:
        try:
            __import__(name)
        except ImportError:
            pass  # a module this environment lacks: children import what they need themselves

    def send(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    out.write(READY + "\n")
    out.flush()
    buf = b""
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([0], [], [], 0.02)
        while children:  # reap every child that has exited
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            send({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the client is gone: so is the server (children run on; their launch kills them)
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            try:
                pid = os.fork()
            except OSError as e:
                send({"id": req["id"], "error": f"fork failed: {e}"})
                continue
            if pid == 0:
                _run_child(req)  # never returns
            children.add(pid)
            send({"id": req["id"], "pid": pid})


# ---------------------------------------------------------------------------------------------------- client side
class ForkedProcess:
    """The parent's handle on one forked rank, with the part of ``subprocess.Popen``'s interface a launch uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._exit_code(self.pid)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if not self._server.alive():
                raise RuntimeError(f"the fork server died before rank process {self.pid} exited. "
                                   "HINT: set GALV_START_METHOD=subprocess to start ranks as fresh interpreters.")
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return self.returncode


class ForkServer:
    """One server process per client process, started on first use (:func:`get_server`), shut down at exit."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, start_timeout: float = 600.0) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "lightning_galv.forkserver", *preload],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._lock = threading.Lock()  # one request at a time
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._errors: dict[int, str] = {}
        self._exits: dict[int, int] = {}  # pid -> returncode
        self._next_id = 0
        first = self._readline_with_timeout(start_timeout)
        if first.strip() != READY:
            self._proc.kill()
            raise RuntimeError(f"the fork server did not start (first line {first!r}). "
                               "HINT: set GALV_START_METHOD=subprocess to start ranks as fresh interpreters.")
        self._reader = threading.Thread(target=self._read, name="galv-forkserver-reader", daemon=True)
        self._reader.start()

    def _readline_with_timeout(self, timeout: float) -> str:
        line: list[str] = []
        t = threading.Thread(target=lambda: line.append(self._proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        return line[0] if line else ""

    def _read(self) -> None:
        for raw in self._proc.stdout:
            msg = json.loads(raw)
            with self._cond:
                if "returncode" in msg:
                    self._exits[msg["pid"]] = msg["returncode"]
                elif "pid" in msg:
                    self._pids[msg["id"]] = msg["pid"]
                else:
                    self._errors[msg["id"]] = msg["error"]
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def start(self, module: str, args: list[str], env: dict[str, str], cwd: str, log: str,
              timeout: float = 60.0) -> ForkedProcess:
        """Fork a child that runs ``python -m module *args`` in ``env`` and ``cwd``, output appended to ``log``."""
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            req = {"id": rid, "module": module, "args": list(args), "env": dict(env), "cwd": cwd, "log": log}
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
            deadline = time.monotonic() + timeout
            with self._cond:
                while rid not in self._pids and rid not in self._errors:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self.alive():
                        raise RuntimeError(f"the fork server did not start {module} within {timeout:.0f}s. "
                                           "HINT: set GALV_START_METHOD=subprocess to start ranks as fresh "
                                           "interpreters.")
                    self._cond.wait(min(left, 0.5))
                if rid in self._errors:
                    raise OSError(self._errors.pop(rid))
                return ForkedProcess(self, self._pids.pop(rid))

    def close(self) -> None:
        if self.alive():
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 -- best effort at interpreter exit
                self._proc.kill()


_SERVER: ForkServer | None = None
_SERVER_LOCK = threading.Lock()


def get_server() -> ForkServer:
    """This process's fork server, started (and registered for shutdown at exit) on first use."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or not _SERVER.alive():
            import atexit

            _SERVER = ForkServer()
            atexit.register(_SERVER.close)
        return _SERVER


def start_method() -> str:
    """``"fork"`` where the OS can fork (Linux, macOS) unless ``GALV_START_METHOD=subprocess``; else ``"subprocess"``."""
    chosen = os.environ.get("GALV_START_METHOD", "fork")
    if chosen not in ("fork", "subprocess"):
        raise ValueError(f"GALV_START_METHOD={chosen!r}: must be 'fork' or 'subprocess'. HINT: unset it to fork "
                         "rank processes from a server that has torch imported (fast), or use 'subprocess'.")
    return chosen if hasattr(os, "fork") else "subprocess"


if __name__ == "__main__":
    _serve(sys.argv[1:])
