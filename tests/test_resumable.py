"""Single-process checks of the resumable training loader (state round trip, skip, epoch, seed)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_galv.resumable import is_resumable, make_resumable


class Recorded(Dataset):
    """Map-style dataset that records which indices were loaded."""

    def __init__(self, n: int = 30) -> None:
        self.n = n
        self.seen: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.seen.append(int(i))
        return int(i)


class Epoch:
    """Stands in for Lightning's epoch counter (what it passes to ``set_epoch``)."""

    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


def _loader(ds: Dataset, seed: int, epoch: Epoch, **kw: Any) -> Any:
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=seed)
    return make_resumable(DataLoader(ds, batch_size=4, sampler=sampler, **kw), epoch)


def _batches(loader: Any, n: int | None = None) -> list[list[int]]:
    """The first ``n`` batches (all if None), without drawing an extra one."""
    return [b.tolist() for b in itertools.islice(loader, n)]


def _set_epoch(loader: Any, epoch: Epoch, e: int) -> None:
    epoch.value = e
    loader.sampler.set_epoch(e)  # what Lightning's _set_sampler_epoch does at the start of an epoch


@pytest.mark.parametrize("workers", [0, 2])
def test_round_trip_mid_epoch_shuffled(workers: int) -> None:
    ep = Epoch()
    ds = Recorded()
    a = _loader(ds, seed=5, epoch=ep, num_workers=workers)
    assert is_resumable(a) and len(a) == 4  # 15 samples of 30 on this shard: 3 full batches and a partial one
    _set_epoch(a, ep, 1)
    whole = _batches(a)
    assert [len(b) for b in whole] == [4, 4, 4, 3]
    head = _batches(a, 2)
    state = a.state_dict()
    assert state == {"epoch": 1, "batches": 2, "seed": 5, "batches_per_epoch": 4, "num_replicas": 2}

    ds2 = Recorded()
    b = _loader(ds2, seed=0, epoch=ep, num_workers=workers)  # another seed, sampler at epoch 0: the state decides
    b.load_state_dict(state)
    # with workers the indices are drawn at iter(), before Lightning would call set_epoch: the load set it
    rest = _batches(b)
    assert head + rest == whole
    if workers == 0:  # (worker processes load into their own copy of the dataset)
        assert sorted(ds2.seen) == sorted(i for batch in whole[2:] for i in batch)  # skipped: never loaded
    assert b.state_dict()["batches"] == 4 and b.sampler.seed == 5


def test_end_of_epoch_state_does_not_skip_the_next_epoch() -> None:
    ep = Epoch()
    a = _loader(Recorded(), seed=3, epoch=ep)
    _set_epoch(a, ep, 0)
    _batches(a)
    state = a.state_dict()
    assert state["epoch"] == 0 and state["batches"] == 4

    b = _loader(Recorded(), seed=3, epoch=ep)
    b.load_state_dict(state)
    _set_epoch(b, ep, 1)  # the resumed run starts epoch 1: the saved position belongs to epoch 0
    ref = _loader(Recorded(), seed=3, epoch=ep)
    _set_epoch(ref, ep, 1)
    assert _batches(b) == _batches(ref)
    assert len(_batches(ref)) == 4


def test_unbatched_loader_and_user_subclass() -> None:
    class Tagged(DataLoader):
        def tag(self) -> str:
            return "mine"

    ep = Epoch()
    ds = Recorded(10)
    user = Tagged(ds, batch_size=None)
    a = make_resumable(user, ep)
    assert isinstance(a, Tagged) and a.tag() == "mine" and a is not user
    assert not is_resumable(user) and user.sampler is not a.sampler  # the user's object is left as it was
    first = [int(x) for x in a][:3]
    it = iter(a)
    [next(it) for _ in range(3)]
    state = a.state_dict()
    assert state["batches"] == 3
    b = make_resumable(Tagged(Recorded(10), batch_size=None), ep)
    b.load_state_dict(state)
    assert first + [int(x) for x in b] == list(range(10))


def test_iterable_and_stateful_loaders_come_back_unchanged() -> None:
    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            yield from range(4)

    stream = DataLoader(Stream(), batch_size=2)
    assert make_resumable(stream, Epoch()) is stream and not is_resumable(stream)
    made = make_resumable(DataLoader(Recorded(), batch_size=4), Epoch())
    again = make_resumable(made, Epoch())  # a second fit: same loader, fresh position
    assert again is made and made.state_dict()["batches"] == 0


def test_bad_input() -> None:
    loader = make_resumable(DataLoader(Recorded(), batch_size=4), Epoch())
    with pytest.raises(TypeError, match="epoch_fn=3.*HINT"):
        make_resumable(DataLoader(Recorded()), 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"keys \['seed', 'batches_per_epoch', 'num_replicas'\] missing.*HINT"):
        loader.load_state_dict({"epoch": 0, "batches": 1})
    good = loader.state_dict()
    with pytest.raises(ValueError, match="batches=-1: must be an int >= 0.*HINT"):
        loader.load_state_dict({**good, "batches": -1})


def test_changed_split_warns() -> None:
    ep = Epoch()
    a = make_resumable(DataLoader(Recorded(), batch_size=4), ep)
    state = {**a.state_dict(), "batches": 1, "batches_per_epoch": 3}
    with pytest.warns(UserWarning, match="3 batches per epoch.*this run has 8.*HINT"):
        a.load_state_dict(state)
    assert torch.equal(next(iter(a)), torch.tensor([4, 5, 6, 7]))  # still skips what the state says
