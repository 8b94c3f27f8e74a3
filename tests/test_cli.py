"""LightningCLI recipes and the galv command (no processes are launched here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_galv import GalvatronStrategy
from lightning_galv.cli import main as galv
from lightning_galv.plan import ParallelPlan

ROOT = Path(__file__).resolve().parents[1]


def test_recipe_builds_the_strategy_from_class_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the recipe names its plan file relative to the repository
    cli = _cli_without_running()
    strategy = cli.trainer.strategy
    assert isinstance(strategy, GalvatronStrategy)
    assert strategy._plan_spec == ParallelPlan.load(ROOT / "recipes/plans/hetero4.yaml")
    assert cli.model.hparams.n_heads == 8 and cli.datamodule.batch_size == 4


def _cli_without_running():  # type: ignore[no-untyped-def]
    from lightning.pytorch.cli import LightningCLI

    from lightning_galv.demo.corpus import ByteCorpus
    from lightning_galv.demo.module import CausalLM

    return LightningCLI(CausalLM, ByteCorpus, run=False, args=["--config", str(ROOT / "recipes/tiny_cpu.yaml")])


def test_galv_plan_show(capsys: pytest.CaptureFixture[str]) -> None:
    galv(["plan", "show", str(ROOT / "recipes/plans/hetero4.yaml")])
    out = capsys.readouterr().out
    assert "tp+sp4" in out and "ulysses2·dp2" in out


def test_galv_unknown_command() -> None:
    with pytest.raises(SystemExit, match="HINT"):
        galv(["frobnicate"])
