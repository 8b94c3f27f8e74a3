"""Where Galvatron's judge lives, and running a benchmark script inside the judge's own virtualenv.

Why a re-exec: the judge (../shared/galvatron-judge, prepared by its setup.sh) imports Galvatron 2.4.0 and its
pinned dependencies from a separate venv; a script that scores plans with it restarts itself under that venv's
Python (same arguments) before importing anything else, and falls back to the current interpreter if the venv
is missing (the script then reports what it cannot import)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JUDGE = Path(os.environ.get("GALV_JUDGE", ROOT.parent / "shared" / "galvatron-judge"))
VENV = Path(os.environ.get("JUDGE_VENV", Path(tempfile.gettempdir()) / "judge-venv"))


def enter_judge_venv(script: str) -> None:
    """Re-exec ``script`` (run as ``__main__``) under the judge venv's Python unless already there."""
    python = VENV / "bin/python"
    if os.path.realpath(sys.prefix) != os.path.realpath(VENV) and python.exists():
        os.execv(str(python), [str(python), os.path.abspath(script)] + sys.argv[1:])


def add_judge_paths() -> None:
    """The judge and the repository importable (scripts run as ``__main__`` or imported by tests)."""
    for p in (str(JUDGE), str(ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)
