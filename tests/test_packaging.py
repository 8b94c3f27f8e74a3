"""Tool settings: pyproject.toml for every tool that reads it, setup.cfg only for those that do not."""

from __future__ import annotations

import configparser
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# tools configured in setup.cfg because they cannot read pyproject.toml
SETUP_CFG_ONLY = {"flake8"}


def test_setup_cfg_holds_only_tools_that_do_not_read_pyproject() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert set(cfg.sections()) == SETUP_CFG_ONLY, cfg.sections()
    tools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert not SETUP_CFG_ONLY & set(tools), "a tool configured in both files"
    assert {"pytest", "mypy"} <= set(tools)


def test_pytest_reads_its_settings_from_pyproject() -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", "--co", "tests/test_packaging.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "configfile: pyproject.toml" in out.stdout and "timeout: 900.0s" in out.stdout, out.stdout
