"""Library warnings this package understands, silenced so that they do not drown what matters.

Each rank of a multi-process run is its own Python process, so a warning raised inside a library repeats
once per rank -- four copies of a deprecation notice about code the user never wrote and cannot change.
The warnings listed here are understood (why each is harmless is written next to it) and are ignored on
every rank; every other warning is left to Python's normal rules, so anything new still shows.

:func:`silence_known_warnings` is idempotent (``warnings.filterwarnings`` drops an identical earlier
filter); :class:`~lightning_galv.GalvatronStrategy` calls it on construction and again in each rank's
``setup_environment`` (ranks started by ``spawn`` do not re-run the constructor).
"""

from __future__ import annotations

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


def silence_known_warnings() -> None:
    """Ignore every warning in :data:`KNOWN_WARNINGS` in this process (leaves all other warnings alone)."""
    for w in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=w.message, category=w.category, module=w.module)
