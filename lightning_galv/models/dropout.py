"""Dropout whose mask does not depend on how the batch and the sequence are split across ranks.

``nn.Dropout`` draws its mask from the process's random stream, so under data, tensor or sequence
parallelism every rank draws a mask for *its* slice from *its* stream: a tp group's replicas may
disagree, sequence chunks repeat one pattern, and nothing equals the mask a single process draws
for the whole batch. :class:`KeyedDropout` instead computes every element's keep/drop decision from
its *global coordinates* with a counter-based hash (SplitMix64's finalizer, Steele et al. OOPSLA'14):

    keep(element) = hash(step key, site, global row, global position, channel) >= p

* **step key**: one integer per forward micro-step (the strategy sets ``global_step * accumulate +
  micro_step``; tests set it with :func:`dropout_key`). Without a key (plain eager use) a fresh key is
  drawn from torch's default generator, so the module still behaves like ordinary dropout.
* **site**: a stable id of the module (a hash of its qualified name, see :func:`assign_sites`), the same
  in a single process and in every parallelized copy because module names never change.
* **call**: the n-th call of a site under one key (per pipeline micro-batch) draws mask n, so a module
  applied twice, or a model run twice in one step, gets independent masks as with ``nn.Dropout``
  (:func:`call_index`); the runtime's recomputes replay the counts, and a recompute by a checkpoint in the
  model's own code is refused (:func:`check_not_foreign_recompute`).
* **global row / position**: the runtime records, per layer, which rows of the step's global batch
  and which sequence chunk the local tensor holds (:class:`DropoutCoords`); a single process holds
  rows ``0..B-1`` and positions ``0..S-1``.

The global batch is the loader shards concatenated in shard order (the order every batch re-layout
keeps); under a pipeline, micro-batch ``m`` of ``M`` takes rows ``[m*b/M, (m+1)*b/M)`` of every shard.
So any plan draws exactly the mask a single process draws for the same global batch and key; replicas
are bit-identical by construction. Cost: one int64 hash per element of a dropout input (training only).
"""

from __future__ import annotations

import threading
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["KeyedDropout", "DropoutCoords", "DropoutSnapshot", "dropout_key", "set_dropout_key", "coords",
           "use_coords", "set_coords", "restore_coords", "snapshot", "replay", "call_index", "restart_calls",
           "check_not_foreign_recompute",
           "assign_sites", "keyed_dropout_"]


@dataclass(frozen=True)
class DropoutCoords:
    """Where the local tensor sits in the global batch (set by the runtime, read by :class:`KeyedDropout`)."""

    key: int | None = None  # step key; None = draw one per call from torch's generator
    shard: int = 0  # the layer's batch shard index held by this rank ...
    shards: int = 1  # ... of this many equal shards (of the micro-batch under a pipeline)
    micro: int = 0  # pipeline micro-batch index ...
    micro_batches: int = 1  # ... of this many
    loader_shards: int = 1  # shards the data loader serves (pipeline micro-batches are cut per shard)
    seq_offset: int = 0  # first global sequence position of the local tensor (sequence parallelism)
    # Sample placement (NetMoE, ``parallel/sample_placement.py``) moves samples between the ranks of an
    # expert-parallel group for a run of blocks. ``placement[j]`` = original group index (position * rows +
    # slot) of the sample now at group index j; ``row_source[i]`` = this rank's local row i's original
    # ``shard * rows + slot``, used in place of ``shard * rows + i``. None = samples where the layout put them.
    placement: tuple[int, ...] | None = None
    row_source: tuple[int, ...] | None = None

    def rows(self, local_rows: int, device: torch.device) -> torch.Tensor:
        """Global row index (in the step's global batch) of each local row -> ``[local_rows]`` int64."""
        if self.row_source is not None:
            if len(self.row_source) != local_rows:
                raise RuntimeError(f"dropout coordinates place {len(self.row_source)} samples on this rank, the "
                                   f"tensor has {local_rows} rows. HINT: a sample-placement run must keep one batch "
                                   "layout; this is a bug in the run boundaries (parallel/sample_placement.py).")
            p = torch.tensor(self.row_source, device=device, dtype=torch.int64)
        else:
            p = self.shard * local_rows + torch.arange(local_rows, device=device, dtype=torch.int64)
        if self.micro_batches == 1:
            return p
        per_shard = local_rows * self.shards // self.loader_shards  # rows of one loader shard in this micro-batch
        return (p // per_shard) * (per_shard * self.micro_batches) + self.micro * per_shard + p % per_shard


_state = threading.local()
# Whether steps are keyed in this process, on any thread: autograd runs a CUDA backward on a device thread of its
# own, where no coordinates were ever set, and a recompute there must still be recognized as keyed.
_process = SimpleNamespace(keyed=False)


def coords() -> DropoutCoords:
    """The coordinates in force on this thread."""
    c = getattr(_state, "coords", None)
    if c is None:
        c = _state.coords = DropoutCoords()
    return c


def _set(c: DropoutCoords) -> None:
    _state.coords = c


def set_coords(**changes: Any) -> None:
    """Change some coordinates until the next change (the runtime's per-layer hooks use this)."""
    _set(replace(coords(), **changes))


@contextmanager
def use_coords(**changes: Any) -> Iterator[DropoutCoords]:
    """Temporarily change some coordinates (restored on exit, also on error)."""
    old = coords()
    _set(replace(old, **changes))
    try:
        yield coords()
    finally:
        _set(old)


@contextmanager
def restore_coords(saved: DropoutCoords) -> Iterator[None]:
    """Install coordinates for a block of code, call counts starting afresh (the single-process references
    run a step's forward and backward under this); the previous ones come back on exit. Whether steps count
    as keyed follows ``saved``, whose key decides for the block (:func:`check_not_foreign_recompute`)."""
    old, old_calls, old_keyed = coords(), getattr(_state, "calls", None), _process.keyed
    _set(saved)
    _state.calls = (saved.key, {})
    _process.keyed = saved.key is not None
    try:
        yield
    finally:
        _set(old)
        _state.calls = old_calls
        _process.keyed = old_keyed


# ---------------------------------------------------------------------------------------------------
# call index: the n-th call of one site under one key (and pipeline micro-batch) draws mask n
# ---------------------------------------------------------------------------------------------------
def _counts(key: int) -> dict[tuple[int, int], int]:
    """Calls so far of each (micro-batch, site) under ``key``; a new key starts afresh."""
    calls = getattr(_state, "calls", None)
    if calls is None or calls[0] != key:
        calls = _state.calls = (key, {})
    return calls[1]


def call_index(site: int, c: DropoutCoords) -> int:
    """Which call of ``site`` under ``c``'s key and micro-batch this is (0, 1, ...).

    Why: ``nn.Dropout`` draws a fresh mask at every call, so a module applied twice in one forward, or a
    model run twice on one batch (two views of a sample for a contrastive loss, two ``manual_backward`` in
    one step) sees independent masks; keyed by coordinates alone, both calls would drop the same elements.
    The count is per pipeline micro-batch, so a pipeline stage running micro-batch m counts as one process
    running the whole batch does -- for layers called from one stage; a dropout module shared by layers on
    two stages (or two chunks of a rank) is counted per stage, and its masks then differ from one process's.
    A recompute must redraw the forward's masks: the runtime's checkpointing replays the counts and the
    coordinates of the forward (:func:`snapshot`, :func:`replay`)."""
    counts = _counts(c.key)  # type: ignore[arg-type]
    k = (c.micro, site)
    n = counts.get(k, 0)
    counts[k] = n + 1
    return n


def check_not_foreign_recompute(site: int, c: DropoutCoords) -> None:
    """Refuse a keyed mask drawn inside backward outside the runtime's replay: a recompute by an activation
    checkpoint in the model's own code (``torch.utils.checkpoint``, HF's ``gradient_checkpointing_enable``).

    Why an error: that recompute sees the coordinates of the moment it runs, not the forward's -- on CUDA no
    coordinates at all (autograd's device thread), under a pipeline a later micro-batch's, and call counts that
    the forward already advanced -- so it would redraw other masks than the forward used, and the gradients
    would be silently wrong."""
    if getattr(_state, "replaying", False) or torch._C._current_graph_task_id() == -1:
        return
    if c.key is not None or _process.keyed:
        raise RuntimeError(
            f"keyed dropout (site {site}) is recomputed in backward by an activation checkpoint the runtime does not "
            "manage, which cannot redraw the forward's mask (it does not know the forward's coordinates and call "
            "count). HINT: let the plan checkpoint the layer (LayerStrategy(checkpoint=True)) instead of calling "
            "torch.utils.checkpoint in the model (HF: leave gradient_checkpointing off).")


def restart_calls(micro: int) -> None:
    """Count micro-batch ``micro``'s calls afresh: a pipeline stage runs each micro-batch's forward once per
    step, and what ran before it under the key -- the schedule's first-step metadata inference runs the stage's
    module on stand-in inputs -- is not part of it."""
    c = coords()
    if c.key is not None:
        counts = _counts(c.key)
        for k in [k for k in counts if k[0] == micro]:
            del counts[k]


@dataclass(frozen=True)
class DropoutSnapshot:
    """Coordinates and call counts at one point of a forward (what a recompute must start from)."""

    coords: DropoutCoords
    counts: tuple[tuple[tuple[int, int], int], ...]


def snapshot() -> DropoutSnapshot:
    """The state a checkpointed region's forward starts from."""
    c = coords()
    counts = tuple(_counts(c.key).items()) if c.key is not None else ()
    return DropoutSnapshot(c, counts)


@contextmanager
def replay(saved: DropoutSnapshot) -> Iterator[None]:
    """Run a recompute from ``saved``: the same coordinates and call counts, so it redraws the same masks;
    what it counts is dropped on exit (the forward already counted those calls)."""
    old_coords, old_calls, old_replaying = coords(), getattr(_state, "calls", None), getattr(_state, "replaying", False)
    _set(saved.coords)
    _state.calls = (saved.coords.key, dict(saved.counts))
    _state.replaying = True
    try:
        yield
    finally:
        _set(old_coords)
        _state.calls = old_calls
        _state.replaying = old_replaying


def set_dropout_key(key: int | None) -> None:
    """Set the step key until the next call (the strategy calls it at every training micro-step); the
    call counts start afresh, also when the key repeats."""
    if key is not None and (isinstance(key, bool) or not isinstance(key, int)):
        raise TypeError(f"dropout key {key!r}: must be an int or None. HINT: use global_step * accumulate + k.")
    set_coords(key=key)
    _state.calls = (key, {})
    _process.keyed = key is not None


@contextmanager
def dropout_key(key: int) -> Iterator[None]:
    """Run a forward (and its backward) with step key ``key``, call counts afresh; the single-process
    reference does the same."""
    with restore_coords(replace(coords(), key=key)):
        yield


# ---------------------------------------------------------------------------------------------------
# the hash: SplitMix64's finalizer on int64 (two's-complement wrap-around = the unsigned arithmetic)
# ---------------------------------------------------------------------------------------------------
def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic on signed integers)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def keep_mask(shape: torch.Size, p: float, key: int, site: int, c: DropoutCoords,
              device: torch.device) -> torch.Tensor:
    """Boolean keep-mask for a local ``[rows, seq, ...]`` (or ``[rows, ...]``) tensor at coordinates ``c``."""
    rows = c.rows(shape[0], device)  # [b]
    z = _mix(rows * _GOLDEN + _mix(torch.tensor((key * 1_000_003 + site) & ((1 << 62) - 1), dtype=torch.int64,
                                                device=device)))  # [b]
    if len(shape) >= 2:
        pos = c.seq_offset + torch.arange(shape[1], device=device, dtype=torch.int64)  # [s]
        z = _mix(z[:, None] + pos[None, :] * _GOLDEN)  # [b, s]
    channels = 1
    for n in shape[2:]:
        channels *= n
    ch = torch.arange(channels, device=device, dtype=torch.int64)  # [c]
    z = _mix(z.reshape(*z.shape, 1) + ch * _GOLDEN)  # [b, s, c] (or [b, c])
    u = _shr(z, 40).to(torch.float64) / float(1 << 24)  # top 24 bits -> uniform [0, 1)
    return (u >= p).reshape(shape)


def site_of(name: str) -> int:
    """A stable site id for a module's qualified name (identical in every process)."""
    return zlib.crc32(name.encode())


class KeyedDropout(nn.Dropout):
    """Drop-in ``nn.Dropout`` whose mask depends only on global coordinates (see the module docstring).

    ``site`` tells dropout layers apart. Models give each its qualified name's id (:func:`assign_sites`,
    called by the reference decoders' constructors, so the ids do not depend on what wraps the model);
    without that, a site is drawn from torch's generator at construction (identical on ranks that seed
    alike, and kept by ``deepcopy``).
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, site: int | None = None) -> None:
        super().__init__(p, inplace)
        self.site = int(torch.randint(0, 1 << 31, (1,), device="cpu")) if site is None else int(site)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        c = coords()
        check_not_foreign_recompute(self.site, c)
        if c.key is None:
            key, site = int(torch.randint(0, 1 << 62, (1,))), self.site
        else:
            key, site = c.key, self.site + (call_index(self.site, c) << 32)  # call 0 keeps the site's own stream
        mask = keep_mask(x.shape, self.p, key, site, c, x.device)
        out = x * mask.to(x.dtype) * (1.0 / (1.0 - self.p))
        if self.inplace:
            return x.copy_(out)
        return out


def assign_sites(model: nn.Module) -> None:
    """Give every :class:`KeyedDropout` in ``model`` the site id of its qualified name."""
    for name, m in model.named_modules():
        if isinstance(m, KeyedDropout):
            m.site = site_of(name)


def keyed_dropout_(model: nn.Module) -> int:
    """Replace every plain ``nn.Dropout`` in ``model`` by a :class:`KeyedDropout` of the same ``p`` (in
    place, module names unchanged), its site the id of its name under ``model``; returns how many.

    Existing :class:`KeyedDropout` layers keep their sites. To compare with one process, convert the
    single-process copy the same way, from the same root."""
    replaced = 0
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                full = f"{name}.{child_name}" if name else child_name
                setattr(parent, child_name, KeyedDropout(child.p, child.inplace, site=site_of(full)))
                replaced += 1
    return replaced
