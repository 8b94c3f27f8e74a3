"""Keyed dropout on one process: the mask of any slice equals that slice of the whole batch's mask."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_galv.models.dropout import (DropoutCoords, KeyedDropout, dropout_key, keep_mask, keyed_dropout_,
                                           restart_calls, restore_coords, set_dropout_key, site_of, use_coords)
from lightning_galv.parallel.activation_checkpoint import apply_checkpointing

CPU = torch.device("cpu")


def test_slices_of_the_global_mask() -> None:
    shape = torch.Size([8, 6, 5])
    full = keep_mask(shape, 0.3, key=7, site=11, c=DropoutCoords(key=7), device=CPU)
    # a data-parallel shard holding rows 4..7 and a sequence chunk holding positions 3..5
    part = keep_mask(torch.Size([4, 3, 5]), 0.3, 7, 11, DropoutCoords(key=7, shard=1, shards=2, seq_offset=3), CPU)
    assert torch.equal(part, full[4:8, 3:6])
    # a pipeline micro-batch: 2 loader shards of 4 rows, micro-batch 1 of 2 holds rows 2,3 of each shard
    micro = DropoutCoords(key=7, micro=1, micro_batches=2, loader_shards=2)
    assert torch.equal(keep_mask(torch.Size([4, 6, 5]), 0.3, 7, 11, micro, CPU), full[[2, 3, 6, 7]])
    micro_dp = DropoutCoords(key=7, shard=1, shards=2, micro=1, micro_batches=2, loader_shards=2)
    assert torch.equal(keep_mask(torch.Size([2, 6, 5]), 0.3, 7, 11, micro_dp, CPU), full[[6, 7]])


def test_keep_rate_and_independence() -> None:
    shape = torch.Size([64, 32, 16])
    a = keep_mask(shape, 0.1, 1, 5, DropoutCoords(), CPU)
    assert abs(a.float().mean().item() - 0.9) < 0.01  # 32768 draws: 3 sigma is ~0.005
    b = keep_mask(shape, 0.1, 2, 5, DropoutCoords(), CPU)  # another step
    c = keep_mask(shape, 0.1, 1, 6, DropoutCoords(), CPU)  # another site
    for other in (b, c):
        agree = (a == other).float().mean().item()
        assert abs(agree - (0.9 ** 2 + 0.1 ** 2)) < 0.01  # independent masks agree at the chance rate


def test_module_semantics() -> None:
    drop = KeyedDropout(0.25)
    x = torch.randn(4, 8, 16)
    with dropout_key(3):
        y1, y2 = drop(x), drop(x)
    # the second call of a site under one key draws a mask of its own, as nn.Dropout would ...
    big = torch.ones(16, 32, 64)
    with dropout_key(3):
        m1, m2 = drop(big) != 0, drop(big) != 0
    agree = (m1 == m2).float().mean().item()
    assert abs(agree - (0.75 ** 2 + 0.25 ** 2)) < 0.015  # 32768 draws (sd 0.003): the chance rate
    with dropout_key(3):  # ... and a fresh scope of the same key draws the same pair again
        z1, z2 = drop(x), drop(x)
    assert torch.equal(z1, y1) and torch.equal(z2, y2)
    kept = y1 != 0
    assert torch.allclose(y1[kept], x[kept] / 0.75)
    drop.eval()
    assert drop(x) is x
    drop.train()
    with restore_coords(DropoutCoords()):  # no key: behaves like ordinary dropout (a fresh key per call)
        assert not torch.equal(drop(x), drop(x))
    with pytest.raises(TypeError, match="HINT"):
        set_dropout_key("3")  # type: ignore[arg-type]


def test_plain_dropout_is_replaced_in_place() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2), nn.Sequential(nn.Dropout(0.3)))
    keys = set(model.state_dict())
    assert keyed_dropout_(model) == 2
    assert isinstance(model[1], KeyedDropout) and model[2][0].p == 0.3
    assert set(model.state_dict()) == keys and model[1].site != model[2][0].site
    assert model[2][0].site == site_of("2.0")  # named under the root it was converted from


class _Twice(nn.Module):
    """One dropout module applied twice in a forward (as T5's stack applies its ``dropout``)."""

    def __init__(self, calls: int = 2) -> None:
        super().__init__()
        self.lin, self.drop, self.calls = nn.Linear(8, 8), KeyedDropout(0.3, site=5), calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.calls):
            x = self.drop(torch.tanh(self.lin(x)))
        return x


def _grads(block: nn.Module, x: torch.Tensor, key: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    block.zero_grad()
    with dropout_key(key):
        y = block(x)
        (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), [p.grad.clone() for p in block.parameters()]


def test_checkpoint_recompute_redraws_the_forward_masks() -> None:
    """The runtime's checkpointing replays the call counts: the recompute draws the second call's mask for
    the second call, so the gradients equal the unchecheckpointed block's (with both calls redrawing call
    0's mask or call 2's, they differ)."""
    torch.manual_seed(0)
    plain = _Twice()
    ckpt = _Twice()
    ckpt.load_state_dict(plain.state_dict())
    apply_checkpointing(ckpt)
    x = torch.randn(4, 6, 8)
    for key in (0, 1):
        y0, g0 = _grads(plain, x, key)
        y1, g1 = _grads(ckpt, x, key)
        assert torch.equal(y0, y1)
        for a, b in zip(g0, g1):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoint_in_the_models_own_code() -> None:
    """``torch.utils.checkpoint`` in a model's code recomputes with the coordinates of the moment it runs, not
    the forward's (on CUDA, on a thread that has none): a keyed mask there is a clear error, not a silent wrong
    gradient. Without a key (eager use) the masks come from torch's generator, which the checkpoint restores,
    so the gradients are exact, as with ``nn.Dropout``."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    for reentrant in (False, True):
        once, again = _Twice(calls=1), _Twice(calls=1)
        again.load_state_dict(once.state_dict())
        inner = again.forward
        again.forward = (  # type: ignore[method-assign]
            lambda t, inner=inner, r=reentrant: checkpoint(inner, t, use_reentrant=r))
        x_ = x.clone().requires_grad_(reentrant)  # the reentrant variant needs an input that requires grad
        with pytest.raises(RuntimeError, match="checkpoint the runtime does not manage.*HINT"):
            _grads(again, x_, 3)
        with restore_coords(DropoutCoords()):  # no key
            grads = []
            for block in (once, again):
                block.zero_grad()
                torch.manual_seed(1)
                (block(x_) * torch.arange(x_.numel(), dtype=x_.dtype).view_as(x_)).sum().backward()
                grads.append([p.grad.clone() for p in block.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_recompute_on_another_thread() -> None:
    """A CUDA backward runs on autograd's device thread, where no coordinates were set: the runtime's checkpoint
    replays the forward's there too; a model's own checkpoint is still recognized as keyed and refused."""
    import threading

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    plain, ckpt, foreign = _Twice(), _Twice(), _Twice()
    ckpt.load_state_dict(plain.state_dict())
    foreign.load_state_dict(plain.state_dict())
    apply_checkpointing(ckpt)
    inner = foreign.forward
    foreign.forward = lambda t: checkpoint(inner, t, use_reentrant=False)  # type: ignore[method-assign]
    x = torch.randn(4, 6, 8)
    _, want = _grads(plain, x, 5)
    out: dict[str, object] = {}
    for name, block in (("ckpt", ckpt), ("foreign", foreign)):
        block.zero_grad()
        with dropout_key(5):
            y = block(x)
            loss = (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum()

            def run(name: str = name) -> None:
                try:
                    loss.backward()
                    out[name] = [p.grad.clone() for p in block.parameters()]
                except RuntimeError as e:
                    out[name] = e

            t = threading.Thread(target=run)
            t.start()
            t.join()
    assert isinstance(out["ckpt"], list) and all(torch.equal(a, b) for a, b in zip(out["ckpt"], want))
    assert isinstance(out["foreign"], RuntimeError) and "HINT" in str(out["foreign"])


def test_call_counts_are_per_pipeline_micro_batch() -> None:
    """A stage running micro-batch 1 after micro-batch 0 draws call 0's mask for it, as one process running
    the whole batch once does."""
    drop = KeyedDropout(0.5, site=9)
    x = torch.ones(4, 6, 8)
    with dropout_key(2):
        full = drop(x)
    with dropout_key(2):
        parts = []
        for m in range(2):
            with use_coords(micro=m, micro_batches=2):
                parts.append(drop(x[2 * m:2 * m + 2]))
    assert torch.equal(torch.cat(parts), full)
    # the schedule's first-step metadata inference runs the stage once before micro-batch 0: the stage restarts
    # each micro-batch's count when its forward begins (parallel/pipeline.py), or micro-batch 0 would draw call 1
    with dropout_key(2):
        with use_coords(micro=0, micro_batches=2):
            drop(x[:2])  # the inference pass
        parts = []
        for m in range(2):
            with use_coords(micro=m, micro_batches=2):
                restart_calls(m)
                parts.append(drop(x[2 * m:2 * m + 2]))
    assert torch.equal(torch.cat(parts), full)
