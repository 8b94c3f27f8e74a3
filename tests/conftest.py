"""Test-wide fixtures.

Every test runs with the environment it started with restored afterwards: Lightning's launchers write
MASTER_ADDR / MASTER_PORT / NODE_RANK / LOCAL_RANK into ``os.environ`` of the process that runs a Trainer, and a
later test that starts ``galv fit`` in a subprocess with that environment would make its rank 0 believe an
external launcher started it (``LOCAL_RANK`` set) and wait forever for ranks that never come.

``one_rank_group``: a one-rank gloo process group for the test (DTensors on a one-rank mesh, in-process).

One environment for the whole session, set before any rank starts: this checkout and ``tests/`` first on
``PYTHONPATH`` (rank processes import the package and the tests' helper modules, e.g. a tuner trial's
factories) and the Hugging Face hubs offline (tests use local data only). Why here rather than per test:
ranks fork from servers keyed by their environment (``lightning_galv.forkserver``), and every distinct
environment costs a set of servers that each import torch and Lightning again (~11 s of CPU apiece).

Automatic mode profiles with exactly 4 timed rounds per layer type (``GALV_PROFILE_BUDGET_S=0``, unless the
caller set it): the tests check what automatic mode does, not how precise its profile is, and a tiny model's
blocks would otherwise fill the whole default budget (~20 s per fresh profile, a dozen of them in the suite). The
budgeted rounds are tested on their own (test_profilers), one CLI test profiles under the default budget, and the
benchmarks that judge the profiles' precision run without this setting.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

_FIRST = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
os.environ["PYTHONPATH"] = os.pathsep.join(
    _FIRST + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in _FIRST])
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GALV_PROFILE_BUDGET_S", "0")


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture()
def one_rank_group() -> Iterator[None]:
    import torch.distributed as dist

    from lightning_galv.testing import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
