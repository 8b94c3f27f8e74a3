"""Peak memory of this process, as the runtime and the tuner measure it.

On CUDA: the caching allocator's peak. On CPU: the resident-set high-water mark of this process's own
address space, read from ``/proc/self/status`` (``VmHWM``) on Linux. Not ``getrusage().ru_maxrss``: Linux
carries that value across ``exec``, so a rank started by ``fork`` + ``exec`` from a large parent (a
long pytest session, a notebook) reports the *parent's* size at fork time until it outgrows it -- trial
peaks at 1 and 16 samples per rank both read 655 MB that way. ``ru_maxrss`` stays the fallback where
``/proc`` is missing (macOS, where it is in bytes). A rank forked *without* exec from a fork server
(``lightning_galv.forkserver``: the launcher of the tuner's trials) starts with the server's heap counted
(torch and Lightning imported, ~340 MB on the CPU test machine) but counts shared-library code pages only as it
touches them, where a fresh interpreter also counts those its imports touched: its CPU peak reads lower by up to
the size of those pages (~100 MB there). CUDA peaks are unaffected.
"""

from __future__ import annotations

import resource
import sys

import torch


def peak_rss_bytes() -> float:
    """This address space's resident-set high-water mark in bytes (see the module docstring)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(int(line.split()[1]) * 1024)  # reported in kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def peak_memory_bytes(device: torch.device) -> float:
    """The CUDA allocator's peak on GPU, the process's resident-set high-water mark on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()
