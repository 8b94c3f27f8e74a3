"""Automatic mode, pure parts: which pipeline configurations a run can execute, and the budget margin."""

from __future__ import annotations

from lightning_galv.auto import run_configs


def test_run_configs_follow_the_loader_batch() -> None:
    # 4 ranks, 3 layers, loader batch 4 per shard, pipeline hooks present
    got = run_configs(4, 3, 4, pipeline=True)
    # pp=4 > 3 layers is impossible; pp=1 never splits the batch (no micro-batching without a pipeline)
    assert got == [(1, 16, (1,)), (2, 8, (1, 2, 4))]
    # every micro-batch count divides the per-shard batch, and global batch = loader batch x world / pp
    for pp, gb, ms in run_configs(8, 8, 6, pipeline=True):
        assert gb == 6 * 8 // pp and all(6 % m == 0 for m in ms)


def test_run_configs_without_hooks_or_batch() -> None:
    assert run_configs(4, 8, 4, pipeline=False) == [(1, 16, (1,))]
    # unknown loader batch: only what runs with any batch size
    assert run_configs(4, 8, None, pipeline=True) == [(1, 8, (1,))]
