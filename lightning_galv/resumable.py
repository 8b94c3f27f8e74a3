"""Exact mid-epoch resume for map-style training loaders.

Lightning saves ``state_dict()`` of every training loader that implements it (its ``_Stateful``
protocol) in the fit loop's checkpoint state, and on resume calls ``load_state_dict()`` *before* it
creates the epoch's iterator and *before* it calls ``set_epoch`` on the samplers. A plain
``DataLoader`` has no such state, so a resumed run continues the batch index but draws the epoch's
samples from the beginning: different batches, different weights.

:func:`make_resumable` gives a ``DataLoader`` that state: the epoch of its current pass, the batches it
has yielded in that pass, and the sampler's shuffle seed. After ``load_state_dict`` the next pass of
the same epoch skips the batches already trained on *at the index level* (the batch sampler's index
lists are drawn and dropped; no sample is loaded or collated for them), so the resumed run sees the
very batches the uninterrupted run saw.

Why the epoch comes from a callable (Lightning's epoch counter) and not from the sampler: samplers
without ``set_epoch`` (a user's ``SequentialSampler``) have no epoch, and the counter is exactly the
value Lightning hands to ``set_epoch``. The pass's epoch is read when its first index is drawn, which is
after ``set_epoch`` with in-process loading and at ``iter()`` with worker processes (which is why
``load_state_dict`` also sets the saved epoch on the sampler right away).
"""

from __future__ import annotations

import collections
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

_STATE_KEYS = ("epoch", "batches", "seed", "batches_per_epoch", "num_replicas")


@dataclass
class LoaderProgress:
    """Where a resumable loader stands, shared by the loader and its index wrapper.

    ``epoch``/``batches``: the epoch of the current pass and the batches the loader has *yielded* in it
    (counted at the loader, not at the sampler: worker processes prefetch indices ahead of training).
    ``pending``: a loaded ``(epoch, batches)`` not yet applied; the next pass applies it when its epoch
    matches (a checkpoint written at the end of epoch e must not skip batches of epoch e + 1).
    """

    epoch_fn: Callable[[], int | None]
    epoch: int | None = None
    batches: int = 0
    pending: tuple[int | None, int] | None = None
    restored: bool = False  # load_state_dict was called in this fit

    def start_pass(self) -> int:
        """A pass draws its first index: fix its epoch and return how many batches to skip."""
        self.epoch = self.epoch_fn()
        skip = 0
        if self.pending is not None:
            epoch, batches = self.pending
            if epoch is None or self.epoch is None or epoch == self.epoch:
                skip = batches
            self.pending = None
        self.batches = skip
        return skip


class SkipIndices:
    """Wraps a batch sampler (or, for ``batch_size=None`` loaders, a sampler) to skip a resumed pass's head.

    ``sampler`` and ``set_epoch`` reach through to the wrapped object so that Lightning's
    ``_set_sampler_epoch`` (which looks at ``loader.batch_sampler.sampler``) still sets the shuffle epoch.
    """

    def __init__(self, inner: Any, progress: LoaderProgress) -> None:
        self.inner = inner
        self.progress = progress

    @property
    def sampler(self) -> Any:
        return getattr(self.inner, "sampler", None)

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.inner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)  # the full epoch: Lightning counts the resumed batch index from the checkpoint

    def __iter__(self) -> Iterator[Any]:
        skip = self.progress.start_pass()
        it = iter(self.inner)
        collections.deque(itertools.islice(it, skip), maxlen=0)  # draw and drop: nothing is loaded
        yield from it

    def __getattr__(self, name: str) -> Any:  # batch_size, drop_last, ... of the wrapped sampler
        if name in ("inner", "progress"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class _ResumableLoader:
    """Mixin put in front of a ``DataLoader`` class by :func:`make_resumable` (see the module docstring)."""

    _galv_progress: LoaderProgress

    def __iter__(self) -> Iterator[Any]:
        progress = self.__dict__.get("_galv_progress")
        it = super().__iter__()  # type: ignore[misc]
        if progress is None:  # re-instantiated from saved init args (e.g. by Lightning): a plain loader
            return it
        return _counted(it, progress)

    def state_dict(self) -> dict[str, Any]:
        """What Lightning stores in the checkpoint's fit-loop state (same on every rank of a shard group)."""
        progress: LoaderProgress | None = self.__dict__.get("_galv_progress")
        sampler = _shuffle_sampler(self)
        return {"epoch": progress.epoch if progress else None, "batches": progress.batches if progress else 0,
                "seed": getattr(sampler, "seed", None), "batches_per_epoch": _len_or_none(self),
                "num_replicas": getattr(sampler, "num_replicas", None)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Arm the skip for the next pass of the saved epoch; restore the sampler's seed and epoch."""
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"loader state {state_dict!r}: keys {missing} missing; a resumable loader's state has "
                             f"{list(_STATE_KEYS)}. HINT: resume from a checkpoint written by the same kind of loader, "
                             "or drop the 'combined_loader' entry of the checkpoint's fit-loop state to restart the "
                             "epoch.")
        progress: LoaderProgress = self.__dict__["_galv_progress"]
        epoch, batches = state_dict["epoch"], state_dict["batches"]
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise ValueError(f"loader state batches={batches!r}: must be an int >= 0 (batches yielded in the "
                             "interrupted epoch). HINT: the checkpoint's loader state is corrupt; drop it to restart "
                             "the epoch.")
        name = type(self).__name__
        now = _len_or_none(self)
        sampler = _shuffle_sampler(self)
        shards = getattr(sampler, "num_replicas", None)
        if state_dict["batches_per_epoch"] != now or state_dict["num_replicas"] != shards:
            rank_zero_warn(f"{name}: the checkpoint was written with {state_dict['batches_per_epoch']} batches per "
                           f"epoch over {state_dict['num_replicas']} data shards, this run has {now} over "
                           f"{shards}; the resumed epoch skips the first {batches} "
                           "batches of the new split, which are not the samples already trained on. HINT: keep the "
                           "batch size and the plan's data-parallel size to resume exactly.")
        seed = state_dict["seed"]
        if seed is not None and hasattr(sampler, "seed"):
            sampler.seed = seed  # the interrupted run's shuffle order, even if the global seed changed
        if epoch is not None and callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)  # worker processes draw indices at iter(), before Lightning's set_epoch
        progress.pending = (epoch, batches)
        progress.restored = True


def _counted(it: Iterator[Any], progress: LoaderProgress) -> Iterator[Any]:
    for batch in it:
        progress.batches += 1  # counted before the batch is handed over: a checkpoint during its step includes it
        yield batch


def _shuffle_sampler(loader: Any) -> Any:
    """The sampler that owns seed/epoch: the loader's, or the batch sampler's (behind our wrapper)."""
    bs = loader.batch_sampler
    inner = bs.inner if isinstance(bs, SkipIndices) else bs
    sampler = getattr(inner, "sampler", None) if inner is not None else None
    if sampler is None:
        sampler = loader.sampler
    return sampler.inner if isinstance(sampler, SkipIndices) else sampler


def _len_or_none(loader: Any) -> int | None:
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


@functools.lru_cache(maxsize=None)
def _resumable_class(base: type) -> type:
    """``base`` with the resume mixin in front: a user's DataLoader subclass keeps its own behaviour."""
    return type(f"Resumable{base.__name__}", (_ResumableLoader, base), {"__module__": __name__})


def is_resumable(loader: object) -> bool:
    """Whether Lightning will checkpoint and restore the loader's position (it implements ``_Stateful``)."""
    return isinstance(loader, _Stateful)


def make_resumable(loader: object, epoch_fn: Callable[[], int | None]) -> object:
    """A resumable copy of a map-style ``DataLoader``; anything else comes back unchanged.

    Unchanged: loaders that are already stateful (e.g. torchdata's ``StatefulDataLoader``; for one made by
    an earlier ``make_resumable`` the epoch source is re-bound), non-``DataLoader`` iterables and loaders
    over an ``IterableDataset`` (their position lives in the dataset; :func:`is_resumable` tells which).

    The loader is copied, not re-instantiated: re-instantiation needs every ``__init__`` argument, which a
    user's loader subclass may not expose, and a copy shares the dataset, sampler, collate function and
    worker settings as they are. The user's own object is not modified.
    """
    if not callable(epoch_fn):
        raise TypeError(f"epoch_fn={epoch_fn!r}: must be a callable returning the current epoch (or None). "
                        "HINT: pass lambda: trainer.fit_loop.epoch_progress.current.processed.")
    if isinstance(loader, _ResumableLoader) and "_galv_progress" in loader.__dict__:
        loader.__dict__["_galv_progress"] = LoaderProgress(epoch_fn)  # a new fit: fresh position and epoch source
        _index_wrapper(loader).progress = loader.__dict__["_galv_progress"]
        return loader
    if is_resumable(loader) or not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    new = object.__new__(_resumable_class(type(loader)))
    new.__dict__.update(vars(loader))
    new.__dict__["_iterator"] = None  # never share a persistent-workers iterator with the original
    progress = LoaderProgress(epoch_fn)
    new.__dict__["_galv_progress"] = progress
    # DataLoader forbids re-assigning its samplers after __init__ (they must agree with batch_size etc.); the
    # wrapper changes only which indices of a resumed pass are drawn, so the instance dict is set directly
    if loader.batch_sampler is not None:
        new.__dict__["batch_sampler"] = SkipIndices(loader.batch_sampler, progress)
    else:
        new.__dict__["sampler"] = SkipIndices(loader.sampler, progress)
    return new


def _index_wrapper(loader: Any) -> SkipIndices:
    w = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    assert isinstance(w, SkipIndices)
    return w
