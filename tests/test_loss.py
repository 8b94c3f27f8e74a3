"""lightning_galv.loss on one process: F.cross_entropy on plain tensors, and the vocab-parallel path's
formula (forward and backward) on a one-rank tp group, where it must agree with F.cross_entropy too.
Several ranks are covered by tests/test_parity.py::test_vocab_parallel_loss_2_ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lightning_galv
from lightning_galv.loss import cross_entropy, full_logits, is_vocab_sharded

OPTIONS = [dict(), dict(reduction="sum"), dict(reduction="none"), dict(ignore_index=3),
           dict(label_smoothing=0.1), dict(ignore_index=-100, label_smoothing=0.2, reduction="sum")]


def _data(seed: int = 0, vocab: int = 11, ignore: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits and targets, one target ignored and one equal to 3 (ignored when ignore_index=3)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    targets[0, 1] = ignore
    targets[1, 2] = 3
    return logits, targets


def _reference(logits: torch.Tensor, targets: torch.Tensor, **kw: object) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw", OPTIONS)
def test_plain_tensors_are_f_cross_entropy(kw: dict) -> None:
    logits, targets = _data(ignore=kw.get("ignore_index", -100))
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    got, want = cross_entropy(a, targets, **kw), _reference(b, targets, **kw)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert not is_vocab_sharded(a) and full_logits(a) is a


def test_package_root_exports_the_loss_lazily() -> None:
    assert lightning_galv.cross_entropy is cross_entropy
    assert lightning_galv.loss.full_logits is full_logits


@pytest.mark.parametrize("bad, match", [
    (dict(reduction="avg"), "reduction='avg'"), (dict(label_smoothing=1.5), "label_smoothing=1.5"),
    (dict(ignore_index=1.0), "ignore_index=1.0")])
def test_bad_options_name_value_rule_and_hint(bad: dict, match: str) -> None:
    logits, targets = _data()
    with pytest.raises((ValueError, TypeError), match=match) as info:
        cross_entropy(logits, targets, **bad)
    assert "HINT:" in str(info.value)


def test_bad_inputs_name_value_rule_and_hint() -> None:
    logits, targets = _data()
    with pytest.raises(TypeError, match="targets .* dtype torch.float32.*HINT:"):
        cross_entropy(logits, targets.float())
    with pytest.raises(TypeError, match="logits .* dtype torch.int64.*HINT:"):
        cross_entropy(targets, targets)
    with pytest.raises(ValueError, match=r"logits of shape \(11,\).*HINT:"):
        cross_entropy(logits[0, 0], targets[0, 0])


def _sharded(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as a head under vocab_parallel_loss returns them, on a one-rank tp mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_galv.parallel.redistribute import PENDING_ATTR, PendingRelayout

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    out = DTensor.from_local(logits, mesh, (Shard(2),), run_check=False)
    setattr(out, PENDING_ATTR, PendingRelayout())
    return out


@pytest.mark.parametrize("kw", OPTIONS)
def test_vocab_parallel_formula_on_one_rank(one_rank_group: None, kw: dict) -> None:
    logits, targets = _data(1, ignore=kw.get("ignore_index", -100))
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    sharded = _sharded(a)
    assert is_vocab_sharded(sharded)
    got, want = cross_entropy(sharded, targets, **kw), _reference(b, targets, **kw)
    assert not isinstance(got, type(sharded)) and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))  # a non-uniform upstream gradient
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_vocab_parallel_errors(one_rank_group: None) -> None:
    logits, targets = _data(1)
    sharded = _sharded(logits)
    with pytest.raises(ValueError, match=r"targets with values \[11\].*\[0, 11\).*HINT:"):
        cross_entropy(sharded, torch.where(targets == 3, 11, targets))
    with pytest.raises(ValueError, match=r"targets of shape \(3, 4\).*HINT:"):
        cross_entropy(sharded, targets[:, :4])
    with pytest.raises(ValueError, match="layout tag.*HINT:"):
        cross_entropy(sharded * 1.0, targets)  # an op on the DTensor drops the tag
