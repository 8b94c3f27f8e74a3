"""Library warnings this package understands: shown once, on rank 0, instead of once per rank and step.

Each rank of a multi-process run is its own Python process, so a warning raised inside a library repeats
once per rank -- four copies of a deprecation notice about code the user never wrote and cannot change --
and a warning raised on every step repeats on every step. The warnings listed here are understood (why each
is harmless is written next to it): rank 0 shows each of them the first time it happens (Python's ``"once"``
action: one showing per message text in the process), the other ranks ignore them. They are not hidden
altogether, because a user reading the log should still be able to see what the libraries say once. Every
other warning is left to Python's normal rules on every rank, so anything new still shows.

:func:`silence_known_warnings` is idempotent (``warnings.filterwarnings`` drops an identical earlier filter,
and a later call's filter takes precedence). :class:`~lightning_galv.GalvatronStrategy` calls it on
construction and at the start of each rank's ``setup_environment`` with the rank the launcher's environment
variables say (:func:`_rank_from_environment`: ranks started by ``spawn`` never run the constructor), and once
more when the strategy has computed the global rank.
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple


class KnownWarning(NamedTuple):
    category: type[Warning]
    message: str  # regex matched against the start of the message
    module: str  # regex matched against the module the warning is attributed to
    why: str  # why it is safe to ignore


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.",
                 "Lightning 2.6.6 builds torch.utils._pytree.LeafSpec (deprecated in torch 2.13) in its own "
                 "result collection on every step; nothing a user's code does triggers or can avoid it"),
)


def _rank_from_environment() -> int:
    """``RANK`` (torchrun, this package's launcher) if set; else 0 only if ``LOCAL_RANK`` and ``NODE_RANK`` (Lightning's
    subprocess launcher sets them in the ranks it starts) are both 0 or unset -- 1 stands for "not rank 0"."""
    if os.environ.get("RANK"):
        return int(os.environ["RANK"])
    return 0 if all(int(os.environ.get(v) or 0) == 0 for v in ("LOCAL_RANK", "NODE_RANK")) else 1


def silence_known_warnings(rank: int | None = None) -> None:
    """Show every warning in :data:`KNOWN_WARNINGS` once if this process is global rank 0, ignore it on the other
    ranks; leaves all other warnings alone. ``rank`` defaults to what the environment says
    (:func:`_rank_from_environment`)."""
    if rank is None:
        rank = _rank_from_environment()
    action = "once" if rank == 0 else "ignore"
    for w in KNOWN_WARNINGS:
        warnings.filterwarnings(action, message=w.message, category=w.category, module=w.module)
