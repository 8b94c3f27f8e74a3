"""Failures are seen on every rank (issue 9 item 9): a rank-0-only decision that fails is raised everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_galv.testing import run_distributed

LIGHTNING = str(Path(__file__).parent / "dist_lightning_checks.py")


@pytest.mark.slow
@pytest.mark.distributed
def test_infeasible_auto_budget_raises_the_same_value_error_on_every_rank() -> None:
    results = run_distributed(LIGHTNING + "::fit_infeasible_budget", 2, ("1KB",), init_process_group=False,
                              timeout=300)
    assert [r["type"] for r in results] == ["ValueError", "ValueError"], results
    assert results[0]["message"] == results[1]["message"], results
    msg = results[0]["message"]
    assert "memory_budget=1000 bytes" in msg and "no plan fits" in msg and "HINT:" in msg, msg
