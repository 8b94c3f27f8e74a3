"""Launch N gloo ranks on this machine and collect what each returns.

Used by the test suite and the benchmarks: one launch runs several checks (start-up dominates the
cost of a launch on CPU), every rank has a timeout, and a failing rank brings the launch down at once
with its traceback instead of leaving the others hanging in a collective.

``target`` is ``"path/to/file.py::function"`` (or ``"package.module:function"``); the function is called
in every rank as ``fn(*args)`` and its return value (anything ``torch.save`` can store) is returned to
the caller in rank order.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(target: str, world_size: int, args: tuple = (), *, timeout: float = 600.0,
                    init_process_group: bool = True, env: dict[str, str] | None = None,
                    threads: int = 1) -> list[Any]:
    """Run ``target(*args)`` on ``world_size`` ranks (separate processes, gloo) and return results.

    ``init_process_group=False`` leaves process-group creation to the function (a Lightning Trainer
    does it itself from the same environment variables torchrun would set).
    """
    import torch

    with tempfile.TemporaryDirectory(prefix="galv_launch_") as tmp:
        torch.save(args, Path(tmp) / "args.pt")
        port = free_port()
        procs: list[subprocess.Popen] = []
        logs = []
        for rank in range(world_size):
            penv = {**os.environ, **(env or {})}
            penv.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                        RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                        NODE_RANK="0", OMP_NUM_THREADS=str(threads), GALV_TEST_THREADS=str(threads),
                        PYTHONUNBUFFERED="1")
            log = open(Path(tmp) / f"rank{rank}.log", "w+")
            logs.append(log)
            cmd = [sys.executable, "-m", "lightning_galv.testing", target, tmp, str(int(init_process_group))]
            procs.append(subprocess.Popen(cmd, env=penv, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        failed: int | None = None
        try:
            while True:
                codes = [p.poll() for p in procs]
                bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    failed = bad[0]
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed launch of {target} on {world_size} ranks exceeded "
                                       f"{timeout:.0f}s.\n{_tails(logs)}")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
        if failed is not None:
            raise RuntimeError(f"rank {failed} of {target} failed (exit {procs[failed].returncode}).\n"
                               f"{_tails(logs, first=failed)}")
        results = [torch.load(Path(tmp) / f"result{r}.pt", weights_only=False) for r in range(world_size)]
        for log in logs:
            log.close()
        return results


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
        assert spec is not None and spec.loader is not None
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
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], bool(int(sys.argv[3])))
