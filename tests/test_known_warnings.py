"""Understood library warnings: once on rank 0, never on the other ranks; unknown warnings untouched (issue 16 item 5).

In-process: each check emits a known warning three times as the library would (attributed to a ``lightning.``
module) next to an unknown one, under ``"always"`` so that anything not filtered by the package would show every
time. A real 2-rank run (tests/test_cli.py::test_demo_auto_beyond_one_epoch_prints_its_plan_once_and_the_loss)
checks the per-step Lightning warning shows exactly once in the output of both ranks.
"""

from __future__ import annotations

import uuid
import warnings

import pytest

from lightning_galv.known_warnings import KNOWN_WARNINGS, silence_known_warnings

KNOWN = "`isinstance(treespec, LeafSpec)` is deprecated"  # KNOWN_WARNINGS[0], as torch words it


def _emit(rank: int | None, times: int = 3) -> tuple[int, int]:
    """(known warnings shown, unknown warnings shown) after ``times`` emissions of each, in a fresh filter state."""
    tag = uuid.uuid4().hex  # "once" remembers message texts process-wide: a text no other check used
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_known_warnings(rank)
        for step in range(times):
            warnings.warn_explicit(f"{KNOWN} {tag}", FutureWarning, "result.py", 10 + step,
                                   module="lightning.pytorch.trainer.connectors.logger_connector.result")
            warnings.warn_explicit(f"something new {tag}", FutureWarning, "result.py", 10 + step,
                                   module="lightning.pytorch.trainer.connectors.logger_connector.result")
    known = sum(str(w.message).startswith(KNOWN) for w in seen)
    return known, sum(str(w.message).startswith("something new") for w in seen)


def test_known_warning_once_on_rank_0_never_elsewhere_unknown_untouched() -> None:
    assert _emit(0) == (1, 3)  # rank 0: shown the first time only; the unknown one every time ("always")
    assert _emit(1) == (0, 3)
    assert _emit(3) == (0, 3)


@pytest.mark.parametrize("env,known", [({}, 1), ({"RANK": "0"}, 1), ({"RANK": "2"}, 0), ({"LOCAL_RANK": "1"}, 0),
                                       ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, 0), ({"LOCAL_RANK": "0"}, 1)])
def test_rank_from_the_launchers_environment(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                             known: int) -> None:
    for var in ("RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert _emit(None) == (known, 3)


def test_filters_only_name_known_warnings() -> None:
    """Every filter the call adds matches a KNOWN_WARNINGS entry (message, category, module) and nothing else."""
    with warnings.catch_warnings():
        before = list(warnings.filters)
        silence_known_warnings(1)
        added = [f for f in warnings.filters if f not in before]
    assert len(added) == len(KNOWN_WARNINGS)
    for (action, message, category, module, _), w in zip(added, reversed(KNOWN_WARNINGS)):
        assert action == "ignore" and message.pattern == w.message and category is w.category
        assert module.pattern == w.module
