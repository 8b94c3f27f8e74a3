"""Byte sizes for people: every message that shows a memory size formats it here.

A size is shown in the largest binary unit in which it is at least 1, so a tiny budget reads
``1000 B`` or ``7.49 MiB`` instead of ``0.00 GiB`` -- a number a user can compare and act on. Imports
nothing, so the torch-free modules (``plan``, ``planner``) can use it.
"""

from __future__ import annotations

_UNITS = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10))


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``, ``5e9`` -> ``'4.66 GiB'``, ``12`` -> ``'12 B'`` (inf/nan as such)."""
    if n != n or n in (float("inf"), float("-inf")):
        return f"{n} B"
    for name, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {name}"
    return f"{n:.0f} B"


def format_bytes_list(values: "list[float] | tuple[float, ...]") -> str:
    """``[a, b]`` with each size in its own unit (stages of one plan can differ by orders of magnitude)."""
    return "[" + ", ".join(format_bytes(v) for v in values) + "]"
