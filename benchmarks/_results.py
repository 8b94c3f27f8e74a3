"""One writer for benchmarks/RESULTS.md: each benchmark owns one delimited section and replaces only it.

Every section is stamped when written (issue 17): the commit it was measured at (``+uncommitted`` when the
work tree differed from it), the date, the 1-, 5- and 15-minute load averages when it wrote (the longer ones
cover most of a benchmark's run), and the exact command line, with the ``GALV_*`` settings that change what is
measured (e.g. ``GALV_PROFILE_BUDGET_S``) in front of it -- so a reader can re-run the figure and knows
how busy the machine was.
"""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
# GALV_* variables that do not change a measurement (where files go, the test launcher's start method)
_NOT_MEASURED = {"GALV_CACHE_DIR", "GALV_JUDGE", "GALV_START_METHOD", "GALV_TEST_THREADS", "GALV_TEST_ABORT_MARKER",
                 "GALV_TEST_TAG"}
HERE = Path(__file__).resolve().parent


def _is_output(line: str) -> bool:
    """A ``git status --porcelain`` line about a benchmark's own output (RESULTS.md, benchmarks/data/): scripts
    run one after another must not stamp each other's results as uncommitted code."""
    path = line[3:].strip()
    return path in ("benchmarks/RESULTS.md",) or path.startswith("benchmarks/data/")


def commit() -> str:
    """Short hash of HEAD, with ``+uncommitted`` when tracked files other than benchmark outputs differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                                capture_output=True, text=True).stdout.splitlines()
        dirty = [line for line in status if line.strip() and not _is_output(line)]
        return (head.stdout.strip() or "unknown") + ("+uncommitted" if dirty else "")
    except OSError:
        return "unknown"


def stamp(argv: list[str] | None = None) -> str:
    """The line every section carries: commit, date, load average at start and now, command."""
    argv = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(argv[0]), HERE.parent) if argv and argv[0] else "?"
    # settings the package reads from the environment that change what is measured (automatic mode's profile
    # budget, GALV_PROFILE_BUDGET_S) are part of the command; where caches and rank logs go is not
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith("GALV_") and k not in _NOT_MEASURED]
    cmd = " ".join([*env, "python", script, *map(shlex.quote, argv[1:])])
    one, five, fifteen = os.getloadavg()
    return (f"*Run at commit {commit()}, {datetime.date.today()}, load average over the last 1 / 5 / 15 min when "
            f"written {one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} cores; command `{cmd}`.*")


def write_section(name: str, body: str, path: Path = RESULTS, stamped: bool = True) -> None:
    """Replace ``<!-- name:start -->...<!-- name:end -->`` with ``body`` (append the section if missing).

    With ``stamped`` the :func:`stamp` line goes right under the section's heading (its first line)."""
    if stamped:
        head, sep, rest = body.partition("\n")
        body = f"{head}\n\n{stamp()}\n{rest}" if sep else f"{head}\n\n{stamp()}"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body}\n{end}"
    text = path.read_text() if path.is_file() else "# Benchmark results\n"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
