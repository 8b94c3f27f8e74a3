"""Keyed dropout on one process: the mask of any slice equals that slice of the whole batch's mask."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_galv.models.dropout import (DropoutCoords, KeyedDropout, dropout_key, keep_mask, keyed_dropout_,
                                           restore_coords, set_dropout_key, site_of)

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
    assert torch.equal(y1, y2)  # same key, same site, same coordinates: same mask
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
